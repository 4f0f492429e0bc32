#pragma once
/// @file
/// Events a `kv_block_pool` reports as they happen (in the spirit of vLLM's
/// KV cache events): blocks allocated and freed, epochs published.

#include <cstddef>
#include <cstdint>
#include <functional>
#include "ghostlink/detail/flavour.hpp"

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

GHOSTLINK_NAMESPACE_END
