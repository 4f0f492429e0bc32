#pragma once
// The Asio names the tests, the fuzzer and the stress test use that moved
// between the ends of the supported range: Asio 1.24 took `as_tuple` and
// `deferred` out of `experimental`. The one place that branches on it.

#include <asio/version.hpp>

#if ASIO_VERSION >= 102400
#include <asio/as_tuple.hpp>
#include <asio/deferred.hpp>
#else
#include <asio/experimental/as_tuple.hpp>
#include <asio/experimental/deferred.hpp>
#endif

namespace ghostlink::test {

#if ASIO_VERSION >= 102400
inline constexpr auto deferred = asio::deferred;
using asio::as_tuple;
#else
inline constexpr auto deferred = asio::experimental::deferred;
using asio::experimental::as_tuple;
#endif

}  // namespace ghostlink::test
