#pragma once
// The one place the tests, the fuzzer and the stress test take Asio from:
// the flavour ghostlink was built with (standalone Asio, or Boost.Asio when
// the dependency defines GHOSTLINK_ASIO_BOOST), and the names that moved
// between the ends of the supported range (Asio 1.24 took `as_tuple` and
// `deferred` out of `experimental`). With Boost, `asio::` names
// `boost::asio::` here as in ghostlink.

#include "ghostlink/detail/asio_config.hpp"

// A path inside a macro argument: clang-format would space its slashes.
// clang-format off
#include GHOSTLINK_ASIO_HEADER(bind_allocator.hpp)
#include GHOSTLINK_ASIO_HEADER(bind_cancellation_slot.hpp)
#include GHOSTLINK_ASIO_HEADER(bind_executor.hpp)
#include GHOSTLINK_ASIO_HEADER(cancellation_signal.hpp)
#include GHOSTLINK_ASIO_HEADER(co_spawn.hpp)
#include GHOSTLINK_ASIO_HEADER(detached.hpp)
#include GHOSTLINK_ASIO_HEADER(experimental/awaitable_operators.hpp)
#include GHOSTLINK_ASIO_HEADER(experimental/concurrent_channel.hpp)
#include GHOSTLINK_ASIO_HEADER(experimental/parallel_group.hpp)
#include GHOSTLINK_ASIO_HEADER(experimental/promise.hpp)
#if __has_include(GHOSTLINK_ASIO_HEADER(experimental/use_promise.hpp))  // Asio >= 1.24
#include GHOSTLINK_ASIO_HEADER(experimental/use_promise.hpp)
#endif
#include GHOSTLINK_ASIO_HEADER(io_context.hpp)
#include GHOSTLINK_ASIO_HEADER(steady_timer.hpp)
#include GHOSTLINK_ASIO_HEADER(this_coro.hpp)
#include GHOSTLINK_ASIO_HEADER(thread_pool.hpp)
#include GHOSTLINK_ASIO_HEADER(use_future.hpp)

#if GHOSTLINK_ASIO_VERSION >= 102400
#include GHOSTLINK_ASIO_HEADER(as_tuple.hpp)
#include GHOSTLINK_ASIO_HEADER(deferred.hpp)
#else
#include GHOSTLINK_ASIO_HEADER(experimental/as_tuple.hpp)
#include GHOSTLINK_ASIO_HEADER(experimental/deferred.hpp)
#endif
// clang-format on

#include <system_error>

#if GHOSTLINK_ASIO_BOOST
#include <boost/system/system_error.hpp>
namespace asio = ::boost::asio;
#endif

namespace ghostlink::test {

#if GHOSTLINK_ASIO_VERSION >= 102400
inline constexpr auto deferred = asio::deferred;
using asio::as_tuple;
#else
inline constexpr auto deferred = asio::experimental::deferred;
using asio::experimental::as_tuple;
#endif

/// What `asio::use_future` and `asio::use_awaitable` throw for an error:
/// `std::system_error` standalone, `boost::system::system_error` with Boost.
/// (Constructors and other synchronous calls throw `std::system_error` in
/// both flavours.)
#if GHOSTLINK_ASIO_BOOST
using async_error = ::boost::system::system_error;
#else
using async_error = ::std::system_error;
#endif

}  // namespace ghostlink::test
