#pragma once
// Test hooks of kv_event_publisher (src/events/publisher.cpp), for the
// tests alone.

#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/event_publisher.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

struct publisher_access {
  /// While on, the publisher's thread takes nothing from its queue (as a
  /// thread that cannot keep up), so the queue fills and overflows.
  static void hold(kv_event_publisher& p, bool on) noexcept;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
