#include "block.hpp"

#include <cstring>
#include <new>
#include <utility>

namespace ghostlink::detail {

block::block(block_pool& pool, std::uint64_t owner, budget b) noexcept
    : budget_(b), pool_(ref_ptr<block_pool>::share(&pool)), owner_(owner) {}

ref_ptr<block> block::make(block_pool& pool, std::uint64_t owner, budget b) noexcept {
  static_assert(sizeof(block) <= header_bytes);
  const bool counted = b == budget::counted;
  if (counted && !pool.reserve()) return {};
  void* memory = pool.take_memory();
  if (!memory) {
    if (counted) pool.unreserve();
    return {};
  }
  if (counted) pool.emit({.what = kv_event::kind::block_allocated, .cache = owner});
  return ref_ptr<block>::adopt(::new (memory) block(pool, owner, b));
}

ref_ptr<block> block::make_zeros(block_pool& pool, std::size_t block_tokens) noexcept {
  ref_ptr<block> zeros = make(pool, 0, budget::exempt);
  if (zeros) {
    std::memset(zeros->payload(), 0, pool.payload_bytes());
    zeros->materialized_ = zeros->readable_ = block_tokens;
  }
  return zeros;
}

void block::add_ref() const noexcept {
  if (refs_.fetch_add(1, std::memory_order_relaxed) == 1 && budget_ == budget::counted) pool_->count_shared(1);
}

void block::release() const noexcept {
  // The pool's shared count is settled while this reference is still held:
  // once the count drops, another thread may free the block and its pool.
  const bool counted = budget_ == budget::counted;
  std::uint32_t before = refs_.load(std::memory_order_relaxed);
  for (;;) {
    const bool crossing = counted && before == 2;
    if (crossing) pool_->count_shared(-1);
    // acq_rel: every use by other owners happens-before the destruction.
    if (refs_.compare_exchange_weak(before, before - 1, std::memory_order_acq_rel, std::memory_order_relaxed)) break;
    if (crossing) pool_->count_shared(1);
  }
  if (before == 1) destroy();
}

void block::destroy() const noexcept {
  auto* self = const_cast<block*>(this);
  ref_ptr<block_pool> pool = std::move(self->pool_);
  const bool counted = budget_ == budget::counted;
  if (counted) pool->emit({.what = kv_event::kind::block_freed, .cache = owner_});
  self->~block();
  pool->give_memory(self);
  if (counted) pool->unreserve();
}

}  // namespace ghostlink::detail
