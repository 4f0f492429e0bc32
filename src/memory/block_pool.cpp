#include "memory/block_pool.hpp"
#include "ghostlink/detail/flavour.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <system_error>
#include <utility>

#include "base/fault_countdown.hpp"
#include "ghostlink/error.hpp"
#include "memory/block.hpp"
#include "memory/pages.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

constexpr std::size_t block_alignment = 64;

std::atomic<std::uint64_t> next_owner{1};
std::atomic<std::size_t> live_pools{0};
std::atomic<std::size_t> unbalanced_pools{0};

}  // namespace

/// An extent: up to 64 blocks' memory, their headers first (so a header's
/// address and slot give the extent), then the keys of every slot, then
/// the values of every slot. Which slots are free is one atomic mask: a
/// cursor claims its next slot with a compare-exchange, a freed block sets
/// its bit from whatever thread frees it; the pool's lock is taken only
/// when a slot frees up in a full extent or leaves it unused, and when a
/// cursor needs another extent. Which slots are committed (their pages may
/// be memory) is another mask, whose bit only the slot's holder changes:
/// the claimer of a slot not committed, or whoever releases the pages of a
/// slot it has claimed for that (block_pool::release_free_slots).
struct extent {  // NOLINT(cppcoreguidelines-pro-type-member-init): headers: raw storage, blocks built in it
  using mask = std::uint64_t;
  static constexpr unsigned max_slots = 64;
  static_assert(block_pool::reserved_extent_slots <= max_slots && block_pool::allocated_extent_slots <= max_slots);

  /// The lowest `n` bits (n <= max_slots).
  static constexpr mask low_bits(unsigned n) noexcept { return n == max_slots ? ~mask{0} : (mask{1} << n) - 1; }

  extent(unsigned slots, bool committed) noexcept  // NOLINT(cppcoreguidelines-pro-type-member-init): headers
      : all_free(low_bits(slots)), slots(slots), free_mask(all_free), committed_mask(committed ? all_free : 0) {}

  alignas(block_alignment) std::byte headers[max_slots][block::header_bytes];
  const mask all_free;  // a bit per slot
  const unsigned slots;
  std::atomic<mask> free_mask;            // bit i: slot i holds no block
  std::atomic<mask> committed_mask;       // bit i: slot i's pages may be memory
  std::atomic<unsigned> freeing{0};       // frees between setting their bit and putting it on its stack
  std::byte* keys = nullptr;              // slot i's at keys + i * half
  std::byte* values = nullptr;            // slot i's at values + i * half
  // The pool's, under its extents_mutex_.
  unsigned cursors = 0;  // cursors filling it
  bool on_unused = false, on_partial = false;
  extent* next_unused = nullptr;
  extent* next_partial = nullptr;
  extent* next_all = nullptr;
  extent* prev_all = nullptr;

