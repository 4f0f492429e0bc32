#pragma once
// The pool every block's memory comes from, under a budget; shared by every
// cache made with it. Every member is safe from any thread.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <system_error>
#include <utility>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/block_pool.hpp"
#include "ghostlink/detail/ref_ptr.hpp"
#include "ghostlink/events.hpp"
#include "memory/reclaimer.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

struct extent;
class block;
class block_pool;
struct block_memory;
class reclaimer;

/// A pool's extents, and of them those no block uses and no cursor fills.
struct extent_census {
  std::size_t extents = 0;
  std::size_t unused = 0;
};

/// A cache's place in its pool: the extent it fills and the slot it takes
/// next. The blocks one cursor is given one after another take consecutive
/// slots of one extent while that has them free, so a cache that fills its
/// blocks in order finds its keys one run of memory and its values another
/// (see block_pool). One cursor per cache (or per layer being loaded or
/// attached), used from one thread at a time; the pool outlives it (its
/// owner holds the pool).
class block_cursor {
 public:
  explicit block_cursor(block_pool& pool) noexcept : pool_(&pool) {}
  block_cursor(block_cursor&& other) noexcept;
  block_cursor& operator=(block_cursor&&) = delete;
  block_cursor(const block_cursor&) = delete;
  block_cursor& operator=(const block_cursor&) = delete;
  /// Lets go of the extent: its free slots are anyone's.
  ~block_cursor();

 private:
  friend class block_pool;
  block_pool* pool_;
  extent* extent_ = nullptr;  // the extent it fills, or none
  unsigned next_ = 0;         // the slot of it to take next
};

/// Budget set aside for one sequence from its pool (a
/// `kv_block_reservation` given to it): its layers' block allocations draw
/// from it first, from any of their strands. What is left goes back to the
/// pool when the sequence and its layers are gone.
struct block_account : ref_counted<block_account> {
  explicit block_account(ref_ptr<block_pool> pool) noexcept : pool(std::move(pool)) {}
  ~block_account();
  static void destroy(block_account* a) noexcept { delete a; }
  block_account(const block_account&) = delete;
  block_account& operator=(const block_account&) = delete;
  /// Takes one block's budget; false when none is left.
  bool take() noexcept {
    std::size_t n = left.load(std::memory_order_relaxed);
    while (n != 0 && !left.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) {
    }
    return n != 0;
  }
  /// Gives back what take() took.
  void give_back() noexcept { left.fetch_add(1, std::memory_order_relaxed); }

  const ref_ptr<block_pool> pool;
  std::atomic<std::size_t> left{0};
};

/// Hands out fixed-size blocks of memory under a budget.
///
/// Memory: extents of slots, each laid out [headers][keys of every
/// slot][values of every slot]. A cursor takes the slots of one extent in
/// order, so a cache's blocks lie in runs of an extent's length.
///
/// - **Reserved extents** (a pool with no memory resource, on Linux, whose
///   blocks' keys are a page or more: smaller blocks gain nothing by it):
///   `reserved_extent_slots` slots of address space (src/memory/pages.hpp),
///   carved from regions mapped a few hundred MiB at a time. A slot's pages
///   become memory when its first block is written: a slot is *committed*
///   from its first claim until its pages are released. Freed slots stay
///   committed, for reuse: a cursor that has used up its extent takes one
///   no block uses, else a new one (address space alone) while the pool
///   keeps no more than `keep_` free committed slots (an extent's worth, or
///   what preallocate() asked), else a free committed slot of another
///   extent. An extent left with no block and no cursor gives its pages
///   back at once while the pool's free slots outnumber the blocks in use
///   and, without the extent's, are still `keep_`: one system call per 64
///   blocks freed, never one per block (a call flushes every processor's
///   TLB). So memory is the blocks in use, plus free blocks up to the most
///   in use at once, which growth reuses first.
/// - **Allocated extents** (a memory resource, no reserved pages, or
///   blocks whose keys are less than a page):
///   `allocated_extent_slots` slots in one allocation, all committed. A
///   cursor that has used up its extent takes one no block uses, else a new
///   one while fewer than an extent's slots per cursor (plus one extent)
///   are free over the others, else any free slot, and the pool never grows
///   past its budget rounded up to whole extents: memory stays within one
///   extent per filling cache (plus one) of the blocks in use.
///
/// A freed block's slot is free at once. trim() gives back every committed
/// slot no block uses (reserved: whole pages of it; a slot smaller than a
/// page goes back with its extent), or every extent no block uses and no
/// cursor fills (allocated).
///
/// Layout: what a cache reads on every allocation (the block size, the
/// budget, the event sink) comes first and never changes; the counters that
/// every allocation and free write start on a cache line of their own. No
/// reader of a snapshot touches the pool at all.
class block_pool : public ref_counted<block_pool> {
 public:
  /// Blocks of `payload_bytes` (keys then values, half each; or keys alone,
  /// `keys_only`); at most `max_blocks` counted blocks at once.
  block_pool(std::size_t payload_bytes, std::size_t max_blocks, std::pmr::memory_resource* memory = nullptr,
             bool keys_only = false);
  ~block_pool();
  block_pool(const block_pool&) = delete;
  block_pool& operator=(const block_pool&) = delete;
  static void destroy(block_pool* p) noexcept { delete p; }

