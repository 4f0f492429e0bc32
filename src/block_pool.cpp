#include "block_pool.hpp"
#include "ghostlink/detail/flavour.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <new>
#include <system_error>
#include <utility>

#include "block.hpp"
#include "fault_countdown.hpp"
#include "ghostlink/error.hpp"
#include "prefix_index.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

constexpr std::size_t block_alignment = 64;

std::atomic<std::uint64_t> next_owner{1};
std::atomic<std::size_t> live_pools{0};
std::atomic<std::size_t> unbalanced_pools{0};

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

bool block_pool::reserve_evicting() noexcept {
  std::lock_guard lock(index_mutex_);
  for (;;) {
    if (reserve()) return true;
    if (!index_ || !index_->evict_one()) return false;
  }
}

bool block_pool::reserve_many(std::size_t n) noexcept {
  std::lock_guard lock(index_mutex_);
  if (blocks_available() < n) return false;  // refused whole, nothing evicted
  for (;;) {
    std::size_t used = in_use_.load(std::memory_order_relaxed);
    while (used <= max_blocks_ && n <= max_blocks_ - used) {
      if (in_use_.compare_exchange_weak(used, used + n, std::memory_order_relaxed)) {
        std::size_t peak = peak_.load(std::memory_order_relaxed);
        while (peak < used + n && !peak_.compare_exchange_weak(peak, used + n, std::memory_order_relaxed)) {
        }
        return true;
      }
    }
    if (!index_ || !index_->evict_one()) return false;
  }
}

std::size_t block_pool::blocks_available() const noexcept {
  const std::size_t used = in_use_.load(std::memory_order_relaxed);
  return (used < max_blocks_ ? max_blocks_ - used : 0) + reclaimable_blocks_.load(std::memory_order_relaxed);
}

bool block_pool::attach_index(prefix_index* index) noexcept {
  std::lock_guard lock(index_mutex_);
  if (index_) return false;
  index_ = index;
  return true;
}

void block_pool::detach_index() noexcept {
  std::lock_guard lock(index_mutex_);
  index_ = nullptr;
}

void block_pool::cached_block_idle(const block* b) noexcept {
  std::lock_guard lock(index_mutex_);
  if (index_) index_->block_idle(b);
}

block_account::~block_account() {
  const std::size_t n = left.load(std::memory_order_relaxed);
  if (n == 0) return;
  pool->count_reserved(-static_cast<std::int64_t>(n));
  pool->unreserve(n);
}