  static extent& of(void* header, std::uint8_t slot) noexcept {
    return *reinterpret_cast<extent*>(static_cast<std::byte*>(header) - std::size_t{slot} * block::header_bytes);
  }
  /// Claims the lowest free slot that holds memory, else the lowest free
  /// slot from `from` on (none if `from >= slots`); false when there is
  /// none. A slot's committed bit read stale only orders the choice: the
  /// claimer reads it again once the slot is its own (block_pool::use_slot).
  bool claim(unsigned from, unsigned& slot) noexcept {
    return claim_lowest(committed_mask.load(std::memory_order_relaxed), from >= slots ? 0 : ~low_bits(from), slot);
  }
  /// Claims the lowest free slot that holds memory; false when none does.
  bool claim_committed(unsigned& slot) noexcept { return claim(slots, slot); }
  /// Claims `slot` if it is free.
  bool claim_exactly(unsigned slot) noexcept { return claim_lowest(mask{1} << slot, 0, slot); }
  /// Claims the lowest free slot of `first`, else of `then`.
  bool claim_lowest(mask first, mask then, unsigned& slot) noexcept {
    mask m = free_mask.load(std::memory_order_relaxed);
    for (;;) {
      mask open = m & first;
      if (open == 0) open = m & then;
      if (open == 0) return false;
      slot = static_cast<unsigned>(std::countr_zero(open));
      // acquire: the last holder's use of the slot happens-before ours.
      if (free_mask.compare_exchange_weak(m, m & ~(mask{1} << slot), std::memory_order_acquire,
                                          std::memory_order_relaxed))
        return true;
    }
  }
  /// Slots that hold memory.
  std::size_t committed_slots() const noexcept {
    return static_cast<std::size_t>(std::popcount(committed_mask.load(std::memory_order_relaxed)));
  }
  block_memory memory(unsigned slot, std::size_t key_bytes, std::size_t value_bytes) noexcept {
    return {headers[slot], keys + slot * key_bytes, values + slot * value_bytes, static_cast<std::uint8_t>(slot)};
  }
  /// No block, no cursor, and no free still to put it on its stack (the
  /// mask first: a free counts itself before it sets its bit).
  bool unused() const noexcept {
    return cursors == 0 && free_mask.load(std::memory_order_acquire) == all_free &&
           freeing.load(std::memory_order_acquire) == 0;
  }
};

/// A mapping of reserved address space that extents are carved from, in
/// order; unmapped with the pool.
struct block_pool::region {
  region* next = nullptr;
  std::byte* base = nullptr;
  std::size_t extents = 0, carved = 0;  // its bytes: extents * stride_
};

namespace {

std::size_t round_up(std::size_t n, std::size_t to) noexcept { return (n + to - 1) / to * to; }

/// The address space mapped at once for extents of `stride` bytes: about
/// 256 MiB, so that a server's pools hold a few mappings, not one per
/// extent (the system limits mappings per process).
std::size_t region_extents(std::size_t stride) noexcept {
  constexpr std::size_t region_bytes = std::size_t{256} << 20, most = 64;
  return std::clamp<std::size_t>(region_bytes / stride, 1, most);
}

}  // namespace

block_pool::block_pool(std::size_t payload_bytes, std::size_t max_blocks, std::pmr::memory_resource* memory,
                       bool keys_only)
    : payload_bytes_(payload_bytes),
      key_bytes_(keys_only ? payload_bytes : payload_bytes / 2),
      value_bytes_(payload_bytes - key_bytes_),
      max_blocks_(max_blocks),
      memory_(memory),
      reserved_(memory == nullptr && pages::supported() && key_bytes_ >= pages::size()),
      extent_slots_(reserved_ ? reserved_extent_slots : allocated_extent_slots),
      max_slots_(max_blocks > std::numeric_limits<std::size_t>::max() - extent_slots_
                     ? std::numeric_limits<std::size_t>::max()
                     : (max_blocks + extent_slots_ - 1) / extent_slots_ * extent_slots_),
      whole_pages_(reserved_ && key_bytes_ % pages::size() == 0 && value_bytes_ % pages::size() == 0) {
  if (reserved_) {
    header_area_ = round_up(sizeof(extent), pages::size());
    stride_ = header_area_ + round_up(extent_slots_ * payload_bytes_, pages::size());
    zeros_ = pages::reserve_zeros(round_up(payload_bytes_, pages::size()));
  }
  keep_.store(extent_slots_, std::memory_order_relaxed);
  live_pools.fetch_add(1, std::memory_order_relaxed);
}

block_pool::~block_pool() {
  if (blocks_in_use() != 0) unbalanced_pools.fetch_add(1, std::memory_order_relaxed);
  // Every block and every cursor holds the pool: none is left.
  const std::lock_guard lock(extents_mutex_);
  if (reserved_) {
    for (extent* e = all_; e;) std::exchange(e, e->next_all)->~extent();
    while (regions_) {
      region* const r = std::exchange(regions_, regions_->next);
      pages::unreserve(r->base, r->extents * stride_);
      delete r;
    }
    if (zeros_) pages::unreserve(zeros_, round_up(payload_bytes_, pages::size()));
  } else {
    while (all_) free_extent(*all_);
  }
  live_pools.fetch_sub(1, std::memory_order_relaxed);
}

