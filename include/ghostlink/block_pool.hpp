#pragma once
/// @file
/// `kv_block_pool`: the storage blocks of many caches under one budget.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory_resource>
#include <system_error>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/config.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/events.hpp"
#include "ghostlink/stats.hpp"

GHOSTLINK_NAMESPACE_BEGIN

namespace detail {
class block_pool;
struct pool_access;
}  // namespace detail

/// What a `kv_block_pool`'s blocks hold.
enum class kv_block_kind : std::uint8_t {
  /// Keys and values, half the block each: layer caches, and sequences of
  /// layouts without `keys_only`.
  keys_and_values,
  /// Keys alone (`kv_model_layout::keys_only`: latent attention's one
  /// vector per token): half the bytes of a block of keys and values of the
  /// same width.
  keys_only,
};

/// The budget of a `kv_block_pool`; the smaller of the two limits applies.
/// And where its memory comes from.
struct kv_pool_limits {
  std::size_t max_blocks = std::numeric_limits<std::size_t>::max();  ///< Blocks in use at once.
  std::size_t max_bytes = std::numeric_limits<std::size_t>::max();   ///< Payload bytes in use at once.
  /// Where the pool's extents (and blocks of their own) come from: memory
  /// the user chooses (pinned for transfers, on one NUMA node, backed by
  /// huge pages, an arena). Null: `operator new`. Asked for whole extents
  /// (and the odd block), aligned to 64 bytes, from any thread and several
  /// at once: it must be thread-safe. An `allocate` that throws is memory
  /// running out, as `std::bad_alloc` from `operator new` is. It must
  /// outlive the pool, which lives until its last block is freed (see
  /// `kv_block_pool`).
  std::pmr::memory_resource* memory = nullptr;
};

class kv_block_pool;

/// Budget of `size()` blocks taken from a `kv_block_pool` at once
/// (`kv_block_pool::reserve`), for a scheduler that admits a request only
/// when its blocks can be had (as vLLM's `allocate_slots`). Given to a
/// sequence (`basic_sequence_kv_cache::use_reservation`), it is what that
/// sequence's block allocations draw on first, its appends, forks' copies
/// and steps alike; what is left returns to the pool when the reservation,
/// or the sequence that took it, is destroyed. Move-only.
class kv_block_reservation {
 public:
  /// No blocks.
  kv_block_reservation() noexcept = default;
  /// Takes over the other's blocks; the other holds none.
  kv_block_reservation(kv_block_reservation&& other) noexcept;
  /// Gives back this one's blocks and takes over the other's.
  kv_block_reservation& operator=(kv_block_reservation&& other) noexcept;
  kv_block_reservation(const kv_block_reservation&) = delete;
  kv_block_reservation& operator=(const kv_block_reservation&) = delete;
  /// Gives the blocks back to the pool.
  ~kv_block_reservation() { reset(); }

  /// The blocks of budget held.
  std::size_t size() const noexcept { return blocks_; }
  /// True when it holds none.
  bool empty() const noexcept { return blocks_ == 0; }
  /// Gives the blocks back to the pool now.
  void reset() noexcept;
  /// The pool they are from.
  /// @pre `!empty()`.
  kv_block_pool pool() const noexcept;

 private:
  friend class kv_block_pool;
  friend struct detail::pool_access;
  kv_block_reservation(detail::block_pool* pool, std::size_t blocks) noexcept : pool_(pool), blocks_(blocks) {}
  detail::block_pool* pool_ = nullptr;  // one reference of the pool's count while blocks_ > 0
  std::size_t blocks_ = 0;
};

