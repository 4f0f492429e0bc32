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

/// Where a prefix cache's entry is: the tier an event or a dump entry is of.
enum class kv_prefix_tier : std::uint8_t {
  ram,    ///< In RAM: cached, an attach takes its blocks.
  store,  ///< In the cache's block store (`kv_prefix_options::store`): an attach fetches it.
};

/// One change to a prefix cache's entries, for a consumer that mirrors them
/// (a cache-aware router, as vLLM's KV events serve).
struct kv_prefix_event {
  /// What happened.
  enum class kind : std::uint8_t {
    stored,   ///< An entry was added (to `tier`).
    removed,  ///< An entry was evicted (from `tier`).
    cleared,  ///< `clear()` dropped every entry, of both tiers.
  };
  kind what = kind::stored;                 ///< What happened.
  /// stored, removed: the tier. An entry is in RAM, in the store, or in
  /// both (a write-through entry, or one fetched back): each tier has its
  /// own stored and removed events. The store's are the entries this
  /// cache put there, as its store tells (`kv_store_receipt`): stored once
  /// written, removed when the store evicts it, or when an attach's fetch
  /// of it misses (a store that cannot tell, as a Redis server evicting on
  /// its own). `clear()` forgets them (the store keeps its values).
  kv_prefix_tier tier = kv_prefix_tier::ram;
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
  /// One cached entry: one full block of a prefix, in one tier (an entry
  /// in both is listed once for each).
  struct entry {
    kv_block_hash hash{};                 ///< Its block hash.
    kv_prefix_tier tier = kv_prefix_tier::ram;  ///< Its tier.
    std::optional<kv_block_hash> parent;  ///< The previous block's, none for block 0.
    std::vector<token_id> token_ids;      ///< Its block's `block_tokens` token ids.
    std::uint8_t priority = 35;           ///< Its retention priority now (the default in the store).
  };
  /// The number (`kv_prefix_event::sequence`) of the last event the
  /// cache's handler had been given when the dump began (0: none). Applying
  /// every event numbered after it to `entries`, in order, as a mirror does
  /// (`stored`: put the entry, `removed`: erase it if present, `cleared`:
  /// erase all; an entry keyed by its hash and tier), gives the cache's
  /// entries exactly.
  std::uint64_t sequence = 0;
  /// The entries, in no particular order (a child may come before its parent).
  std::vector<entry> entries;
};

/// Receives a prefix cache's events (see `basic_kv_prefix_cache::set_event_handler`).
using kv_prefix_event_handler = std::function<void(const kv_prefix_event&)>;

GHOSTLINK_NAMESPACE_END