bool block_pool::charge() noexcept {
  std::size_t n = in_use_.load(std::memory_order_relaxed);
  do {
    if (n >= max_blocks_) return false;
  } while (!in_use_.compare_exchange_weak(n, n + 1, std::memory_order_relaxed));
  std::size_t peak = peak_.load(std::memory_order_relaxed);
  while (peak < n + 1 && !peak_.compare_exchange_weak(peak, n + 1, std::memory_order_relaxed)) {
  }
  return true;
}

bool block_pool::charge_evicting() noexcept {
  std::lock_guard lock(reclaimer_mutex_);
  for (;;) {
    if (charge()) return true;
    if (!reclaimer_ || !reclaimer_->evict_one()) return false;
  }
}

bool block_pool::charge_many(std::size_t n) noexcept {
  std::lock_guard lock(reclaimer_mutex_);
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
    if (!reclaimer_ || !reclaimer_->evict_one()) return false;
  }
}

std::size_t block_pool::blocks_available() const noexcept {
  const std::size_t used = in_use_.load(std::memory_order_relaxed);
  return (used < max_blocks_ ? max_blocks_ - used : 0) + kept_reclaimable_.load(std::memory_order_relaxed);
}

bool block_pool::attach_reclaimer(reclaimer* r) noexcept {
  std::lock_guard lock(reclaimer_mutex_);
  if (reclaimer_) return false;
  reclaimer_ = r;
  return true;
}

void block_pool::detach_reclaimer() noexcept {
  std::lock_guard lock(reclaimer_mutex_);
  reclaimer_ = nullptr;
}

void block_pool::kept_block_idle(const block* b) noexcept {
  std::lock_guard lock(reclaimer_mutex_);
  if (reclaimer_) reclaimer_->block_idle(b);
}

block_account::~block_account() {
  const std::size_t n = left.load(std::memory_order_relaxed);
  if (n == 0) return;
  pool->count_reserved(-static_cast<std::int64_t>(n));
  pool->uncharge(n);
}

block_cursor::block_cursor(block_cursor&& other) noexcept
    : pool_(other.pool_), extent_(std::exchange(other.extent_, nullptr)), next_(other.next_) {}

block_cursor::~block_cursor() {
  if (!extent_) return;
  const std::lock_guard lock(pool_->extents_mutex_);
  pool_->leave(*this);
}

void block_pool::leave(block_cursor& cursor) noexcept {
  extent* const e = std::exchange(cursor.extent_, nullptr);
  if (!e) return;
  --e->cursors;
  --cursors_;
  classify(*e);
}

void block_pool::classify(extent& e) noexcept {
  if (e.unused()) {
    // Reserved: an unused extent's pages go back when the pool's free
    // memory is more than the blocks in use, and still what it keeps
    // without them: a pool that shrinks gives memory back, one that serves
    // steadily reuses it, and preallocated memory stays.
    const std::size_t free = free_count_.load(std::memory_order_relaxed);
    const std::size_t held = e.committed_slots();
    if (reserved_ && free > in_use_.load(std::memory_order_relaxed) && free >= held &&
        free - held >= keep_.load(std::memory_order_relaxed))
      release_extent(e);
    // Those holding memory apart from those that are address space alone:
    // a cursor takes the first kind first.
    extent*& stack = e.committed_mask.load(std::memory_order_relaxed) != 0 ? unused_ : empty_;
    if (!std::exchange(e.on_unused, true)) e.next_unused = std::exchange(stack, &e);
  } else if (e.free_mask.load(std::memory_order_relaxed) != 0) {
    if (!std::exchange(e.on_partial, true)) e.next_partial = std::exchange(partial_, &e);
  }
}