/// A thread-safe allocator of fixed-size storage blocks, shared by every
/// cache made with it (the layers of a model, the sequences of a server), with
/// one budget for all of them.
///
/// A handle: copies share one pool. A cache takes a block when a write needs
/// one: a new block of tokens, or a copy of a block some epoch or other
/// cache may read at the written position (shared with a fork, pinned by a
/// snapshot, or holding a token the cache still holds: an overwrite always
/// copies, as a snapshot may pin the latest epoch at any moment). A rewrite
/// of positions a published truncate cut off takes none when no older epoch
/// of the cache is alive and no one else holds the block (see
/// `basic_layer_kv_cache::async_truncate`). When the budget is spent a
/// write that needs a block fails with
/// `kv_errc::capacity_exhausted` and stores nothing. Blocks come back when no
/// epoch needs them any more (a truncate, the last snapshot of an old epoch
/// released, a cache destroyed) and their memory is reused before new
/// memory is taken (what is kept, and what goes back to the system, is
/// below); `trim()` returns what no block uses.
///
/// **Where blocks lie.** Memory comes in extents: slots of blocks laid out
/// as the keys of every slot, then the values of every slot. Each cache
/// fills an extent of its own, slot after slot, so the blocks it fills one
/// after another (a prefill, a decode) lie next to each other, keys after
/// keys and values after values; a snapshot's `for_each_block` hands such
/// blocks over as one run, and `attend` reads them as it reads one buffer.
///
/// - **Without a memory resource** (the default, on Linux, for blocks whose
///   keys fill a page or more: 4 KiB, 16 tokens of 128 elements of
///   `half`), an extent is
///   `reserved_extent_blocks` (64) blocks of address space, which becomes
///   memory page by page as blocks are written: a cache's runs are 1,024
///   tokens long at `block_tokens` 16, and it holds no memory ahead of its
///   tokens. A freed block's memory is kept for reuse, and growth takes it
///   before new memory once the pool keeps more than 64 free blocks (or
///   what `preallocate` asked for); an extent left with no block gives its
///   memory back to the system, in one call, once the pool's free blocks
///   outnumber those in use and it keeps that many without the extent's. The pool's blocks of
///   zeros are address space only.
/// - **With a memory resource** (`kv_pool_limits::memory`), on a system
///   without Linux's reserved pages, or for smaller blocks (an extent of
///   them is at most 128 KiB), an extent is `extent_blocks` (16)
///   blocks allocated whole. A cache that has used up its extent takes one
///   no block uses, else a new one, else any free slot: the pool grows by
///   a new extent only while fewer than 16 free slots per cache filling one
///   are spread over the others, and never past its budget rounded up to
///   whole extents.
///
/// **What memory a cache costs**, for capacity planning, with `B =
/// block_bytes()` and `T = block_tokens`:
///
/// - reserved extents: `ceil(tokens / T) * B` (the last block is
///   memory only as far as its pages are written), plus two pages of
///   extent headers per 64 blocks or part of them;
/// - extents allocated whole: `ceil(tokens / T) * B`, plus the rest of the
///   extent it fills (up to `15 * B`), plus its block of zeros (`B`, once
///   it has skipped positions or is read past its stored tokens);
/// - either way, about 1 KiB of block table and epoch per 1,024 tokens, and
///   its actor (a few KiB).
///
/// Besides, the pool keeps the blocks caches freed, for reuse: at most the
/// most blocks in use at once, less those in use now. With reserved
/// extents, 64 of them (or what `preallocate` asked for) are kept always,
/// and beyond that and beyond the blocks in use, each extent whose blocks
/// are all free is given back;
/// `trim()` gives back all of them. So a pool's memory stays within the
/// most blocks it had in use at once, plus 64 blocks (reserved extents; or
/// what `preallocate` asked), or plus an extent per cache filling one, in
/// whole extents (extents allocated whole).
///
/// `stats().bytes_allocated` is what the pool holds now; `blocks_free`,
/// what of it no block uses.
///
/// A destroyed cache's blocks come back once its actor has finished its last
/// drain, which may be just after the last write's handler has run.
///
/// Cost: taking a block is a compare-exchange on its extent's mask of free
/// slots and a few atomic operations on the counters; a mutex is taken once
/// per extent a cache fills, and when a freed block leaves its extent
/// unused or frees its first slot; with reserved extents, also for each
/// block taken while the pool keeps more free blocks than it may (it then
/// looks for one holding memory). Extents are reserved from the system
/// (or come from `operator new`, or `kv_pool_limits::memory`) when a cache
/// first needs them, or all at once (`preallocate`). The
/// pool lives until its last block is freed, even if every handle is gone.
/// All members are safe from any thread.
class kv_block_pool {
 public:
  /// Blocks of one extent of a pool with a memory resource: its unit of
  /// memory (see the class comment).
  static constexpr std::size_t extent_blocks = 16;
  /// Blocks of one extent of a pool without a memory resource: its unit of
  /// address space, and a cache's longest run (see the class comment).
  static constexpr std::size_t reserved_extent_blocks = 64;

