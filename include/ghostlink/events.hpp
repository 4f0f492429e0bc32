#pragma once
/// @file
/// Events a `kv_block_pool` reports as they happen (in the spirit of vLLM's
/// KV cache events): blocks allocated and freed, epochs published; and
/// a prefix cache's entries stored, removed and cleared.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/block_hash.hpp"
#include "ghostlink/types.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// One thing that happened in a pool or in a cache on it.
struct kv_event {
  /// The kinds of event. A cache's first epoch (an empty cache's epoch 0,
  /// or a fork's first) is not reported as published, and the blocks a fork
  /// shares are not reported again: it allocates none.
  enum class kind : std::uint8_t {
    block_allocated,  ///< A cache took a block from the pool (counted against its budget).
    block_freed,      ///< A block went back to the pool: no epoch, snapshot or cache needs it.
    epoch_published,  ///< A cache published an epoch: what its snapshots see from now on.
  };
  /// Which kind of event this is.
  kind what = kind::block_allocated;
  /// The cache whose block or epoch it is (`kv_cache_stats::cache_id`; a
  /// block belongs to the cache that made it, even when a fork shares it).
  std::uint64_t cache = 0;
  std::uint64_t epoch = 0;  ///< `epoch_published`: the epoch's number.
  std::size_t size = 0;     ///< `epoch_published`: tokens in it.
};

/// Receives a pool's events: called synchronously, on the thread where the
/// event happens (a cache's actor for allocations and publications, any
/// thread that releases the last reference for a free), possibly on several
/// threads at once. It must be quick, thread-safe and must not throw (an
/// exception ends the process), and must not call back into the cache.
using kv_event_handler = std::function<void(const kv_event&)>;

/// One change to a prefix cache's entries, for a consumer that mirrors them
/// (a cache-aware router, as vLLM's KV events serve).
struct kv_prefix_event {
  /// What happened.
  enum class kind : std::uint8_t {
    stored,   ///< An entry was added.
    removed,  ///< An entry was evicted.
    cleared,  ///< `clear()` dropped every entry.
  };
  kind what = kind::stored;                 ///< What happened.
  std::uint64_t sequence = 0;               ///< 1, 2, 3, ... per handler, no gaps.
  kv_block_hash hash{};                     ///< stored, removed (all zero for cleared).
  std::optional<kv_block_hash> parent;      ///< stored: the previous block's, none for block 0.
  /// stored: the entry's retention priority (0-100, `kv_retention`);
  /// removed: its priority when it went (its default once a duration
  /// ended). A re-insert that changes a cached entry's priority emits no
  /// event. vLLM's wire format has no field for it.
  std::uint8_t priority = 35;
  /// stored: the block's `block_tokens` token ids, valid during the call
  /// (empty for an entry inserted without them: none so far).
  std::span<const token_id> token_ids{};
};

/// Every entry of a prefix cache, to join its event stream from
/// (`basic_kv_prefix_cache::dump`).
struct kv_prefix_dump {
  /// One cached entry: one full block of a prefix, in RAM.
  struct entry {
    kv_block_hash hash{};                 ///< Its block hash.
    std::optional<kv_block_hash> parent;  ///< The previous block's, none for block 0.
    std::vector<token_id> token_ids;      ///< Its block's `block_tokens` token ids.
    std::uint8_t priority = 35;           ///< Its retention priority now.
  };
  /// The number (`kv_prefix_event::sequence`) of the last event the
  /// cache's handler had been given when the dump began (0: none). Applying
  /// every event numbered after it to `entries`, in order, as a mirror does
  /// (`stored`: put the entry, `removed`: erase it if present, `cleared`:
  /// erase all), gives the cache's entries exactly.
  std::uint64_t sequence = 0;
  /// The entries, in no particular order (a child may come before its parent).
  std::vector<entry> entries;
};

/// Receives a prefix cache's events (see `basic_kv_prefix_cache::set_event_handler`).
using kv_prefix_event_handler = std::function<void(const kv_prefix_event&)>;

GHOSTLINK_NAMESPACE_END
