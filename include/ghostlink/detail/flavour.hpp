#pragma once
// The Asio flavour, once for every header and source of ghostlink. Included
// by every header before anything else (through asio_config.hpp by those
// that use Asio).
//
// Standalone Asio unless GHOSTLINK_ASIO_BOOST is defined to 1, which the
// build passes through the dependency of the Boost flavour
// (`ghostlink-boost`: Meson, pkg-config). Nobody defines it by hand.
// Each flavour lives in its own inline namespace of `ghostlink`, so both can
// link into one process, and a header built with one flavour against the
// library of the other fails at link time instead of running.
//
// Inside the namespace, `asio::` names the flavour's Asio and
// `ghostlink::error_code` its error code (`std::error_code` standalone,
// `boost::system::error_code` with Boost). Completion handlers receive that
// type; synchronous results (snapshot reads) are `std::error_code` in both.

#ifndef GHOSTLINK_ASIO_BOOST
#define GHOSTLINK_ASIO_BOOST 0  // from here on, `#if GHOSTLINK_ASIO_BOOST` is the one test of the flavour
#endif

#define GHOSTLINK_DETAIL_STR(x) #x
#define GHOSTLINK_DETAIL_XSTR(x) GHOSTLINK_DETAIL_STR(x)
/// `#include GHOSTLINK_ASIO_HEADER(post.hpp)`: the flavour's Asio header.
// clang-format off
#define GHOSTLINK_ASIO_HEADER(name) GHOSTLINK_DETAIL_XSTR(GHOSTLINK_DETAIL_ASIO_DIR/name)  // NOLINT(bugprone-macro-parentheses): a path
// clang-format on

#if GHOSTLINK_ASIO_BOOST

#define GHOSTLINK_FLAVOUR boost_asio
// clang-format off
#define GHOSTLINK_DETAIL_ASIO_DIR boost/asio
// clang-format on

#if defined(__clang__) && __clang_major__ < 17 && !defined(BOOST_ASIO_DISABLE_AWAITABLE_FRAME_RECYCLING)
// LLVM issue 63022: a thread_local's address kept across co_await.
#define BOOST_ASIO_DISABLE_AWAITABLE_FRAME_RECYCLING 1
#endif

#include <boost/asio/version.hpp>
#include <boost/system/error_code.hpp>
#include <boost/system/is_error_code_enum.hpp>
#define GHOSTLINK_ASIO_VERSION BOOST_ASIO_VERSION
#if BOOST_ASIO_VERSION < 102600
#error "ghostlink's Boost flavour needs Boost.Asio 1.26 (Boost 1.81) or newer"
#endif

namespace boost::asio {}  // namespace boost::asio

#else  // standalone Asio

#define GHOSTLINK_FLAVOUR standalone_asio
#define GHOSTLINK_DETAIL_ASIO_DIR asio

#if defined(__clang__) && defined(__cpp_impl_coroutine) && !defined(ASIO_HAS_CO_AWAIT)
// Asio 1.22 looks for <experimental/coroutine>, which libstdc++ lacks.
#define ASIO_HAS_CO_AWAIT 1
#define ASIO_HAS_STD_COROUTINE 1
#endif
#if defined(__clang__) && __clang_major__ < 17 && !defined(ASIO_DISABLE_AWAITABLE_FRAME_RECYCLING)
// LLVM issue 63022: a thread_local's address kept across co_await.
#define ASIO_DISABLE_AWAITABLE_FRAME_RECYCLING 1
#endif

#include <asio/version.hpp>
#define GHOSTLINK_ASIO_VERSION ASIO_VERSION

#endif

#include <system_error>

/// Opens ghostlink's namespace (with the flavour's inline namespace);
/// `GHOSTLINK_NAMESPACE_END` closes it.
#define GHOSTLINK_NAMESPACE_BEGIN \
  namespace ghostlink {           \
  inline namespace GHOSTLINK_FLAVOUR {
/// Closes what `GHOSTLINK_NAMESPACE_BEGIN` opened.
#define GHOSTLINK_NAMESPACE_END \
  }                             \
  }

GHOSTLINK_NAMESPACE_BEGIN

#if GHOSTLINK_ASIO_BOOST
namespace asio = ::boost::asio;
/// The error code completion handlers receive: the flavour's (with Boost,
/// `boost::system::error_code`, so that `asio::use_awaitable` throws it).
using error_code = ::boost::system::error_code;
#else
/// The error code completion handlers receive: the flavour's (standalone,
/// `std::error_code`, as `asio::error_code` is).
using error_code = ::std::error_code;
#endif

namespace detail {
/// A synchronous result (a `std::error_code`) as the error code a handler
/// receives. Success must stay the flavour's own success: Boost.System would
/// wrap std's as a code that compares unequal to `error_code()`. A
/// `kv_errc` code keeps its category (see `kv_boost_category()`).
inline error_code to_error_code(const std::error_code& ec) noexcept { return ec ? error_code(ec) : error_code(); }
}  // namespace detail

GHOSTLINK_NAMESPACE_END