  /// A pool of blocks of `block_bytes` payload bytes each, holding keys and
  /// values (half each) or, `kv_block_kind::keys_only`, keys alone.
  /// @throws std::system_error with `kv_errc::invalid_config` if
  ///         `block_bytes` is zero, or odd for keys and values, if `kind` is
  ///         not a `kv_block_kind`, or if the limits allow no block at all.
  explicit kv_block_pool(std::size_t block_bytes, kv_pool_limits limits = {},
                         kv_block_kind kind = kv_block_kind::keys_and_values);
  /// A pool whose blocks fit caches (and sequences of full or windowed
  /// layouts) of `config` storing `T`.
  /// @throws std::system_error with `kv_errc::invalid_config` for a bad
  ///         `config` (see `kv_cache_config`) or limits that allow no block.
  template <storage_element T = float>
  static kv_block_pool for_caches(const kv_cache_config& config, kv_pool_limits limits = {}) {
    return kv_block_pool(block_bytes_for<T>(config), limits);
  }
  /// A pool whose blocks fit sequences of `config` storing `T` whose layout
  /// stores `kind`: `kv_block_kind::keys_only` for a `keys_only` layout.
  /// @throws std::system_error with `kv_errc::invalid_config` as above.
  template <storage_element T = float>
  static kv_block_pool for_caches(const kv_cache_config& config, kv_block_kind kind, kv_pool_limits limits = {}) {
    return kv_block_pool(block_bytes_for<T>(config, kind), limits, kind);
  }

  /// Payload bytes of one block of a cache of `config` storing `T`:
  /// `2 * block_tokens * token_width() / elements_per<T> * sizeof(T)`, or
  /// half that for `kv_block_kind::keys_only` (keys alone).
  /// @throws std::system_error with `kv_errc::invalid_config` for a bad config.
  template <storage_element T = float>
  static std::size_t block_bytes_for(const kv_cache_config& config,
                                     kv_block_kind kind = kv_block_kind::keys_and_values) {
    detail::validate(config, detail::codec_of<T>);
    return (kind == kv_block_kind::keys_only ? 1 : 2) * config.block_tokens *
           detail::codec_of<T>.bytes(config.token_width());
  }

  /// Another handle on the same pool.
  kv_block_pool(const kv_block_pool& other) noexcept;
  /// Takes over the other's pool; the other may only be assigned to or destroyed.
  kv_block_pool(kv_block_pool&& other) noexcept;
  /// Makes this a handle on the other's pool.
  kv_block_pool& operator=(const kv_block_pool& other) noexcept;
  /// Takes over the other's pool.
  kv_block_pool& operator=(kv_block_pool&& other) noexcept;
  /// Drops this handle; the pool lives on while caches or blocks use it.
  ~kv_block_pool();

