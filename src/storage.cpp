#include "ghostlink/detail/storage.hpp"

#include <algorithm>
#include <new>

namespace ghostlink::detail {
namespace {

constexpr std::size_t block_alignment = 64;
// Payload starts on its own cache line after the header.
constexpr std::size_t header_bytes = (sizeof(void*) * 4 + block_alignment - 1) / block_alignment * block_alignment;

}  // namespace

bool block_pool::reserve() noexcept {
  std::size_t n = in_use_.load(std::memory_order_relaxed);
  do {
    if (n >= max_blocks_) return false;
  } while (!in_use_.compare_exchange_weak(n, n + 1, std::memory_order_relaxed));
  return true;
}

block::block(block_pool& pool, std::uint64_t born_epoch, budget b) noexcept
    : pool_(ref_ptr<block_pool>::share(&pool)), born_epoch_(born_epoch), budget_(b) {}

float* block::data() noexcept { return reinterpret_cast<float*>(reinterpret_cast<char*>(this) + header_bytes); }

ref_ptr<block> block::make(block_pool& pool, std::uint64_t born_epoch, budget b, contents c) noexcept {
  static_assert(sizeof(block) <= header_bytes);
  const bool counted = b == budget::counted;
  if (counted && !pool.reserve()) return {};
  const std::size_t floats = 2 * pool.floats_per_half();
  void* raw = ::operator new(header_bytes + floats * sizeof(float), std::align_val_t{block_alignment}, std::nothrow);
  if (!raw) {
    if (counted) pool.unreserve();
    return {};
  }
  auto* blk = ::new (raw) block(pool, born_epoch, b);
  if (c == contents::zeroed) {
    std::fill_n(blk->data(), floats, 0.0f);
    blk->materialized_ = pool.block_tokens();
  }
  return ref_ptr<block>::adopt(blk);
}

void block::destroy(block* b) noexcept {
  ref_ptr<block_pool> pool = std::move(b->pool_);
  const bool counted = b->budget_ == budget::counted;
  b->~block();
  ::operator delete(static_cast<void*>(b), std::align_val_t{block_alignment});
  if (counted) pool->unreserve();
}

}  // namespace ghostlink::detail
