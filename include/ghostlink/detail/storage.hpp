#pragma once
// Paged storage: the pool blocks come from, blocks of `block_tokens` tokens,
// the page tables that list them and the immutable epochs readers pin.
//
// Ownership: an epoch owns its page table, a page table its chunks, a chunk
// its blocks, a block its pool. Everything here is reference counted, so the
// last snapshot to release an epoch frees what only that epoch could reach,
// on whatever thread it runs; a freed block's memory goes back to its pool.
//
// Sharing: page tables and chunks belong to one cache. Blocks may be shared
// by several caches (a fork shares all of its parent's); only the cache that
// made a block (its owner) ever writes into it, and only into slots no
// published epoch of any cache reads (see page_writer.hpp).

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "ghostlink/detail/ref_ptr.hpp"
#include "ghostlink/events.hpp"

namespace ghostlink::detail {

struct free_list;

/// Hands out fixed-size blocks of memory under a budget, recycling freed
/// ones through a free list. Shared by every cache made with it;
/// every member is safe from any thread.
class block_pool : public ref_counted<block_pool> {
 public:
  /// Blocks of `payload_bytes` (keys then values); at most `max_blocks`
  /// counted blocks at once.
  block_pool(std::size_t payload_bytes, std::size_t max_blocks);
  ~block_pool();
  static void destroy(block_pool* p) noexcept { delete p; }

  std::size_t payload_bytes() const noexcept { return payload_bytes_; }
  std::size_t max_blocks() const noexcept { return max_blocks_; }

  /// Counts one block against the budget; false when the budget is spent.
  bool reserve() noexcept;
  void unreserve() noexcept { in_use_.fetch_sub(1, std::memory_order_relaxed); }
  /// Memory for one block (header and payload): recycled if any is free,
  /// else new; null when the system has none.
  void* take_memory() noexcept;
  /// Returns a block's memory to the free list.
  void give_memory(void* memory) noexcept;
  /// Frees every block on the free list.
  void trim() noexcept;
  /// Installs `handler` (an empty one: none) for every later event. Free
  /// when none is installed: one atomic load per event site. Handlers
  /// replaced stay alive until the pool dies, as a call may still run them.
  void set_event_handler(kv_event_handler handler);
  /// Calls the installed handler, if any.
  void emit(const kv_event& e) const noexcept {
    if (const event_sink* sink = sink_.load(std::memory_order_acquire)) sink->handler(e);
  }
  /// Fault injection for tests: the next `n` requests for a block's memory
  /// fail as if the system had none.
  void fail_next_allocations(std::size_t n) noexcept { failures_.store(n, std::memory_order_relaxed); }

  // Counters (relaxed: exact when the pool is idle).
  std::size_t blocks_in_use() const noexcept { return in_use_.load(std::memory_order_relaxed); }
  std::size_t peak_blocks_in_use() const noexcept { return peak_.load(std::memory_order_relaxed); }
  std::size_t blocks_free() const noexcept { return free_count_.load(std::memory_order_relaxed); }
  std::size_t blocks_shared() const noexcept;
  std::uint64_t cow_copies() const noexcept { return cow_copies_.load(std::memory_order_relaxed); }
  std::uint64_t blocks_allocated() const noexcept { return allocated_.load(std::memory_order_relaxed); }
  void count_cow_copy() noexcept { cow_copies_.fetch_add(1, std::memory_order_relaxed); }
  void count_shared(std::int64_t delta) noexcept { shared_.fetch_add(delta, std::memory_order_relaxed); }

  /// A new id for a cache that will own blocks (never 0, never reused).
  static std::uint64_t new_owner_id() noexcept;
  /// Pools alive in this process, and pools destroyed while still counting
  /// blocks in use (an accounting error). Every block holds its pool, so no
  /// live pool once every cache and snapshot is gone means no block leaked;
  /// the tests check both after each test case.
  static std::size_t pools_alive() noexcept;
  static std::size_t pools_destroyed_unbalanced() noexcept;

 private:
  const std::size_t payload_bytes_;
  const std::size_t max_blocks_;
  const std::unique_ptr<free_list> free_;
  std::atomic<std::size_t> in_use_{0};
  std::atomic<std::size_t> peak_{0};
  std::atomic<std::size_t> free_count_{0};
  std::atomic<std::int64_t> shared_{0};
  std::atomic<std::uint64_t> cow_copies_{0};
  std::atomic<std::uint64_t> allocated_{0};
  std::atomic<std::size_t> failures_{0};  // see fail_next_allocations
  struct event_sink {
    kv_event_handler handler;
    std::unique_ptr<event_sink> replaced;  // kept alive: see set_event_handler
  };
  std::mutex sink_mutex_;                 // serialises set_event_handler
  std::unique_ptr<event_sink> sinks_;      // sink_mutex_; the newest, owning those it replaced
  std::atomic<const event_sink*> sink_{nullptr};  // null: no handler
};

/// Keys then values of `block_tokens` tokens, in one 64-byte aligned
/// allocation from a block_pool.
class block {
 public:
  /// Whether a block counts against the pool's budget: every block does but
  /// a cache's shared zero block, so budgets count data blocks.
  enum class budget : bool { counted, exempt };

