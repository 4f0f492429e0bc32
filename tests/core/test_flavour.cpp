// The Asio flavour as a user sees it, in whichever flavour this program was
// built: the error code handlers receive, kv_errc in that flavour's error
// system, what use_awaitable throws, synchronous results as std::error_code,
// and the inline namespace the library's names live in.
#include "common/completion_support.hpp"

#include "common/asio_compat.hpp"

#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>

namespace flavour_tests {

using namespace ghostlink;
using ghostlink::test::run_on;
using ghostlink::test::small_config;
using ghostlink::test::token_pattern;

namespace {
constexpr bool boost_flavour = GHOSTLINK_ASIO_BOOST != 0;
}  // namespace

TEST_CASE("ghostlink::error_code is the flavour's error code; snapshot reads return std::error_code", "[flavour]") {
#if GHOSTLINK_ASIO_BOOST
  STATIC_REQUIRE(std::is_same_v<ghostlink::error_code, boost::system::error_code>);
  STATIC_REQUIRE(std::is_same_v<ghostlink::test::async_error, boost::system::system_error>);
#else
  STATIC_REQUIRE(std::is_same_v<ghostlink::error_code, std::error_code>);
  STATIC_REQUIRE(std::is_same_v<ghostlink::error_code, asio::error_code>);
#endif
  using snapshot_read = decltype(std::declval<const kv_snapshot&>().read_kv(0, std::declval<kv_entry&>()));
  using snapshot_range = decltype(std::declval<const kv_snapshot&>().read_range(0, 0, std::declval<std::span<float>>(),
                                                                                std::declval<std::span<float>>()));
  STATIC_REQUIRE(std::is_same_v<snapshot_read, std::error_code>);
  STATIC_REQUIRE(std::is_same_v<snapshot_range, std::error_code>);

  // A handler's success is the flavour's own success.
  asio::io_context io;
  layer_kv_cache cache(io, small_config());
  ghostlink::error_code ok = kv_errc::invalid_config;
  ghostlink::error_code bad;
  cache.async_initialize(1, [&](ghostlink::error_code ec) { ok = ec; });
  cache.async_read_kv(5, [&](ghostlink::error_code ec, const kv_entry&) { bad = ec; });
  io.run();
  CHECK(ok == ghostlink::error_code());
  CHECK_FALSE(ok);
  CHECK(bad == kv_errc::index_out_of_range);
  CHECK(bad.category().name() == std::string_view("ghostlink.kv"));
}

TEST_CASE("kv_errc converts to the flavour's error code and back, keeping its category", "[flavour]") {
  const std::error_code s = kv_errc::capacity_exhausted;
  CHECK(&s.category() == &kv_category());
  CHECK(s.category().name() == std::string_view("ghostlink.kv"));

  const ghostlink::error_code e = kv_errc::capacity_exhausted;
  CHECK(e == kv_errc::capacity_exhausted);
  CHECK(e != kv_errc::invalid_config);
  CHECK(e.category().name() == std::string_view("ghostlink.kv"));
  CHECK(e.message() == s.message());
  CHECK(e.value() == static_cast<int>(kv_errc::capacity_exhausted));

  // Through the other type and back.
  const std::error_code as_std = e;
  CHECK(as_std == kv_errc::capacity_exhausted);
  CHECK(&as_std.category() == &kv_category());
  const ghostlink::error_code back = as_std;
  CHECK(back == e);
  CHECK(back == kv_errc::capacity_exhausted);
#if GHOSTLINK_ASIO_BOOST
  // Registered with Boost.System: a native Boost code of kv_boost_category(),
  // not a wrapped std one.
  STATIC_REQUIRE(boost::system::is_error_code_enum<kv_errc>::value);
  CHECK(e.category() == kv_boost_category());
  CHECK(back.category() == kv_boost_category());
  CHECK(&static_cast<const std::error_category&>(kv_boost_category()) == &kv_category());
#endif
  CHECK(boost_flavour == (std::string_view(typeid(e).name()).find("boost") != std::string_view::npos));
}

TEST_CASE("co_await with use_awaitable throws the flavour's system_error with the kv_errc", "[flavour]") {
  asio::io_context io;
  layer_kv_cache cache(io, small_config());
  const auto v = token_pattern(cache.config().token_width(), 0, 1);
  int caught = 0;
  run_on(io, [&]() -> asio::awaitable<void> {
    co_await cache.async_initialize(1);
    try {
      co_await cache.async_write(99, v, v);
    } catch (const ghostlink::test::async_error& err) {
      CHECK(err.code() == kv_errc::index_out_of_range);
      ++caught;
    }
    // as_tuple gives the flavour's error code as a value.
    auto [ec] = co_await cache.async_write(99, v, v, test::as_tuple(asio::use_awaitable));
    static_assert(std::is_same_v<std::decay_t<decltype(ec)>, ghostlink::error_code>);
    CHECK(ec == kv_errc::index_out_of_range);
  }());
  CHECK(caught == 1);
  CHECK(cache.size() == 1);
}

TEST_CASE("cancellation completes with the flavour's operation_aborted", "[flavour]") {
  asio::io_context io;
  layer_kv_cache cache(io, small_config());
  const auto v = token_pattern(cache.config().token_width(), 0, 1);
  asio::cancellation_signal signal;
  ghostlink::error_code ec;
  cache.async_write(0, v, v, asio::bind_cancellation_slot(signal.slot(), [&](ghostlink::error_code e) { ec = e; }));
  signal.emit(asio::cancellation_type::terminal);
  io.run();
  CHECK(ec == asio::error::operation_aborted);
  CHECK(cache.size() == 0);
}

TEST_CASE("the library's names live in the flavour's inline namespace", "[flavour]") {
  const std::string_view pool = typeid(kv_block_pool).name();
  const std::string_view cache = typeid(layer_kv_cache).name();
  const std::string_view mine = boost_flavour ? "boost_asio" : "standalone_asio";
  const std::string_view other = boost_flavour ? "standalone_asio" : "boost_asio";
  CHECK(pool.find(mine) != std::string_view::npos);
  CHECK(cache.find(mine) != std::string_view::npos);
  CHECK(pool.find(other) == std::string_view::npos);
}

}  // namespace flavour_tests