  /// Payload bytes of one block: its keys and its values (its keys alone,
  /// for `kv_block_kind::keys_only`).
  std::size_t block_bytes() const noexcept;
  /// What its blocks hold: keys and values, or keys alone.
  kv_block_kind kind() const noexcept;
  /// Blocks of one of this pool's extents: `reserved_extent_blocks`, or
  /// `extent_blocks` with a memory resource (see the class comment).
  std::size_t blocks_per_extent() const noexcept;
  /// The pool's counters now (see `kv_pool_stats`). Lock-free.
  kv_pool_stats stats() const noexcept;
  /// Blocks a request could have now: the budget left, plus the blocks
  /// that evicting idle entries of the pool's prefix cache would free (an
  /// idle entry with a cached descendant in use frees nothing until that
  /// descendant is idle too: two requests computed the same block and one
  /// let go). Attached entries are in use, so attaching lowers it.
  /// Lock-free; `stats().blocks_available`.
  std::size_t blocks_available() const noexcept;
  /// Takes `blocks` blocks of budget at once, evicting idle prefix-cache
  /// entries (least recently used first) as needed, or none.
  /// @throws std::system_error with `kv_errc::capacity_exhausted` when
  ///         `blocks_available()` is short of `blocks`: nothing is evicted
  ///         or reserved then. (Only a race with other allocations can make
  ///         the evictions fall short; what was evicted then stays evicted.)
  kv_block_reservation reserve(std::size_t blocks) const;
  /// As above, setting `ec` instead of throwing (an empty reservation then).
  kv_block_reservation reserve(std::size_t blocks, std::error_code& ec) const noexcept;
  /// Allocates the pool's memory now, as a server that commits its KV
  /// memory when it starts: grows the pool in whole extents, writing every
  /// page of them, until it holds memory for at least `blocks` blocks
  /// (memory it holds already counts), and keeps at least that much while
  /// blocks are freed. Caches then take their blocks from that memory, with
  /// no call to the system's allocator and no page fault while they serve,
  /// until they need more than it holds; then the pool grows as before. To
  /// cover `n` caches holding up to `b` blocks each, ask for `n * (b +
  /// blocks_per_extent())`: each cache fills an extent of its own. Nothing
  /// is counted against the budget: the memory is free blocks
  /// (`stats().blocks_free`), which `trim()` returns while no block uses
  /// them. Safe from any thread; the pages are written outside the pool's
  /// locks.
  /// @throws std::system_error with `kv_errc::capacity_exhausted` when
  ///         `blocks` is more than the pool's limits allow, rounded up to
  ///         whole extents: nothing is allocated then.
  /// @throws std::bad_alloc when the system has not the memory; the
  ///         extents allocated before stay, free, until `trim()`.
  void preallocate(std::size_t blocks);
  /// As above, setting `ec` instead of throwing (`std::errc::not_enough_memory`
  /// for the system's memory).
  void preallocate(std::size_t blocks, std::error_code& ec) noexcept;
  /// Returns to the system the memory no block uses: every free block's
  /// (without a memory resource; the address space stays the pool's), or
  /// every extent no block uses and no cache is filling (with one: a cache
  /// keeps the extent it fills while it lives). It also ends what
  /// `preallocate` asked the pool to keep.
  void trim() noexcept;
  /// Reports every later block allocation and free of this pool, and every
  /// epoch a cache on it publishes, to `handler` (see `kv_event_handler`
  /// for where and how it is called); an empty handler turns events off.
  /// Off by default, and then free: one atomic load per event.
  /// @throws std::bad_alloc if the handler cannot be stored.
  void set_event_handler(kv_event_handler handler);

  /// True when both handles share one pool.
  friend bool operator==(const kv_block_pool& a, const kv_block_pool& b) noexcept { return a.state_ == b.state_; }

 private:
  friend struct detail::pool_access;  // src/memory/block_pool.hpp
  struct adopt_state {};
  kv_block_pool(adopt_state, detail::block_pool* state) noexcept : state_(state) {}

  detail::block_pool* state_;  // one reference of the pool's count
};

GHOSTLINK_NAMESPACE_END