  /// A new block owned by `owner`, its payload garbage (nothing
  /// materialized), or null when the pool's budget or memory is spent.
  static ref_ptr<block> make(block_pool& pool, std::uint64_t owner, budget b = budget::counted) noexcept;
  /// A block of zeros owned by no cache, outside the budget.
  static ref_ptr<block> make_zeros(block_pool& pool, std::size_t block_tokens) noexcept;

  // Reference counting (used by ref_ptr). The pool counts blocks crossing
  // between one reference and more: that is its `blocks_shared`.
  void add_ref() const noexcept;
  void release() const noexcept;

  std::byte* keys() noexcept { return payload(); }
  std::byte* values() noexcept { return payload() + pool_->payload_bytes() / 2; }
  const std::byte* keys() const noexcept { return const_cast<block*>(this)->keys(); }
  const std::byte* values() const noexcept { return const_cast<block*>(this)->values(); }

  block_pool& pool() const noexcept { return *pool_; }
  /// The cache that made this block and alone may write into it; 0 for the
  /// zero block, which no one writes.
  std::uint64_t owner() const noexcept { return owner_; }

  /// The owner's alone, on its strand: slots [0, materialized()) hold the
  /// owner's current tokens (written, or zeros where skipped).
  std::size_t materialized() const noexcept { return materialized_; }
  void set_materialized(std::size_t slots) noexcept { materialized_ = slots; }
  /// The owner's alone, on its strand: no published epoch of any cache
  /// reads slots at or past readable(), so the owner may write them in place.
  std::size_t readable() const noexcept { return readable_; }
  void set_readable(std::size_t slots) noexcept { readable_ = slots; }

 private:
  block(block_pool& pool, std::uint64_t owner, budget b) noexcept;
  ~block() = default;
  std::byte* payload() noexcept;
  void destroy() const noexcept;

  mutable std::atomic<std::uint32_t> refs_{1};
  const budget budget_;
  ref_ptr<block_pool> pool_;
  const std::uint64_t owner_;
  std::size_t materialized_ = 0;
  std::size_t readable_ = 0;
};

/// Memory for a page table, a chunk or an epoch: `::operator new(size)`,
/// unless a test has asked for it to fail (std::bad_alloc).
void* metadata_new(std::size_t size);
/// Fault injection for tests: of the allocations of page tables, chunks and
/// epochs (by any cache) from now on, `after` succeed and the next throws
/// std::bad_alloc. `cancel_metadata_failure()` disarms it; it reports
/// whether the failure was still pending.
void fail_metadata_allocation(std::size_t after) noexcept;
bool cancel_metadata_failure() noexcept;

/// Up to `size` consecutive entries of a page table. Never changed once
/// published; tables of one cache share unchanged chunks.
struct page_chunk : ref_counted<page_chunk> {
  static constexpr std::size_t size = 32;
  explicit page_chunk(std::uint64_t born_epoch) noexcept : born_epoch(born_epoch) {}
  static void destroy(page_chunk* c) noexcept { delete c; }
  static void* operator new(std::size_t size) { return metadata_new(size); }
  static void operator delete(void* p) noexcept { ::operator delete(p); }

  const std::uint64_t born_epoch;  // the first epoch of its cache that can see it
  std::array<ref_ptr<block>, size> blocks;
};

/// Block `i` holds tokens `[i * block_tokens, (i + 1) * block_tokens)`.
/// Never changed once published, so a block lives exactly as long as some
/// epoch that can read it. Two levels, so that a new table copies the list
/// of chunks and the one chunk it changes, not every block reference.
struct page_table : ref_counted<page_table> {
  explicit page_table(std::uint64_t born_epoch) noexcept : born_epoch(born_epoch) {}
  static void destroy(page_table* t) noexcept { delete t; }
  static void* operator new(std::size_t size) { return metadata_new(size); }
  static void operator delete(void* p) noexcept { ::operator delete(p); }

  const ref_ptr<block>& entry(std::size_t b) const noexcept {
    return chunks[b / page_chunk::size]->blocks[b % page_chunk::size];
  }