  std::size_t payload_bytes() const noexcept { return payload_bytes_; }
  /// Its blocks hold keys alone (kv_block_kind::keys_only).
  bool keys_only() const noexcept { return value_bytes_ == 0; }
  std::size_t max_blocks() const noexcept { return max_blocks_; }

  /// Counts one block against the budget; false when the budget is spent.
  bool charge() noexcept;
  void uncharge(std::size_t n = 1) noexcept { in_use_.fetch_sub(n, std::memory_order_relaxed); }
  /// As charge(), asking the pool's reclaimer (if any) to evict one entry
  /// at a time until it succeeds; false when nothing can be evicted. The
  /// slow path of an allocation: called only once charge() has failed.
  bool charge_evicting() noexcept;
  /// Counts `n` blocks against the budget at once, evicting as needed; or,
  /// when they cannot all be had, none (false). A reservation's.
  bool charge_many(std::size_t n) noexcept;
  /// Budget left plus the blocks that the reclaimer could give back now.
  std::size_t blocks_available() const noexcept;
  /// What the reclaimer keeps, as it last reported (zeros without one).
  kept_blocks kept() const noexcept {
    return {kept_cached_.load(std::memory_order_relaxed), kept_idle_.load(std::memory_order_relaxed),
            kept_reclaimable_.load(std::memory_order_relaxed)};
  }
  /// The reclaimer reports what it keeps, under its own lock, whenever that
  /// changes; and zeros as it goes.
  void set_kept(const kept_blocks& k) noexcept {
    kept_cached_.store(k.cached, std::memory_order_relaxed);
    kept_idle_.store(k.idle, std::memory_order_relaxed);
    kept_reclaimable_.store(k.reclaimable, std::memory_order_relaxed);
  }

  /// Makes `r` the pool's reclaimer; false if it has one already.
  bool attach_reclaimer(reclaimer* r) noexcept;
  /// The pool has no reclaimer any more (the reclaimer's destruction):
  /// waits for a call into it in progress.
  void detach_reclaimer() noexcept;
  /// A kept block's last outside reference went (block::release): tells
  /// the reclaimer, which looks `b` up and never reads it unless it still
  /// holds it.
  void kept_block_idle(const block* b) noexcept;
  /// Blocks of budget held by reservations and accounts, not yet allocated.
  std::size_t blocks_reserved() const noexcept { return reserved_blocks_.load(std::memory_order_relaxed); }
  void count_reserved(std::int64_t delta) noexcept {
    reserved_blocks_.fetch_add(static_cast<std::size_t>(delta), std::memory_order_relaxed);
  }
  /// Slots of one extent: reserved (address space, committed as blocks
  /// fill), or allocated whole.
  static constexpr unsigned reserved_extent_slots = kv_block_pool::reserved_extent_blocks;
  static constexpr unsigned allocated_extent_slots = kv_block_pool::extent_blocks;
  /// Slots of each of this pool's extents.
  unsigned extent_slots() const noexcept { return extent_slots_; }
  /// Memory for one counted block: the slot of `cursor`'s extent after the
  /// one it gave last if that is free, else as the class comment says;
  /// empty when the system has none.
  block_memory take_memory(block_cursor& cursor) noexcept;
  /// Memory for one block outside the budget that only ever holds zeros:
  /// the pool's one page-less mapping of zeros (reserved), or memory of
  /// its own (allocated, written with zeros by the caller).
  block_memory take_zeros() noexcept;
  /// Frees the memory of a block (its header at `header`, in `slot`).
  void give_memory(void* header, std::uint8_t slot) noexcept;
  /// Grows the pool, in whole extents with every page written, until it
  /// holds at least `blocks` committed slots, and keeps that many committed
  /// while they are free. Returns `kv_errc::capacity_exhausted`
  /// (nothing added) when `blocks` is past the budget rounded up to whole
  /// extents, `std::errc::not_enough_memory` when the system runs out (the
  /// extents added before stay, unused: trim() returns them).
  std::error_code preallocate(std::size_t blocks) noexcept;
  /// Returns to the system the memory of every slot no block uses (of
  /// reserved extents; of an allocated extent when no block uses it and no
  /// cursor fills it).
  void trim() noexcept;
  /// Extents holding memory now, and of them the unused (a test hook:
  /// src/testing/hooks.hpp).
  extent_census census() const noexcept;
  /// Bytes of the pool's reserved extents that are memory now, by the
  /// kernel's count (a test hook; 0 for allocated extents).
  std::size_t resident_bytes() const noexcept;
  /// Installs `handler` (an empty one: none) for every later event. Free
  /// when none is installed: one atomic load per event site. Handlers
  /// replaced stay alive until the pool dies, as a call may still run them.
  void set_event_handler(kv_event_handler handler);
  /// Calls the installed handler, if any.
  void emit(const kv_event& e) const noexcept {
    if (const event_sink* sink = sink_.load(std::memory_order_acquire)) sink->handler(e);
  }
  /// The next `n` requests for a block's memory (or an extent's, in
  /// preallocate) fail as if the system had none (a test hook:
  /// src/testing/hooks.hpp).
  void fail_next_allocations(std::size_t n) noexcept { failures_.store(n, std::memory_order_relaxed); }