std::size_t block_pool::slot_cap() const noexcept {
  if (!reserved_) return max_slots_;
  // Address space alone: the budget, and an extent per cursor besides.
  const std::size_t extra = std::size_t{extent_slots_} * (cursors_ + 1);
  return max_slots_ > std::numeric_limits<std::size_t>::max() - extra ? std::numeric_limits<std::size_t>::max()
                                                                      : max_slots_ + extra;
}

extent* block_pool::grow() noexcept {
  if (slots_ > slot_cap() - extent_slots_) return nullptr;
  extent* const e = reserved_ ? carve() : new_extent();
  if (e) adopt(*e);
  return e;
}

extent* block_pool::carve() noexcept {
  if (!regions_ || regions_->carved == regions_->extents) {
    auto* r = new (std::nothrow) region;
    if (!r) return nullptr;
    // The usual mapping, else one extent's (less address space at once).
    for (std::size_t n : {region_extents(stride_), std::size_t{1}}) {
      r->base = static_cast<std::byte*>(pages::reserve(n * stride_));
      if (r->base) {
        r->extents = n;
        break;
      }
    }
    if (!r->base) {
      delete r;
      return nullptr;
    }
    r->next = std::exchange(regions_, r);
  }
  std::byte* const at = regions_->base + regions_->carved++ * stride_;
  auto* e = ::new (at) extent(extent_slots_, false);
  e->keys = at + header_area_;
  e->values = e->keys + extent_slots_ * key_bytes_;
  return e;
}

std::size_t block_pool::extent_bytes() const noexcept { return sizeof(extent) + extent_slots_ * payload_bytes_; }
std::size_t block_pool::standalone_bytes() const noexcept { return block::header_bytes + payload_bytes_; }

void* block_pool::allocate(std::size_t bytes) const noexcept {
  if (!memory_) return ::operator new(bytes, std::align_val_t{block_alignment}, std::nothrow);
  try {
    return memory_->allocate(bytes, block_alignment);
  } catch (...) {  // the user's resource: whatever it throws, it gave no memory
    return nullptr;
  }
}

void block_pool::deallocate(void* p, std::size_t bytes) const noexcept {
  if (memory_)
    memory_->deallocate(p, bytes, block_alignment);
  else
    ::operator delete(p, std::align_val_t{block_alignment});
}

extent* block_pool::new_extent() const noexcept {
  void* memory = allocate(extent_bytes());
  if (!memory) return nullptr;
  auto* e = ::new (memory) extent(extent_slots_, true);
  e->keys = static_cast<std::byte*>(memory) + sizeof(extent);
  e->values = e->keys + extent_slots_ * key_bytes_;
  return e;
}

void block_pool::adopt(extent& e) noexcept {
  e.next_all = std::exchange(all_, &e);
  if (e.next_all) e.next_all->prev_all = &e;
  slots_ += extent_slots_;
  const std::size_t committed = e.committed_slots();
  allocated_.fetch_add(committed, std::memory_order_relaxed);
  free_count_.fetch_add(committed, std::memory_order_relaxed);
  overhead_.fetch_add(reserved_ ? header_area_ : sizeof(extent), std::memory_order_relaxed);
}

