#pragma once
/// @file
/// Counters a `layer_kv_cache`, a `kv_block_pool`, a prefix cache and a
/// block store keep about themselves.

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <system_error>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// A point-in-time reading of a cache's counters (`layer_kv_cache::stats()`).
/// Each field is read separately with relaxed ordering: exact when the cache
/// is idle, approximate while it is being written.
struct kv_cache_stats {
  /// Drains counted by how many requests each took: bucket `i` counts
  /// drains of `[2^i, 2^(i+1))` requests, the last one drains of 128 (the
  /// most one drain takes). Large drains mean writers arrive together and
  /// share epochs.
  using drain_histogram = std::array<std::uint64_t, 8>;

  std::uint64_t cache_id = 0;          ///< This cache's id, as `kv_event::cache` gives it.
  std::uint64_t epoch = 0;             ///< Latest published epoch number.
  std::size_t size = 0;                ///< Tokens in the latest epoch.
  std::uint64_t drains = 0;            ///< Mailbox drains the actor has run.
  std::uint64_t requests_applied = 0;  ///< Write requests that succeeded.
  std::uint64_t requests_failed = 0;   ///< Write requests that failed (cancelled ones aside).
  std::uint64_t requests_cancelled = 0;  ///< Write requests cancelled before the actor applied them.
  std::size_t requests_queued = 0;       ///< Requests in the mailbox now (at most `max_pending`).
  std::size_t requests_waiting = 0;      ///< Requests waiting for room in the mailbox now.
  std::uint64_t requests_delayed = 0;    ///< Requests that ever had to wait for room.
  drain_histogram requests_per_drain{};  ///< See `drain_histogram`.
  /// Epochs in memory: the latest, and older ones that snapshots pin.
  std::size_t epochs_alive = 0;
  /// The oldest epoch in memory. Far behind `epoch`, it is a reader holding
  /// an old snapshot, and with it blocks the cache has since replaced.
  std::uint64_t oldest_epoch_alive = 0;
  std::size_t snapshots_alive = 0;  ///< Snapshots of this cache open now (reads in progress included).
  /// Blocks alive in the cache's pool (published, pinned or being written),
  /// counted against its budget; with a pool shared by several caches, the
  /// whole pool's count.
  std::size_t blocks_in_use = 0;
  std::size_t bytes_in_use = 0;  ///< Payload bytes of those blocks.
};

/// A point-in-time reading of a pool's counters (`kv_block_pool::stats()`),
/// each read separately with relaxed ordering: exact when every cache of the
/// pool is idle.
struct kv_pool_stats {
  std::size_t block_bytes = 0;         ///< Payload bytes of one block (keys and values).
  std::size_t max_blocks = 0;          ///< The budget, in blocks.
  std::size_t blocks_in_use = 0;       ///< Blocks some cache, epoch, snapshot, prefix cache or reservation holds.
  /// Blocks' memory the pool holds that no block uses: slots freed and kept
  /// for reuse, or allocated ahead (see `kv_block_pool::trim`).
  std::size_t blocks_free = 0;
  std::size_t peak_blocks_in_use = 0;  ///< The most blocks in use at once so far.
  /// Blocks referenced from more than one place: shared by forks, or by two
  /// epochs of one cache while a snapshot pins the older.
  std::size_t blocks_shared = 0;
  std::uint64_t cow_copies = 0;  ///< Blocks copied because a write hit a shared one.
  /// Blocks' memory obtained from the system (or the pool's memory
  /// resource) and not yet returned: the slots that hold blocks, and
  /// `blocks_free`; and with extents allocated whole, each cache's one
  /// block of zeros, which the budget exempts (with reserved extents the
  /// zeros are address space that is no memory). See `kv_block_pool` for
  /// what memory a cache costs.
  std::uint64_t blocks_allocated = 0;
  /// Bytes of memory the pool holds: `blocks_allocated * block_bytes`, and
  /// its extents' headers (a few KiB per extent).
  std::uint64_t bytes_allocated = 0;

  /// Of `blocks_in_use`, the distinct blocks a prefix cache references
  /// (shared with sequences or idle).
  std::size_t blocks_cached = 0;
  /// Of `blocks_cached`, those nothing but the prefix cache references:
  /// evictable for room. `blocks_in_use - blocks_cached_idle -
  /// blocks_reserved` blocks are in use by sequences, epochs and snapshots.
  std::size_t blocks_cached_idle = 0;
  /// Of `blocks_in_use`, budget held by reservations and not yet allocated.
  std::size_t blocks_reserved = 0;
  /// What `kv_block_pool::blocks_available()` returns: the budget left plus
  /// the idle cached blocks that eviction can free (at most `blocks_cached_idle`).
  std::size_t blocks_available = 0;
  /// Payload bytes of the blocks in use: `blocks_in_use * block_bytes`.
  std::size_t bytes_in_use() const noexcept { return blocks_in_use * block_bytes; }
};