  // Counters (relaxed: exact when the pool is idle).
  std::size_t blocks_in_use() const noexcept { return in_use_.load(std::memory_order_relaxed); }
  std::size_t peak_blocks_in_use() const noexcept { return peak_.load(std::memory_order_relaxed); }
  std::size_t blocks_free() const noexcept { return free_count_.load(std::memory_order_relaxed); }
  std::size_t blocks_shared() const noexcept;
  std::uint64_t cow_copies() const noexcept { return cow_copies_.load(std::memory_order_relaxed); }
  std::uint64_t blocks_allocated() const noexcept { return allocated_.load(std::memory_order_relaxed); }
  /// Bytes held: the committed slots' payloads, and the extents' headers
  /// (and blocks of zeros of their own).
  std::uint64_t bytes_allocated() const noexcept {
    return allocated_.load(std::memory_order_relaxed) * payload_bytes_ + overhead_.load(std::memory_order_relaxed);
  }
  void count_cow_copy() noexcept { cow_copies_.fetch_add(1, std::memory_order_relaxed); }
  void count_shared(std::int64_t delta) noexcept { shared_.fetch_add(delta, std::memory_order_relaxed); }

  /// A new id for a cache that will own blocks (never 0, never reused).
  static std::uint64_t new_owner_id() noexcept;
  /// Pools alive in this process, and pools destroyed while still counting
  /// blocks in use (an accounting error). Every block holds its pool, so no
  /// live pool once every cache and snapshot is gone means no block leaked.
  static std::size_t pools_alive() noexcept;
  static std::size_t pools_destroyed_unbalanced() noexcept;

 private:
  struct event_sink {
    kv_event_handler handler;
    std::unique_ptr<event_sink> replaced;  // kept alive: see set_event_handler
  };

  friend class block_cursor;
  struct region;
  /// Claims of a slot of `e` (the caller has just claimed it): counts it,
  /// committing it if it was not, and returns its memory.
  block_memory use_slot(extent& e, unsigned slot) noexcept;
  /// Under extents_mutex_: gives back the pages of every committed slot of
  /// `e`, which no block uses and no cursor fills.
  void release_extent(extent& e) noexcept;
  /// Under extents_mutex_: gives back the pages of every free committed
  /// slot of `e`, taking each first so that no cursor claims it meanwhile.
  void release_free_slots(extent& e) noexcept;
  /// The pages of slot `slot` of `e`, held by the caller.
  void release_slot(extent& e, unsigned slot) noexcept;
  /// Under extents_mutex_: a reserved extent's address space, from the
  /// newest region (or a new one), or null.
  extent* carve() noexcept;
  /// Slots the pool may have in its extents (saturating).
  std::size_t slot_cap() const noexcept;
  /// Under extents_mutex_: the cursor lets go of its extent.
  void leave(block_cursor& cursor) noexcept;
  /// Under extents_mutex_: puts `e` on the stack its state calls for.
  void classify(extent& e) noexcept;
  /// Under extents_mutex_: a new extent (counted in slots_), or null.
  extent* grow() noexcept;
  /// An allocated extent's memory, not yet the pool's (no lock), or null.
  extent* new_extent() const noexcept;
  /// Under extents_mutex_: counts `e` (from new_extent) as the pool's.
  void adopt(extent& e) noexcept;
  /// Gives back the memory of `e` (from new_extent), counted or not.
  void delete_extent(extent& e) const noexcept;
  /// `bytes` of memory aligned for a block, from memory_ (or operator
  /// new), or null; and back, with the same `bytes`: an extent's
  /// (extent_bytes) or a block's of its own (standalone_bytes).
  std::size_t extent_bytes() const noexcept;
  std::size_t standalone_bytes() const noexcept;
  void* allocate(std::size_t bytes) const noexcept;
  void deallocate(void* p, std::size_t bytes) const noexcept;
  /// Under extents_mutex_: frees `e` (no block uses it, no cursor fills it).
  void free_extent(extent& e) noexcept;