  const std::uint64_t born_epoch;  // the first epoch of its cache that can see it
  std::vector<ref_ptr<page_chunk>> chunks;
  std::size_t blocks = 0;  // entries in use; later ones are null or the zero block
};

struct epoch;

/// The epochs of one cache still in memory (the latest, and older ones a
/// snapshot pins), oldest first, and the snapshots open on them: what
/// stats() reports, so that a stalled reader holding memory shows. Epochs
/// join when published (the actor) and leave when freed (any thread).
class epoch_registry : public ref_counted<epoch_registry> {
 public:
  static void destroy(epoch_registry* r) noexcept { delete r; }

  void add(epoch* e) noexcept;
  void remove(epoch* e) noexcept;
  struct reading {
    std::size_t epochs_alive = 0;
    std::uint64_t oldest = 0;
  };
  reading read() const noexcept;

  void snapshot_opened() noexcept { snapshots_.fetch_add(1, std::memory_order_relaxed); }
  void snapshot_closed() noexcept { snapshots_.fetch_sub(1, std::memory_order_relaxed); }
  std::size_t snapshots() const noexcept { return snapshots_.load(std::memory_order_relaxed); }

 private:
  mutable std::mutex mutex_;
  epoch* oldest_ = nullptr;  // mutex_; a list through epoch::newer / epoch::older
  epoch* newest_ = nullptr;  // mutex_
  std::size_t count_ = 0;    // mutex_
  std::atomic<std::size_t> snapshots_{0};
};

/// One published state of a cache: what a snapshot pins.
///
/// Tokens `[0, stored)` live in the table's blocks; tokens `[stored, length)`
/// were made valid by initialize() or skipped by a write and read as zeros
/// from `zeros`, a block that is never written. Keeping them out of the
/// table is what lets the actor fill them in place later: no epoch reads
/// those slots of any block.
struct epoch : ref_counted<epoch> {
  epoch(std::uint64_t number, std::size_t length, std::size_t stored, ref_ptr<page_table> table, ref_ptr<block> zeros,
        std::size_t width, std::size_t block_tokens, ref_ptr<epoch_registry> registry = {}) noexcept
      : number(number),
        length(length),
        stored(stored),
        table(std::move(table)),
        zeros(std::move(zeros)),
        width(width),
        block_tokens(block_tokens),
        registry(std::move(registry)) {
    if (this->registry) this->registry->add(this);
  }
  static void destroy(epoch* e) noexcept {
    if (e->registry) e->registry->remove(e);
    delete e;
  }

  /// The block holding token `index` (`index < length`); the slot within it
  /// is `index % block_tokens`.
  const block& block_of(std::size_t index) const noexcept {
    return index < stored ? *table->entry(index / block_tokens) : *zeros;
  }
  /// Tokens from `index` on that share `index`'s block (capped at `end`).
  std::size_t run_from(std::size_t index, std::size_t end) const noexcept {
    const std::size_t run_end = index < stored && stored < end ? stored : end;
    const std::size_t in_block = block_tokens - index % block_tokens;
    return run_end - index < in_block ? run_end - index : in_block;
  }

  const std::uint64_t number;
  const std::size_t length;
  const std::size_t stored;
  const ref_ptr<page_table> table;
  const ref_ptr<block> zeros;
  const std::size_t width;
  const std::size_t block_tokens;
  const ref_ptr<epoch_registry> registry;  // null only in tests of epochs alone
  epoch* older = nullptr;                  // the registry's list, under its mutex
  epoch* newer = nullptr;
};

/// A reader's reference to an epoch (what a snapshot holds), counted in its
/// cache's registry while held.
class pinned_epoch {
 public:
  pinned_epoch() noexcept = default;
  explicit pinned_epoch(ref_ptr<epoch> e) noexcept : epoch_(std::move(e)) {
    if (epoch_ && epoch_->registry) epoch_->registry->snapshot_opened();
  }
  pinned_epoch(pinned_epoch&&) noexcept = default;  // leaves the source empty
  pinned_epoch& operator=(pinned_epoch&& other) noexcept {
    if (this != &other) {
      close();
      epoch_ = std::move(other.epoch_);
    }
    return *this;
  }
  ~pinned_epoch() { close(); }

  explicit operator bool() const noexcept { return static_cast<bool>(epoch_); }
  const epoch* operator->() const noexcept { return epoch_.get(); }
  const epoch& operator*() const noexcept { return *epoch_; }

 private:
  void close() noexcept {
    if (epoch_ && epoch_->registry) epoch_->registry->snapshot_closed();
    epoch_ = {};
  }
  ref_ptr<epoch> epoch_;
};

}  // namespace ghostlink::detail
