#pragma once
// How ghostlink's templates make cache and snapshot handles from the untyped
// machinery in src/ (a fork's new actor, a pinned epoch) without public
// constructors that users could reach.

#include <memory>
#include <utility>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

struct cache_access {
  /// A handle of type `Handle` on `state` (an empty handle if null), made
  /// with `more` too (a layer's index).
  template <class Handle, class State, class... More>
  static Handle adopt(State state, More... more) noexcept {
    return state ? Handle(std::move(state), more...) : Handle();
  }
  /// The state a handle holds.
  template <class Handle>
  static const auto& state_of(const Handle& h) noexcept {
    return h.state_;
  }
};

/// Turns a finished fork operation (a layer's request or a sequence's
/// operation, whose `forked` field holds the new state) into the handle the
/// handler receives.
template <class Handle>
struct adopt_forked {
  template <class Op>
  Handle operator()(Op& op) const noexcept {
    return cache_access::adopt<Handle>(std::move(op.forked));
  }
};

/// Turns a finished step begin (a sequence's operation, whose `step` field
/// holds the step) into the step handle the handler receives.
template <class Handle>
struct adopt_step {
  template <class Op>
  Handle operator()(Op& op) const noexcept {
    return cache_access::adopt<Handle>(std::move(op.step));
  }
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
