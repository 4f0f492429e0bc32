#pragma once
// What every store keeps the same way: the cap on the values it reads
// (kv_block_store::limit_value_size) and its last error.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <system_error>

#include "ghostlink/stats.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// The largest value a store reads: none until set, then only rising (the
/// largest `raise()` holds, so stores shared by caches of several
/// geometries read every one's entries). Read from any thread.
class value_size_cap {
 public:
  static constexpr std::uint64_t none = std::numeric_limits<std::uint64_t>::max();

  std::uint64_t get() const noexcept { return cap_.load(std::memory_order_relaxed); }
  /// The first call sets the cap, a later one raises it to `bytes`.
  void raise(std::uint64_t bytes) noexcept {
    std::uint64_t now = cap_.load(std::memory_order_relaxed);
    while (!cap_.compare_exchange_weak(now, now == none ? bytes : std::max(now, bytes), std::memory_order_relaxed)) {
    }
  }

 private:
  std::atomic<std::uint64_t> cap_{none};
};

/// Records `ec` as `s`'s last error, now (under the store's lock).
inline void record_error(kv_store_stats& s, const std::error_code& ec) noexcept {
  s.last_error = ec;
  s.last_error_time = std::chrono::system_clock::now();
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