/// A prefix cache's counters (`basic_kv_prefix_cache::stats`), each read
/// separately: exact when the caches on the pool are idle. The hit rate is
/// `hit_tokens / query_tokens` (vLLM's `prefix_cache_hits / prefix_cache_queries`).
struct kv_prefix_stats {
  std::uint64_t queries = 0;          ///< `match()` and `attach()` calls.
  std::uint64_t query_tokens = 0;     ///< Tokens of full blocks asked for in them.
  std::uint64_t hit_tokens = 0;       ///< Of those, found cached.
  std::uint64_t inserted_blocks = 0;  ///< Entries `insert()` (and `async_attach()`, from the store) added.
  std::uint64_t evicted_blocks = 0;   ///< Entries evicted for room in the pool.
  std::size_t cached_blocks = 0;      ///< Entries now (as `cached_entries`: an entry is a block of every layer).
  std::size_t idle_blocks = 0;        ///< Entries now that nothing but the cache uses.
  std::uint64_t store_hit_tokens = 0;  ///< Tokens `async_attach()` attached from the store.
  std::uint64_t store_puts = 0;        ///< Entries handed to the store (write-through or write-back).
  std::uint64_t store_rejects = 0;     ///< Values from the store refused as corrupt or of another entry.
  std::size_t cached_entries = 0;      ///< Entries now (the count `cached_blocks` holds, by its name).
  /// Windowed parts evicted on their own: an entry's blocks of its windowed
  /// layers, the entry staying (a hybrid layout's; see docs/API.md).
  std::uint64_t window_evictions = 0;
  /// `evicted_blocks` by the entry's retention priority when it went, in
  /// bands of `kv_priority_band()`: 0-24, 25-49 (the default 35), 50-74,
  /// 75-100. They sum to `evicted_blocks`.
  std::array<std::uint64_t, 4> evictions_by_priority{};
};

/// The band of `kv_prefix_stats::evictions_by_priority` that `priority`
/// (0-100) counts in: `priority / 25`, 100 in the last.
constexpr std::size_t kv_priority_band(std::uint8_t priority) noexcept { return priority >= 75 ? 3 : priority / 25; }

/// What a KV-event publisher (`kv_event_publisher`, event_publisher.hpp)
/// has done, counted since it started.
struct kv_event_publisher_stats {
  std::uint64_t events_published = 0;  ///< Events sent in batches on the PUB socket.
  std::uint64_t batches_published = 0; ///< Batches sent; the next one's number is this plus `batches_lost`.
  std::uint64_t events_dropped = 0;    ///< Events the full queue (or memory refused) dropped.
  std::uint64_t batches_lost = 0;      ///< Batch numbers never sent (their events dropped): gaps.
  std::uint64_t replays_served = 0;    ///< Replay requests answered.
  std::uint64_t dumps_served = 0;      ///< Dump requests answered.
  std::uint64_t bad_requests = 0;      ///< Replay-socket messages that were not a request.
  std::uint64_t replies_dropped = 0;   ///< Replies cut short: the client was not reading (its queue full).
};

/// A store's counters, each read separately: exact when the store is idle.
struct kv_store_stats {
  std::uint64_t puts = 0;          ///< Values handed to `put()`.
  std::uint64_t stored = 0;        ///< Of those, stored.
  std::uint64_t dropped = 0;       ///< Of those, not stored because of a limit (see the store's limits).
  std::uint64_t write_errors = 0;  ///< Of those, not stored because of an error (I/O, memory).
  std::uint64_t lookups = 0;       ///< Hashes asked of `fetch()`.
  std::uint64_t hits = 0;          ///< Of those, answered with bytes.
  std::uint64_t evictions = 0;     ///< Entries removed for the budget.
  std::size_t entries = 0;         ///< Entries now.
  std::size_t bytes = 0;           ///< Their bytes now.
  std::size_t pending_bytes = 0;   ///< Bytes of puts not yet stored or dropped.
  std::uint64_t auth_errors = 0;   ///< Connections the server refused to authenticate (`store_auth_failed`).
  std::uint64_t tls_errors = 0;    ///< Connections whose TLS handshake failed (`store_tls_failed`).
  /// Values found larger than the cap (`kv_block_store::limit_value_size`,
  /// `kv_file_store_limits::max_value_bytes`): misses, never read. The file
  /// store counts each lookup of one, each file found at start and each
  /// indexed entry a new cap takes out.
  std::uint64_t oversized = 0;
  /// The last error the store met (a write's, a read's, a connection's, a
  /// value over the cap: `EFBIG` in the file store): a `kv_errc` or the
  /// system's error (`errno` in the generic category); empty while none.
  /// A missing value is a miss, not an error.
  std::error_code last_error{};
  /// When `last_error` happened; the epoch while none.
  std::chrono::system_clock::time_point last_error_time{};
  /// The file store's directory can be written by users other than its
  /// owner (group or others write permission, sticky or not): they could
  /// add, replace or remove entries (the checksums turn garbage into
  /// misses, not a forged consistent entry) or fill the disk. A warning,
  /// not an error: the store works, and leaves the directory as it is.
  bool directory_writable_by_others = false;
};

GHOSTLINK_NAMESPACE_END
