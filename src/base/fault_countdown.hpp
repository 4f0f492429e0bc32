#pragma once
// The state behind the test hooks of src/testing/hooks.hpp: production code asks
// it whether to fail (allocations) or to pause (a submit), and only tests
// set it.

#include <atomic>
#include <cstddef>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// Counts `counter` down by one unless it is zero; returns its value before
/// (0: nothing injected).
inline std::size_t count_down(std::atomic<std::size_t>& counter) noexcept {
  std::size_t n = counter.load(std::memory_order_relaxed);
  while (n > 0 && !counter.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) {
  }
  return n;
}

/// metadata_new()'s countdown: the allocation that takes it from 1 to 0
/// fails; 0 when no failure is pending.
std::atomic<std::size_t>& metadata_countdown() noexcept;

/// Called by actor::submit between queueing a request and counting it in
/// the actor's pending_, when a test has set it (set_enqueued_hook); null
/// otherwise.
inline std::atomic<void (*)()> enqueued_hook{nullptr};
/// Called by a sequence step's write() after it claimed its layer and
/// before it stores the tokens, when a test has set it
/// (set_step_write_hook); null otherwise.
inline std::atomic<void (*)()> step_write_hook{nullptr};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
