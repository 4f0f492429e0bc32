// Faults while applying requests: memory for a block refused by the system
// (injected through the pool), memory for a page table, chunk or epoch
// refused (each allocation in turn, through a test hook), and a user's
// completion handler that throws.
// Each fails only what it hits and leaves the cache usable.
#include "common/support.hpp"
#include "testing/hooks.hpp"

#include "common/asio_compat.hpp"

#include <algorithm>
#include <optional>
#include <stdexcept>

namespace faults_tests {

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

  ghostlink::detail::fail_next_allocations(pool, 1);
  CHECK(sync.write(4, v, v) == kv_errc::capacity_exhausted);  // needs a new block
  CHECK(observe(cache) == before);
  CHECK(cache.stats().requests_failed == 1);

  // An overwrite of a published token needs a copy of its block: refused too.
  ghostlink::detail::fail_next_allocations(pool, 1);
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
  ghostlink::detail::fail_next_allocations(pool, 1);  // one of the three layers' first block
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
  cache.async_initialize(1, [](ghostlink::error_code) { throw std::runtime_error("handler failed"); });
  CHECK_THROWS_AS(io.run(), std::runtime_error);
  CHECK(cache.size() == 1);  // the request was applied before its handler ran

  ghostlink::error_code result = kv_errc::not_initialized;
  io.restart();
  cache.async_write(0, v, v, [&](ghostlink::error_code ec) { result = ec; });
  io.run();
  CHECK_FALSE(result);
  kv_entry e;
  REQUIRE_FALSE(cache.snapshot().read_kv(0, e));
  CHECK(e.keys == v);
}

namespace {

/// Runs `op` (which starts one operation on `io`) with the k-th allocation
/// of a page table, chunk or epoch failing, for k = 0, 1, ... until the
/// operation needs no more than k. Each failed run must complete with
/// capacity_exhausted and leave `state()` as it was; the one run that
/// succeeds (and every run after the injection is disarmed) must show
/// `state()` as `want` says. Returns how many allocations the operation made.
template <class Op, class State, class Want>
std::size_t sweep_metadata_failures(asio::io_context& io, Op op, State state, Want want) {
  for (std::size_t k = 0; k < 64; ++k) {
    INFO("allocation " << k << " fails");
    const auto before = state();
    std::optional<ghostlink::error_code> result;
    detail::fail_metadata_allocation(k);
    op([&](ghostlink::error_code ec) { result = ec; });
    io.run();
    io.restart();
    const bool fired = !detail::cancel_metadata_failure();
    REQUIRE(result.has_value());
    if (!fired) {
      CHECK_FALSE(*result);
      CHECK(want(before, state()));
      return k;
    }
    CHECK(*result == kv_errc::capacity_exhausted);
    CHECK(state() == before);
  }
  FAIL("the operation still allocated after 64 allocations");
  return 0;
}

}  // namespace

TEST_CASE("an allocation failure anywhere in a write, an overwrite, a truncate or an initialize fails it "
          "with capacity_exhausted and changes nothing; the cache keeps working",
          "[faults]") {
  asio::io_context io;
  kv_cache_config config = small_config();
  config.max_tokens_per_seq = 200;  // more than one chunk of 32 blocks of 4 tokens
  layer_kv_cache cache(io, config);
  const std::size_t width = config.token_width();
  auto state = [&] { return observe(cache); };
  auto write = [&](std::size_t index, int tag) {
    return [&cache, index, v = token_pattern(width, index, tag)](auto handler) {
      cache.async_write(index, v, v, std::move(handler));
    };
  };
  auto stores = [&](std::size_t index, int tag) {
    return [index, v = token_pattern(width, index, tag), width](const observed&, const observed& after) {
      return after.size > index &&
             std::equal(v.begin(), v.end(), after.keys.begin() + static_cast<std::ptrdiff_t>(index * width));
    };
  };

  std::size_t allocations = sweep_metadata_failures(
      io, [&](auto handler) { cache.async_initialize(150, std::move(handler)); }, state,
      [](const observed&, const observed& after) { return after.size == 150; });
  CHECK(allocations >= 1);  // at least its epoch
  for (std::size_t i : {0, 5, 140}) sweep_metadata_failures(io, write(i, 1), state, stores(i, 1));
  // An overwrite of a published token (copy on write of its chunk) and
  // tokens in a chunk no epoch has yet.
  sweep_metadata_failures(io, write(5, 2), state, stores(5, 2));
  sweep_metadata_failures(io, write(190, 1), state, stores(190, 1));
  allocations = sweep_metadata_failures(
      io, [&](auto handler) { cache.async_truncate(130, std::move(handler)); }, state,
      [](const observed&, const observed& after) { return after.size == 130; });
  CHECK(allocations >= 2);  // its table and chunk copies, and its epoch
  sweep_metadata_failures(io, write(131, 3), state, stores(131, 3));
}

TEST_CASE("an allocation failure anywhere in a fork fails it with capacity_exhausted and an empty handle, "
          "the parent unchanged",
          "[faults]") {
  asio::io_context io;
  kv_cache_config config = small_config();
  config.max_tokens_per_seq = 200;
  layer_kv_cache cache(io, config);
  const std::size_t width = config.token_width();
  cache.async_initialize(1, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  std::vector<std::vector<float>> tokens;
  for (std::size_t i = 0; i < 150; i += 7) tokens.push_back(token_pattern(width, i, 1));
  for (std::size_t t = 0; t < tokens.size(); ++t)
    cache.async_write(t * 7, tokens[t], tokens[t], [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  io.run();
  io.restart();

  layer_kv_cache child;
  const std::size_t allocations = sweep_metadata_failures(
      io,
      [&](auto handler) {
        cache.async_fork([&child, handler = std::move(handler)](ghostlink::error_code ec, layer_kv_cache c) mutable {
          CHECK(c.valid() == !ec);
          child = std::move(c);
          handler(ec);
        });
      },
      [&] { return observe(cache); },
      [&](const observed& before, const observed& after) {
        const observed c = observe(child);  // its epochs are numbered on from the parent's
        return after == before && c.size == before.size && c.keys == before.keys && c.values == before.values;
      });
  CHECK(allocations >= 3);  // the child's table, its chunks, its first epoch
}

TEST_CASE("an allocation failure in one layer of a sequence append stores the token in no layer",
          "[faults][sequence]") {
  asio::io_context io;
  sequence_kv_cache seq(io, 3, small_config());
  const auto v = token_pattern(seq.config().token_width(), 0, 1);
  const std::vector<std::span<const float>> per_layer(3, std::span<const float>(v));
  auto layer_sizes = [&] {
    std::vector<std::size_t> sizes{seq.size()};
    for (std::size_t l = 0; l < 3; ++l) sizes.push_back(seq.layer(l).size());
    return sizes;
  };
  const std::size_t allocations = sweep_metadata_failures(
      io, [&](auto handler) { seq.async_append(per_layer, per_layer, std::move(handler)); }, layer_sizes,
      [](const auto&, const std::vector<std::size_t>& after) { return after == std::vector<std::size_t>(4, 1); });
  CHECK(allocations >= 3);  // an epoch in every layer
}

}  // namespace faults_tests
