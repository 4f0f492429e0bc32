// Asio idioms beyond the completion tokens: the default token (co_await
// without naming one), experimental::use_promise, parallel_group over the
// layers of a step, and the handler's allocator for a sequence's operations.
#include "common/completion_support.hpp"
#include "common/sequence_support.hpp"

#include "common/asio_compat.hpp"

namespace asio_idioms_tests {

using namespace ghostlink;
using ghostlink::test::run_on;
using ghostlink::test::small_config;
using ghostlink::test::token_pattern;
using ghostlink::test::completion::alloc_counts;
using ghostlink::test::completion::counting_allocator;

TEST_CASE("co_await works without naming a token, for every operation; errors throw system_error", "[idioms]") {
  asio::io_context io;
  layer_kv_cache cache(io, small_config());
  sequence_kv_cache seq(io, 2, small_config());
  const std::size_t width = cache.config().token_width();
  const auto v = token_pattern(width, 1, 1);
  run_on(io, [&]() -> asio::awaitable<void> {
    co_await cache.async_initialize(4);
    co_await cache.async_write(1, v, v);
    const kv_write entry{2, v, v};
    co_await cache.async_write_batch(std::span(&entry, 1));
    const kv_entry e = co_await cache.async_read_kv(1);
    CHECK(e.keys == v);
    const kv_range r = co_await cache.async_read_range(0, 3);
    CHECK(r.keys.size() == 3 * width);
    layer_kv_cache child = co_await cache.async_fork();
    CHECK(child.size() == 4);
    co_await cache.async_truncate(2);
    CHECK(cache.size() == 2);
    CHECK(child.size() == 4);

    const std::vector<std::span<const float>> per_layer(2, std::span<const float>(v));
    co_await seq.async_append(per_layer, per_layer);
    sequence_kv_cache twin = co_await seq.async_fork();
    co_await seq.async_truncate(0);
    CHECK(seq.size() == 0);
    CHECK(twin.size() == 1);

    try {
      co_await cache.async_write(99, v, v);
      FAIL("a write past max_tokens_per_seq succeeded");
    } catch (const ghostlink::test::async_error& err) {
      CHECK(err.code() == kv_errc::index_out_of_range);
    }
  }());
}

TEST_CASE("use_promise starts a write at once; awaiting the promise gives its result", "[idioms]") {
  asio::io_context io;
  layer_kv_cache cache(io, small_config());
  const auto v = token_pattern(cache.config().token_width(), 0, 1);
  run_on(io, [&]() -> asio::awaitable<void> {
    co_await cache.async_initialize(1);
    auto ok = cache.async_write(0, v, v, asio::experimental::use_promise);
    auto bad = cache.async_write(99, v, v, asio::experimental::use_promise);
#if GHOSTLINK_ASIO_VERSION >= 102400
    auto [ok_ec] = co_await ok(test::as_tuple(asio::use_awaitable));
    auto [bad_ec] = co_await bad(test::as_tuple(asio::use_awaitable));
#else
    auto [ok_ec] = co_await ok.async_wait(test::as_tuple(asio::use_awaitable));
    auto [bad_ec] = co_await bad.async_wait(test::as_tuple(asio::use_awaitable));
#endif
    CHECK_FALSE(ok_ec);
    CHECK(bad_ec == kv_errc::index_out_of_range);
    CHECK(cache.size() == 1);
  }());
}

TEST_CASE("use_promise with a sequence's operations", "[idioms][sequence]") {
  asio::io_context io;
  sequence_kv_cache seq(io, 2, small_config());
  const auto v = token_pattern(seq.config().token_width(), 0, 1);
  const std::vector<std::span<const float>> per_layer(2, std::span<const float>(v));
  run_on(io, [&]() -> asio::awaitable<void> {
    auto appended = seq.async_append(per_layer, per_layer, asio::experimental::use_promise);
#if GHOSTLINK_ASIO_VERSION >= 102400
    auto [ec] = co_await appended(test::as_tuple(asio::use_awaitable));
#else
    auto [ec] = co_await appended.async_wait(test::as_tuple(asio::use_awaitable));
#endif
    CHECK_FALSE(ec);
    CHECK(seq.size() == 1);
  }());
}

TEST_CASE("parallel_group: one step's writes to every layer awaited at once, on a thread_pool", "[idioms]") {
  asio::thread_pool pool(2);
  const kv_cache_config config = small_config();
  std::array<layer_kv_cache, 3> layers{layer_kv_cache(pool, config), layer_kv_cache(pool, config),
                                       layer_kv_cache(pool, config)};
  const std::size_t width = config.token_width();
  auto step = [&](std::size_t index) -> asio::awaitable<std::array<ghostlink::error_code, 3>> {
    const auto k0 = token_pattern(width, index, 0), k1 = token_pattern(width, index, 1),
               k2 = token_pattern(width, index, 2);
    auto [order, e0, e1, e2] =
        co_await asio::experimental::make_parallel_group(layers[0].async_write(index, k0, k0, test::deferred),
                                                         layers[1].async_write(index, k1, k1, test::deferred),
                                                         layers[2].async_write(index, k2, k2, test::deferred))
            .async_wait(asio::experimental::wait_for_all(), asio::use_awaitable);
    CHECK(order.size() == 3);
    co_return std::array<ghostlink::error_code, 3>{e0, e1, e2};
  };
  for (auto& l : layers) REQUIRE_FALSE(test::blocking{l}.initialize(1));
  for (std::size_t index = 0; index < 4; ++index)
    CHECK(test::run(pool.get_executor(), step(index)) == std::array<ghostlink::error_code, 3>{});
  // A step past the end fails in every layer, and stores nothing.
  const auto results = test::run(pool.get_executor(), step(99));
  for (const ghostlink::error_code& ec : results) CHECK(ec == kv_errc::index_out_of_range);
  for (std::size_t l = 0; l < layers.size(); ++l) {
    INFO("layer " << l);
    CHECK(layers[l].size() == 4);
    kv_entry e;
    REQUIRE_FALSE(layers[l].snapshot().read_kv(3, e));
    CHECK(e.keys == token_pattern(width, 3, static_cast<int>(l)));
  }
  pool.join();
}

TEST_CASE("a sequence's operations allocate for the handler with its associated allocator", "[idioms][sequence]") {
  asio::io_context io;
  sequence_kv_cache seq(io, 3, small_config());
  const auto v = token_pattern(seq.config().token_width(), 0, 1);
  const std::vector<std::span<const float>> per_layer(3, std::span<const float>(v));
  alloc_counts counts;
  std::vector<ghostlink::error_code> results;
  auto h =
      asio::bind_allocator(counting_allocator<void>(counts), [&](ghostlink::error_code ec) { results.push_back(ec); });
  seq.async_append(per_layer, per_layer, h);
  io.run();
  io.restart();
  seq.async_truncate(0, h);
  io.run();
  CAPTURE(counts.allocations.load(), counts.deallocations.load());
  CHECK(results == std::vector<ghostlink::error_code>(2));
  // Per operation, its fan-out state (which holds the handler). Queueing the
  // completion is the executor's: an any_io_executor, like Asio's own
  // operations', ignores the allocator there.
  CHECK(counts.allocations.load() >= 2);
  CHECK(counts.allocations.load() == counts.deallocations.load());
}

}  // namespace asio_idioms_tests