void* block_pool::take_memory() noexcept {
  if (count_down(failures_) > 0) return nullptr;  // the next `failures_` fail
  void* memory = free_->pop();
  if (memory) {
    free_count_.fetch_sub(1, std::memory_order_relaxed);
    return memory;
  }
  memory = ::operator new(block::header_bytes + payload_bytes_, std::align_val_t{block_alignment}, std::nothrow);
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

std::uint64_t block_pool::new_owner_id() noexcept { return next_owner.fetch_add(1, std::memory_order_relaxed); }
std::size_t block_pool::pools_alive() noexcept { return live_pools.load(std::memory_order_relaxed); }
std::size_t block_pool::pools_destroyed_unbalanced() noexcept {
  return unbalanced_pools.load(std::memory_order_relaxed);
}

// Blocks: their memory comes from the pool and goes back to it.

block::block(block_pool& pool, std::uint64_t owner, budget b) noexcept
    : budget_(b), pool_(ref_ptr<block_pool>::share(&pool)), owner_(owner) {}

ref_ptr<block> block::make(block_pool& pool, std::uint64_t owner, budget b, block_account* account) noexcept {
  static_assert(sizeof(block) <= header_bytes);
  const bool counted = b == budget::counted;
  // The budget: the sequence's reservation first, then the pool; evicting
  // prefix-cache entries only once the pool's budget is spent.
  const bool from_account = counted && account && account->take();
  if (from_account)
    pool.count_reserved(-1);
  else if (counted && !pool.reserve() && !pool.reserve_evicting())
    return {};
  void* memory = pool.take_memory();
  if (!memory) {
    if (from_account) {
      pool.count_reserved(1);
      account->give_back();
    } else if (counted) {
      pool.unreserve();
    }
    return {};
  }
  if (counted) pool.emit({.what = kv_event::kind::block_allocated, .cache = owner});
  return ref_ptr<block>::adopt(::new (memory) block(pool, owner, b));
}

ref_ptr<block> block::make_zeros(block_pool& pool, std::size_t block_tokens) noexcept {
  ref_ptr<block> zeros = make(pool, 0, budget::exempt);
  if (zeros) {
    std::memset(zeros->payload(), 0, pool.payload_bytes());
    zeros->set_filled(block_tokens);
  }
  return zeros;
}

void block::add_ref() const noexcept {
  if ((refs_.fetch_add(1, std::memory_order_relaxed) & outside_mask) == 1 && budget_ == budget::counted)
    pool_->count_shared(1);
}

void block::release() const noexcept {
  // The pool's shared count is settled while this reference is still held:
  // once the count drops, another thread may free the block and its pool.
  // A cached block's last outside reference holds the pool past the drop,
  // to report the block idle.
  const bool counted = budget_ == budget::counted;
  ref_ptr<block_pool> cached_pool;
  std::uint32_t before = refs_.load(std::memory_order_relaxed);
  for (;;) {
    if (before == cached_bit + 1 && !cached_pool) cached_pool = pool_;
    const bool crossing = counted && (before & outside_mask) == 2;
    if (crossing) pool_->count_shared(-1);
    // acq_rel: every use by other owners happens-before the destruction.
    if (refs_.compare_exchange_weak(before, before - 1, std::memory_order_acq_rel, std::memory_order_relaxed)) break;
    if (crossing) pool_->count_shared(1);
  }
  if (before == 1)
    destroy();
  else if (before - 1 == cached_bit)
    cached_pool->cached_block_idle(this);  // the block may be gone already: only looked up, never read
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

}  // namespace detail
GHOSTLINK_NAMESPACE_END

GHOSTLINK_NAMESPACE_BEGIN

kv_block_pool::kv_block_pool(std::size_t block_bytes, kv_pool_limits limits) {
  const std::size_t by_bytes = block_bytes == 0 ? 0 : limits.max_bytes / block_bytes;
  const std::size_t max_blocks = limits.max_blocks < by_bytes ? limits.max_blocks : by_bytes;
  if (block_bytes == 0 || block_bytes % 2 != 0 || max_blocks == 0)
    throw std::system_error(make_error_code(kv_errc::invalid_config));
  state_ = new detail::block_pool(block_bytes, max_blocks);
}

kv_block_pool::kv_block_pool(const kv_block_pool& other) noexcept : state_(other.state_) {
  if (state_) state_->add_ref();
}
kv_block_pool::kv_block_pool(kv_block_pool&& other) noexcept : state_(std::exchange(other.state_, nullptr)) {}
kv_block_pool& kv_block_pool::operator=(const kv_block_pool& other) noexcept {
  kv_block_pool copy(other);
  std::swap(state_, copy.state_);
  return *this;
}
kv_block_pool& kv_block_pool::operator=(kv_block_pool&& other) noexcept {
  kv_block_pool taken(std::move(other));
  std::swap(state_, taken.state_);
  return *this;
}
kv_block_pool::~kv_block_pool() {
  if (state_) state_->release();
}

std::size_t kv_block_pool::block_bytes() const noexcept { return state_->payload_bytes(); }
void kv_block_pool::trim() noexcept { state_->trim(); }
void kv_block_pool::set_event_handler(kv_event_handler handler) { state_->set_event_handler(std::move(handler)); }

std::size_t kv_block_pool::blocks_available() const noexcept { return state_->blocks_available(); }

kv_block_reservation kv_block_pool::reserve(std::size_t blocks, std::error_code& ec) const noexcept {
  ec.clear();
  if (blocks == 0) return {};
  if (!state_->reserve_many(blocks)) {
    ec = kv_errc::capacity_exhausted;
    return {};
  }
  state_->count_reserved(static_cast<std::int64_t>(blocks));
  state_->add_ref();
  return {state_, blocks};
}

kv_block_reservation kv_block_pool::reserve(std::size_t blocks) const {
  std::error_code ec;
  kv_block_reservation r = reserve(blocks, ec);
  if (ec) throw std::system_error(ec);
  return r;
}

kv_block_reservation::kv_block_reservation(kv_block_reservation&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)), blocks_(std::exchange(other.blocks_, 0)) {}

kv_block_reservation& kv_block_reservation::operator=(kv_block_reservation&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    blocks_ = std::exchange(other.blocks_, 0);
  }
  return *this;
}

void kv_block_reservation::reset() noexcept {
  if (!pool_) return;
  const std::size_t n = std::exchange(blocks_, 0);
  pool_->count_reserved(-static_cast<std::int64_t>(n));
  pool_->unreserve(n);
  std::exchange(pool_, nullptr)->release();
}

kv_block_pool kv_block_reservation::pool() const noexcept {
  return detail::pool_access::handle(detail::ref_ptr<detail::block_pool>::share(pool_));
}

kv_pool_stats kv_block_pool::stats() const noexcept {
  const detail::block_pool& p = *state_;
  kv_pool_stats s;
  s.block_bytes = p.payload_bytes();
  s.max_blocks = p.max_blocks();
  s.blocks_in_use = p.blocks_in_use();
  s.blocks_free = p.blocks_free();
  s.peak_blocks_in_use = p.peak_blocks_in_use();
  s.blocks_shared = p.blocks_shared();
  s.cow_copies = p.cow_copies();
  s.blocks_allocated = p.blocks_allocated();
  s.blocks_cached = p.cached_blocks();
  s.blocks_cached_idle = p.idle_cached_blocks();
  s.blocks_reserved = p.blocks_reserved();
  s.blocks_available = p.blocks_available();
  return s;
}

GHOSTLINK_NAMESPACE_END