  // Read-mostly.
  const std::size_t payload_bytes_;
  const std::size_t key_bytes_, value_bytes_;  // of a block's payload: half each, or all keys (keys only)
  const std::size_t max_blocks_;
  std::pmr::memory_resource* const memory_;  // null: reserved pages (or operator new)
  const bool reserved_;                      // extents of reserved pages
  const unsigned extent_slots_;              // reserved_ or allocated_extent_slots
  const std::size_t max_slots_;              // max_blocks_ rounded up to whole extents
  const bool whole_pages_;                   // a reserved slot's keys (and values) are whole pages
  std::size_t header_area_ = 0;              // reserved: an extent's headers, in whole pages
  std::size_t stride_ = 0;                   // reserved: an extent's address space
  void* zeros_ = nullptr;                    // reserved: payload_bytes_ of zeros, never written
  std::atomic<const event_sink*> sink_{nullptr};  // null: no handler
  std::atomic<std::size_t> failures_{0};          // see fail_next_allocations
  // Written by every allocation and free.
  alignas(64) std::atomic<std::size_t> in_use_{0};
  std::atomic<std::size_t> peak_{0};
  std::atomic<std::size_t> free_count_{0};
  std::atomic<std::int64_t> shared_{0};
  std::atomic<std::uint64_t> cow_copies_{0};
  std::atomic<std::uint64_t> allocated_{0};
  std::atomic<std::size_t> reserved_blocks_{0};
  std::atomic<std::size_t> keep_{0};          // committed free slots kept (reserved extents)
  std::atomic<std::uint64_t> overhead_{0};    // bytes_allocated() beyond the slots' payloads
  // What the reclaimer keeps (set_kept), written under its lock.
  std::atomic<std::size_t> kept_cached_{0};
  std::atomic<std::size_t> kept_idle_{0};
  std::atomic<std::size_t> kept_reclaimable_{0};
  // Rarely.
  // Extents: which have free slots, which are unused. Taken when a cursor
  // has no slot left and when a slot frees up in a full extent (or makes
  // one unused): about once per extent_slots blocks.
  alignas(64) mutable std::mutex extents_mutex_;
  extent* all_ = nullptr;      // extents_mutex_; every extent (extent::next_all, prev_all)
  extent* unused_ = nullptr;   // extents_mutex_; a stack (extent::next_unused), checked when popped
  extent* empty_ = nullptr;    // extents_mutex_; as unused_, for those holding no memory (reserved)
  extent* partial_ = nullptr;  // extents_mutex_; a stack (extent::next_partial), checked when popped
  region* regions_ = nullptr;  // extents_mutex_; reserved: the mappings extents are carved from, newest first
  std::size_t slots_ = 0;      // extents_mutex_; slots of every extent
  std::size_t cursors_ = 0;    // extents_mutex_; cursors filling an extent
  alignas(64) std::mutex sink_mutex_;   // serialises set_event_handler
  std::unique_ptr<event_sink> sinks_;   // sink_mutex_; the newest, owning those it replaced
  // The reclaimer (memory/reclaimer.hpp): evictions (from the allocation
  // path), idle blocks (from releases), its counts and its destruction
  // serialise on reclaimer_mutex_, so it never dies while a call into it is
  // running. Lock order: reclaimer_mutex_, then the reclaimer's own.
  mutable std::mutex reclaimer_mutex_;
  reclaimer* reclaimer_ = nullptr;  // reclaimer_mutex_
};

/// How ghostlink's caches reach the pool that a `kv_block_pool` handle
/// keeps private.
struct pool_access {
  /// A handle on an existing pool (what a cache's `pool()` returns).
  static kv_block_pool handle(ref_ptr<block_pool> state) noexcept {
    return {kv_block_pool::adopt_state{}, state.detach()};
  }
  /// The pool a handle refers to.
  static ref_ptr<block_pool> state(const kv_block_pool& pool) noexcept {
    return ref_ptr<block_pool>::share(pool.state_);
  }
  /// Empties `r`, returning its blocks (still counted, now the caller's).
  static std::size_t release_reservation(kv_block_reservation& r) noexcept {
    const std::size_t n = std::exchange(r.blocks_, 0);
    if (r.pool_) std::exchange(r.pool_, nullptr)->release();
    return n;
  }
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