std::error_code block_pool::preallocate(std::size_t blocks) noexcept {
  if (blocks > max_slots_) return kv_errc::capacity_exhausted;
  if (reserved_) {  // kept committed while free, from now on
    std::size_t keep = keep_.load(std::memory_order_relaxed);
    while (keep < blocks && !keep_.compare_exchange_weak(keep, blocks, std::memory_order_relaxed)) {
    }
  }
  for (;;) {
    extent* e = nullptr;
    {
      const std::lock_guard lock(extents_mutex_);
      if ((reserved_ ? allocated_.load(std::memory_order_relaxed) : slots_) >= blocks) return {};
      if (count_down(failures_) > 0) return std::make_error_code(std::errc::not_enough_memory);
      if (reserved_) e = carve();  // under the lock: the regions are the lock's
    }
    if (!reserved_) e = new_extent();
    if (!e) return std::make_error_code(std::errc::not_enough_memory);
    // Written outside the lock, before any cursor can take a slot of it:
    // every page is the process's now, not at a first write while serving.
    // Reserved: the slots missing alone, the extent's first ones.
    const std::size_t held = allocated_.load(std::memory_order_relaxed);
    const std::size_t n = reserved_ ? std::min<std::size_t>(extent_slots_, blocks - std::min(blocks, held)) : 0;
    if (reserved_ && n > 0) {
      std::memset(e->keys, 0, n * key_bytes_);
      std::memset(e->values, 0, n * value_bytes_);
      e->committed_mask.store(extent::low_bits(static_cast<unsigned>(n)), std::memory_order_relaxed);
    } else if (!reserved_) {
      std::memset(e->keys, 0, extent_slots_ * payload_bytes_);
    }
    const std::lock_guard lock(extents_mutex_);
    if (!reserved_ && slots_ > max_slots_ - extent_slots_) {  // others grew it meanwhile: full
      delete_extent(*e);
      return slots_ >= blocks ? std::error_code{} : make_error_code(kv_errc::capacity_exhausted);
    }
    adopt(*e);
    classify(*e);
  }
}

void block_pool::free_extent(extent& e) noexcept {
  (e.prev_all ? e.prev_all->next_all : all_) = e.next_all;
  if (e.next_all) e.next_all->prev_all = e.prev_all;
  slots_ -= extent_slots_;
  allocated_.fetch_sub(extent_slots_, std::memory_order_relaxed);
  free_count_.fetch_sub(extent_slots_, std::memory_order_relaxed);
  overhead_.fetch_sub(sizeof(extent), std::memory_order_relaxed);
  delete_extent(e);
}

void block_pool::delete_extent(extent& e) const noexcept {
  e.~extent();
  deallocate(&e, extent_bytes());
}

void block_pool::release_slot(extent& e, unsigned slot) noexcept {
  pages::release(e.keys + slot * key_bytes_, key_bytes_);
  pages::release(e.values + slot * value_bytes_, value_bytes_);
  e.committed_mask.fetch_and(~(extent::mask{1} << slot), std::memory_order_relaxed);
  allocated_.fetch_sub(1, std::memory_order_relaxed);
}

void block_pool::release_extent(extent& e) noexcept {
  const extent::mask committed = e.committed_mask.exchange(0, std::memory_order_relaxed);
  if (committed == 0) return;
  const auto n = static_cast<std::size_t>(std::popcount(committed));
  pages::release(e.keys, extent_slots_ * payload_bytes_);  // keys and values: one stretch
  allocated_.fetch_sub(n, std::memory_order_relaxed);
  free_count_.fetch_sub(n, std::memory_order_relaxed);
}

void block_pool::release_free_slots(extent& e) noexcept {
  extent::mask candidates =
      e.free_mask.load(std::memory_order_relaxed) & e.committed_mask.load(std::memory_order_relaxed);
  while (candidates != 0) {
    const auto slot = static_cast<unsigned>(std::countr_zero(candidates));
    candidates &= candidates - 1;
    // Taken as a claim takes it, so that no cursor claims it meanwhile.
    if (!e.claim_exactly(slot)) continue;
    const extent::mask bit = extent::mask{1} << slot;
    if ((e.committed_mask.load(std::memory_order_relaxed) & bit) != 0) {
      release_slot(e, slot);
      free_count_.fetch_sub(1, std::memory_order_relaxed);
    }
    e.free_mask.fetch_or(bit, std::memory_order_release);
  }
}

