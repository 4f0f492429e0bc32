#pragma once
/// @file
/// Counters a `layer_kv_cache` keeps about itself.

#include <cstddef>
#include <cstdint>

namespace ghostlink {

/// A point-in-time reading of a cache's counters (`layer_kv_cache::stats()`).
/// Each field is read separately with relaxed ordering: exact when the cache
/// is idle, approximate while it is being written.
struct kv_cache_stats {
  std::uint64_t epoch = 0;             ///< Latest published epoch number.
  std::size_t size = 0;                ///< Tokens in the latest epoch.
  std::uint64_t drains = 0;            ///< Mailbox drains the actor has run.
  std::uint64_t requests_applied = 0;  ///< Write requests that succeeded.
  std::uint64_t requests_failed = 0;   ///< Write requests that failed.
  std::size_t blocks_in_use = 0;       ///< Blocks alive (published, pinned or being written).
  std::size_t bytes_in_use = 0;        ///< Payload bytes of those blocks.
};

}  // namespace ghostlink
