#pragma once
// What tests observe inside the stores, set through testing/hooks.hpp:
// production code only loads these, and calls nothing while they are null.

#include <atomic>
#include <cstdint>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// Called by a file store under its lock each time it reserves room (a
/// write's, or a file found by a lookup), with the bytes indexed plus
/// those reserved by writes in flight, and its budget.
inline std::atomic<void (*)(std::uint64_t used, std::uint64_t budget)> file_store_reserved_hook{nullptr};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
