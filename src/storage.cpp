#include "ghostlink/detail/storage.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <new>
#include <utility>

namespace ghostlink::detail {
namespace {

constexpr std::size_t block_alignment = 64;
// The payload starts on its own cache line after the header.
constexpr std::size_t header_bytes = 64;

std::atomic<std::uint64_t> next_owner{1};
std::atomic<std::size_t> live_pools{0};
std::atomic<std::size_t> unbalanced_pools{0};
std::atomic<std::size_t> metadata_countdown{0};  // see fail_metadata_allocation; 0: none pending

/// Counts a test's fault-injection counter down by one unless it is zero;
/// returns its value before (0: nothing injected).
std::size_t count_down(std::atomic<std::size_t>& counter) noexcept {
  std::size_t n = counter.load(std::memory_order_relaxed);
  while (n > 0 && !counter.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) {
  }
  return n;
}

}  // namespace

/// Freed blocks' memory, ready for reuse, from and to any thread (a
/// snapshot released on a reader thread returns its blocks here): a stack,
/// so the block reused next is the one freed last, still warm in cache.
/// Each free block's first bytes hold the next; pushing allocates nothing.
/// A mutex, held for a few instructions, where moodycamel's queue (which
/// this replaced) raced under TSan (upstream cameron314/concurrentqueue#404)
/// and cost more per block.
struct free_list {
  std::mutex mutex;
  void* head = nullptr;

  static void*& next(void* memory) noexcept { return *static_cast<void**>(memory); }
  void push(void* memory) noexcept {
    std::lock_guard lock(mutex);
    next(memory) = head;
    head = memory;
  }
  void* pop() noexcept {
    std::lock_guard lock(mutex);
    void* memory = head;
    if (memory) head = next(memory);
    return memory;
  }
  /// Empties the list; returns its first block (each links the next).
  void* pop_all() noexcept {
    std::lock_guard lock(mutex);
    return std::exchange(head, nullptr);
  }
};

block_pool::block_pool(std::size_t payload_bytes, std::size_t max_blocks)
    : payload_bytes_(payload_bytes), max_blocks_(max_blocks), free_(std::make_unique<free_list>()) {
  live_pools.fetch_add(1, std::memory_order_relaxed);
}

block_pool::~block_pool() {
  trim();
  if (blocks_in_use() != 0) unbalanced_pools.fetch_add(1, std::memory_order_relaxed);
  live_pools.fetch_sub(1, std::memory_order_relaxed);
}

bool block_pool::reserve() noexcept {
  std::size_t n = in_use_.load(std::memory_order_relaxed);
  do {
    if (n >= max_blocks_) return false;
  } while (!in_use_.compare_exchange_weak(n, n + 1, std::memory_order_relaxed));
  std::size_t peak = peak_.load(std::memory_order_relaxed);
  while (peak < n + 1 && !peak_.compare_exchange_weak(peak, n + 1, std::memory_order_relaxed)) {
  }
  return true;
}

void* block_pool::take_memory() noexcept {
  if (count_down(failures_) > 0) return nullptr;  // the next `failures_` fail
  void* memory = free_->pop();
  if (memory) {
    free_count_.fetch_sub(1, std::memory_order_relaxed);
    return memory;
  }
  memory = ::operator new(header_bytes + payload_bytes_, std::align_val_t{block_alignment}, std::nothrow);
  if (memory) allocated_.fetch_add(1, std::memory_order_relaxed);
  return memory;
}

void block_pool::give_memory(void* memory) noexcept {
  free_->push(memory);
  free_count_.fetch_add(1, std::memory_order_relaxed);
}

void block_pool::set_event_handler(kv_event_handler handler) {
  auto sink = std::make_unique<event_sink>();
  const bool on = static_cast<bool>(handler);
  sink->handler = std::move(handler);
  std::lock_guard lock(sink_mutex_);
  sink->replaced = std::move(sinks_);
  sinks_ = std::move(sink);
  sink_.store(on ? sinks_.get() : nullptr, std::memory_order_release);
}

void block_pool::trim() noexcept {
  for (void* memory = free_->pop_all(); memory;) {
    void* const next = free_list::next(memory);
    free_count_.fetch_sub(1, std::memory_order_relaxed);
    allocated_.fetch_sub(1, std::memory_order_relaxed);
    ::operator delete(memory, std::align_val_t{block_alignment});
    memory = next;
  }
}

std::size_t block_pool::blocks_shared() const noexcept {
  // Crossings are counted as they happen on different threads, so a reading
  // taken mid-crossing may be one short; never report below zero.
  const std::int64_t n = shared_.load(std::memory_order_relaxed);
  return n > 0 ? static_cast<std::size_t>(n) : 0;
}

void* metadata_new(std::size_t size) {
  if (count_down(metadata_countdown) == 1) throw std::bad_alloc();  // the one the countdown reaches fails
  return ::operator new(size);
}

void fail_metadata_allocation(std::size_t after) noexcept {
  metadata_countdown.store(after + 1, std::memory_order_relaxed);
}

bool cancel_metadata_failure() noexcept { return metadata_countdown.exchange(0, std::memory_order_relaxed) != 0; }

std::uint64_t block_pool::new_owner_id() noexcept { return next_owner.fetch_add(1, std::memory_order_relaxed); }
std::size_t block_pool::pools_alive() noexcept { return live_pools.load(std::memory_order_relaxed); }
std::size_t block_pool::pools_destroyed_unbalanced() noexcept {
  return unbalanced_pools.load(std::memory_order_relaxed);
}

void epoch_registry::add(epoch* e) noexcept {
  std::lock_guard lock(mutex_);
  e->older = newest_;
  (newest_ ? newest_->newer : oldest_) = e;
  newest_ = e;
  ++count_;
}

void epoch_registry::remove(epoch* e) noexcept {
  std::lock_guard lock(mutex_);
  (e->older ? e->older->newer : oldest_) = e->newer;
  (e->newer ? e->newer->older : newest_) = e->older;
  --count_;
}

epoch_registry::reading epoch_registry::read() const noexcept {
  std::lock_guard lock(mutex_);
  return {count_, oldest_ ? oldest_->number : 0};
}

block::block(block_pool& pool, std::uint64_t owner, budget b) noexcept
    : budget_(b), pool_(ref_ptr<block_pool>::share(&pool)), owner_(owner) {}

std::byte* block::payload() noexcept { return reinterpret_cast<std::byte*>(this) + header_bytes; }

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
