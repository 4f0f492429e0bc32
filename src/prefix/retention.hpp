#pragma once
// Retention priorities (ghostlink/prefix_cache.hpp, kv_retention): the
// priority and duration each block of an insert gets, and the clock its
// durations run on.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <ranges>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/prefix_cache.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// What one block of an insert is given.
struct block_retention {
  std::uint8_t priority = kv_retention::default_value;
  std::uint8_t after = kv_retention::default_value;  // once `duration` has ended
  std::chrono::steady_clock::duration duration{0};   // 0: none
};

/// A kv_retention checked, for inserts of `block_tokens`-token blocks.
class retention_rule {
 public:
  /// The plain insert's: the default priority everywhere, no duration.
  retention_rule() = default;
  /// @throws std::system_error(kv_errc::invalid_retention) for a priority
  ///         above 100, a range whose first > last or a negative duration.
  ///         std::bad_alloc.
  retention_rule(const kv_retention& r, std::size_t block_tokens);

  /// Block `b`'s (by position from 0): the last range holding its last
  /// token, else the default.
  block_retention at(std::size_t b) const noexcept {
    const std::size_t last_token = (b + 1) * block_tokens_ - 1;
    for (const range& g : std::views::reverse(ranges_))  // the later range wins
      if (g.first <= last_token && last_token < g.last) return {g.priority, default_, g.duration};
    return {default_, default_, {}};
  }
  /// Some range has a duration: the insert reads the clock.
  bool timed() const noexcept { return timed_; }

 private:
  struct range {
    std::size_t first, last;
    std::uint8_t priority;
    std::chrono::steady_clock::duration duration;
  };
  std::vector<range> ranges_;
  std::uint8_t default_ = kv_retention::default_value;
  std::size_t block_tokens_ = 1;
  bool timed_ = false;
};

/// The clock durations run on: std::chrono::steady_clock, unless a test
/// set another (src/testing/hooks.hpp).
inline std::atomic<std::chrono::steady_clock::time_point (*)()> retention_clock_hook{nullptr};
inline std::chrono::steady_clock::time_point retention_now() noexcept {
  if (auto* hook = retention_clock_hook.load(std::memory_order_relaxed)) return hook();
  return std::chrono::steady_clock::now();
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