block_memory block_pool::use_slot(extent& e, unsigned slot) noexcept {
  const extent::mask bit = extent::mask{1} << slot;
  if ((e.committed_mask.load(std::memory_order_relaxed) & bit) != 0) {
    free_count_.fetch_sub(1, std::memory_order_relaxed);
  } else {
    e.committed_mask.fetch_or(bit, std::memory_order_relaxed);
    allocated_.fetch_add(1, std::memory_order_relaxed);
  }
  return e.memory(slot, key_bytes_, value_bytes_);
}

block_memory block_pool::take_memory(block_cursor& cursor) noexcept {
  if (count_down(failures_) > 0) return {};  // the next `failures_` fail
  unsigned slot = 0;
  // A slot of the cursor's extent, no lock: one freed there that still
  // holds memory (after a truncate, the slot after the cache's last block
  // again), else the next one from the cursor's last on; but memory is
  // committed only while the pool keeps no more free slots than it may
  // (reserved): past that, free memory elsewhere is taken first.
  if (extent* const own = cursor.extent_) {
    const bool fresh =
        !reserved_ || free_count_.load(std::memory_order_relaxed) <= keep_.load(std::memory_order_relaxed);
    if (own->claim(fresh ? cursor.next_ : own->slots, slot)) {
      cursor.next_ = slot + 1;
      return use_slot(*own, slot);
    }
  }
  const std::lock_guard lock(extents_mutex_);
  leave(cursor);
  // An unused extent; else a new one while the free slots spread over the
  // others are few (reserved: no more than the pool keeps; allocated: fewer
  // than an extent per cursor); else a free slot of another extent (one
  // holding memory first); else a new extent after all, within the cap;
  // else a slot freed while its extent waits for this lock to go on a
  // stack.
  extent* e = nullptr;
  const auto take = [&](extent* candidate) {
    if (candidate && candidate->claim(0, slot)) e = candidate;
    return e != nullptr;
  };
  // Reserved, with more free memory than the pool keeps: a slot holding
  // memory, wherever it is, before any that would take more. A scan, but
  // only until the pool's free memory is down to what it keeps.
  if (reserved_ && free_count_.load(std::memory_order_relaxed) > keep_.load(std::memory_order_relaxed))
    for (extent* x = all_; !e && x; x = x->next_all)
      if (x->claim_committed(slot)) e = x;
  const auto pop = [&](extent*& stack) {
    while (!e && stack) {
      extent* const top = std::exchange(stack, stack->next_unused);
      top->on_unused = false;
      if (top->unused()) take(top);
    }
  };
  // A new extent: one that is address space alone, else a new one.
  const auto take_new = [&] {
    pop(empty_);
    if (!e) take(grow());
  };
  pop(unused_);
  const std::size_t free = free_count_.load(std::memory_order_relaxed);
  if (!e &&
      (reserved_ ? free <= keep_.load(std::memory_order_relaxed) : free < std::size_t{extent_slots_} * (cursors_ + 1)))
    take_new();
  while (!e && partial_) {
    extent* const top = partial_;
    if (!take(top) || top->free_mask.load(std::memory_order_relaxed) == 0) {  // full: off the stack
      partial_ = top->next_partial;
      top->on_partial = false;
    }
  }
  if (!e) take_new();
  for (extent* x = all_; !e && x; x = x->next_all) take(x);
  if (!e) return {};
  cursor.extent_ = e;
  cursor.next_ = slot + 1;
  ++e->cursors;
  ++cursors_;
  classify(*e);  // its other free slots stay within anyone's reach
  return use_slot(*e, slot);
}

