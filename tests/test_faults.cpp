// Faults while applying requests: memory for a block refused by the system
// (injected through the pool), and a user's completion handler that throws.
// Each fails only what it hits and leaves the cache usable.
#include "support.hpp"

#include <asio/io_context.hpp>

#include <stdexcept>

using namespace ghostlink;
using ghostlink::test::blocking;
using ghostlink::test::observe;
using ghostlink::test::observed;
using ghostlink::test::small_config;
using ghostlink::test::token_pattern;

TEST_CASE("a write whose block memory the system refuses fails with capacity_exhausted and changes nothing",
          "[faults]") {
  asio::thread_pool threads(2);
  const kv_cache_config config = small_config();  // 4 tokens per block
  const auto pool = kv_block_pool::for_caches(config);
  layer_kv_cache cache(threads, config, pool);
  const blocking sync{cache};
  const std::size_t width = config.token_width();
  REQUIRE_FALSE(sync.initialize(1));
  for (std::size_t i = 0; i < 4; ++i) {
    const auto v = token_pattern(width, i, 1);
    REQUIRE_FALSE(sync.write(i, v, v));
  }
  const observed before = observe(cache);
  const auto v = token_pattern(width, 4, 2);

  pool.state().fail_next_allocations(1);
  CHECK(sync.write(4, v, v) == kv_errc::capacity_exhausted);  // needs a new block
  CHECK(observe(cache) == before);
  CHECK(cache.stats().requests_failed == 1);

  // An overwrite of a published token needs a copy of its block: refused too.
  pool.state().fail_next_allocations(1);
  CHECK(sync.write(1, v, v) == kv_errc::capacity_exhausted);
  CHECK(observe(cache) == before);

  // Memory again: both writes succeed.
  CHECK_FALSE(sync.write(4, v, v));
  CHECK_FALSE(sync.write(1, v, v));
  kv_entry e;
  REQUIRE_FALSE(cache.snapshot().read_kv(4, e));
  CHECK(e.keys == v);
}

TEST_CASE("a sequence append whose block memory is refused in one layer stores the token in no layer",
          "[faults][sequence]") {
  asio::thread_pool threads(2);
  const kv_cache_config config = small_config();
  const auto pool = kv_block_pool::for_caches(config);
  sequence_kv_cache seq(threads, 3, config, pool);
  const auto v = token_pattern(config.token_width(), 0, 1);
  const std::vector<std::span<const float>> per_layer(3, std::span<const float>(v));
  pool.state().fail_next_allocations(1);  // one of the three layers' first block
  CHECK(test::wait_ec([&](auto token) { return seq.async_append(per_layer, per_layer, token); }) ==
        kv_errc::capacity_exhausted);
  CHECK(seq.size() == 0);
  CHECK(seq.snapshot().size() == 0);
  for (std::size_t l = 0; l < 3; ++l) {
    INFO("layer " << l);
    CHECK(seq.layer(l).size() == 0);
  }
  CHECK_FALSE(test::wait_ec([&](auto token) { return seq.async_append(per_layer, per_layer, token); }));
  CHECK(seq.snapshot().size() == 1);
}

TEST_CASE("a completion handler that throws propagates out of run() and leaves the cache working", "[faults]") {
  asio::io_context io;
  layer_kv_cache cache(io, small_config());
  const auto v = token_pattern(cache.config().token_width(), 0, 1);
  cache.async_initialize(1, [](std::error_code) { throw std::runtime_error("handler failed"); });
  CHECK_THROWS_AS(io.run(), std::runtime_error);
  CHECK(cache.size() == 1);  // the request was applied before its handler ran

  std::error_code result = kv_errc::not_initialized;
  io.restart();
  cache.async_write(0, v, v, [&](std::error_code ec) { result = ec; });
  io.run();
  CHECK_FALSE(result);
  kv_entry e;
  REQUIRE_FALSE(cache.snapshot().read_kv(0, e));
  CHECK(e.keys == v);
}