block_memory block_pool::take_zeros() noexcept {
  if (count_down(failures_) > 0) return {};
  if (zeros_) {
    // A header of its own, in an allocation twice its size: no other
    // block's header is ever the next 64 bytes (block::followed_by).
    void* header = ::operator new(2 * block::header_bytes, std::align_val_t{block_alignment}, std::nothrow);
    if (!header) return {};
    overhead_.fetch_add(2 * block::header_bytes, std::memory_order_relaxed);
    auto* const keys = static_cast<std::byte*>(zeros_);
    return {header, keys, keys + key_bytes_, block_memory::zeros};
  }
  void* memory = allocate(standalone_bytes());
  if (!memory) return {};
  allocated_.fetch_add(1, std::memory_order_relaxed);
  overhead_.fetch_add(block::header_bytes, std::memory_order_relaxed);
  std::byte* const keys = static_cast<std::byte*>(memory) + block::header_bytes;
  std::memset(keys, 0, payload_bytes_);
  return {memory, keys, keys + key_bytes_, block_memory::standalone};
}

void block_pool::give_memory(void* header, std::uint8_t slot) noexcept {
  if (slot == block_memory::zeros) {
    overhead_.fetch_sub(2 * block::header_bytes, std::memory_order_relaxed);
    ::operator delete(header, std::align_val_t{block_alignment});
    return;
  }
  if (slot == block_memory::standalone) {
    allocated_.fetch_sub(1, std::memory_order_relaxed);
    overhead_.fetch_sub(block::header_bytes, std::memory_order_relaxed);
    deallocate(header, standalone_bytes());
    return;
  }
  extent& e = extent::of(header, slot);
  // Counted until done with `e`, so that no trim() frees it before this
  // free has put it on its stack.
  e.freeing.fetch_add(1, std::memory_order_relaxed);
  free_count_.fetch_add(1, std::memory_order_relaxed);
  // release: this block's use of the slot happens-before the next claim.
  const extent::mask bit = extent::mask{1} << slot;
  const extent::mask before = e.free_mask.fetch_or(bit, std::memory_order_acq_rel);
  if (before == 0 || (before | bit) == e.all_free) {  // was full, or now unused: its stack changes
    const std::lock_guard lock(extents_mutex_);
    e.freeing.fetch_sub(1, std::memory_order_release);
    classify(e);
    return;
  }
  e.freeing.fetch_sub(1, std::memory_order_release);  // on its stack already, or a cursor's
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
  keep_.store(extent_slots_, std::memory_order_relaxed);  // what preallocate() asked to keep: given back too
  const std::lock_guard lock(extents_mutex_);
  unused_ = empty_ = partial_ = nullptr;
  for (extent* e = all_; e;) {
    extent* const next = e->next_all;
    e->on_unused = e->on_partial = false;
    if (e->unused() && !reserved_) {
      free_extent(*e);
    } else {
      if (e->unused())
        release_extent(*e);
      else if (whole_pages_)
        release_free_slots(*e);
      classify(*e);
    }
    e = next;
  }
}

extent_census block_pool::census() const noexcept {
  const std::lock_guard lock(extents_mutex_);
  extent_census c;
  for (const extent* e = all_; e; e = e->next_all) {
    if (e->committed_mask.load(std::memory_order_relaxed) == 0) continue;  // address space alone
    ++c.extents;
    if (e->unused()) ++c.unused;
  }
  return c;
}

std::size_t block_pool::resident_bytes() const noexcept {
  const std::lock_guard lock(extents_mutex_);
  std::size_t bytes = 0;
  for (const region* r = regions_; r; r = r->next) bytes += pages::resident(r->base, r->extents * stride_);
  return bytes;
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

block::block(block_pool& pool, std::uint64_t owner, budget b, const block_memory& memory) noexcept
    : budget_(b),
      slot_(memory.slot),
      pool_(ref_ptr<block_pool>::share(&pool)),
      owner_(owner),
      keys_(memory.keys),
      values_(memory.values) {}

ref_ptr<block> block::make(block_pool& pool, block_cursor& cursor, std::uint64_t owner,
                           block_account* account) noexcept {
  static_assert(sizeof(block) <= header_bytes);
  // The budget: the sequence's reservation first, then the pool; evicting
  // prefix-cache entries only once the pool's budget is spent.
  const bool from_account = account && account->take();
  if (from_account)
    pool.count_reserved(-1);
  else if (!pool.charge() && !pool.charge_evicting())
    return {};
  const block_memory memory = pool.take_memory(cursor);
  if (!memory) {
    if (from_account) {
      pool.count_reserved(1);
      account->give_back();
    } else {
      pool.uncharge();
    }
    return {};
  }
  pool.emit({.what = kv_event::kind::block_allocated, .cache = owner});
  return ref_ptr<block>::adopt(::new (memory.header) block(pool, owner, budget::counted, memory));
}

ref_ptr<block> block::make_zeros(block_pool& pool, std::size_t block_tokens) noexcept {
  const block_memory memory = pool.take_zeros();
  if (!memory) return {};
  auto zeros = ref_ptr<block>::adopt(::new (memory.header) block(pool, 0, budget::exempt, memory));
  zeros->set_filled(block_tokens);
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
    cached_pool->kept_block_idle(this);  // the block may be gone already: only looked up, never read
}

void block::destroy() const noexcept {
  auto* self = const_cast<block*>(this);
  ref_ptr<block_pool> pool = std::move(self->pool_);
  const bool counted = budget_ == budget::counted;
  if (counted) pool->emit({.what = kv_event::kind::block_freed, .cache = owner_});
  const std::uint8_t slot = slot_;
  self->~block();
  pool->give_memory(self, slot);
  if (counted) pool->uncharge();
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END

GHOSTLINK_NAMESPACE_BEGIN

kv_block_pool::kv_block_pool(std::size_t block_bytes, kv_pool_limits limits, kv_block_kind kind) {
  const std::size_t by_bytes = block_bytes == 0 ? 0 : limits.max_bytes / block_bytes;
  const std::size_t max_blocks = limits.max_blocks < by_bytes ? limits.max_blocks : by_bytes;
  const bool keys_only = kind == kv_block_kind::keys_only;
  if (block_bytes == 0 || (!keys_only && block_bytes % 2 != 0) || max_blocks == 0 ||
      (!keys_only && kind != kv_block_kind::keys_and_values))
    throw std::system_error(make_error_code(kv_errc::invalid_config));
  state_ = new detail::block_pool(block_bytes, max_blocks, limits.memory, keys_only);
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
kv_block_kind kv_block_pool::kind() const noexcept {
  return state_->keys_only() ? kv_block_kind::keys_only : kv_block_kind::keys_and_values;
}
std::size_t kv_block_pool::blocks_per_extent() const noexcept { return state_->extent_slots(); }
void kv_block_pool::trim() noexcept { state_->trim(); }
void kv_block_pool::set_event_handler(kv_event_handler handler) { state_->set_event_handler(std::move(handler)); }

std::size_t kv_block_pool::blocks_available() const noexcept { return state_->blocks_available(); }

kv_block_reservation kv_block_pool::reserve(std::size_t blocks, std::error_code& ec) const noexcept {
  ec.clear();
  if (blocks == 0) return {};
  if (!state_->charge_many(blocks)) {
    ec = kv_errc::capacity_exhausted;
    return {};
  }
  state_->count_reserved(static_cast<std::int64_t>(blocks));
  state_->add_ref();
  return {state_, blocks};
}

void kv_block_pool::preallocate(std::size_t blocks, std::error_code& ec) noexcept { ec = state_->preallocate(blocks); }

void kv_block_pool::preallocate(std::size_t blocks) {
  std::error_code ec;
  preallocate(blocks, ec);
  if (ec == std::errc::not_enough_memory) throw std::bad_alloc();
  if (ec) throw std::system_error(ec);
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
  pool_->uncharge(n);
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
  s.bytes_allocated = p.bytes_allocated();
  const detail::kept_blocks kept = p.kept();
  s.blocks_cached = kept.cached;
  s.blocks_cached_idle = kept.idle;
  s.blocks_reserved = p.blocks_reserved();
  s.blocks_available = p.blocks_available();
  return s;
}

GHOSTLINK_NAMESPACE_END
