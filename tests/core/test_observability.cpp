// What a cache and a pool tell about themselves: epochs alive and the oldest
// one a snapshot pins, open snapshots, requests per drain, and the event
// hook (blocks allocated and freed, epochs published).
#include "common/support.hpp"

#include "common/asio_compat.hpp"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <numeric>
#include <thread>

namespace observability_tests {

using namespace ghostlink;
using ghostlink::test::initialized_cache;
using ghostlink::test::small_config;
using ghostlink::test::token_pattern;

namespace {

/// Writes token `index` on a context the test thread runs.
void write_now(asio::io_context& io, layer_kv_cache& cache, std::size_t index, int tag) {
  const auto v = token_pattern(cache.config().token_width(), index, tag);
  cache.async_write(index, v, v, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  io.run();
  io.restart();
}

}  // namespace

TEST_CASE("stats show the epochs alive, the oldest a snapshot pins, and the snapshots open", "[observability]") {
  asio::io_context io;
  layer_kv_cache cache = initialized_cache(io, small_config());
  write_now(io, cache, 0, 1);
  kv_cache_stats s = cache.stats();
  CHECK(s.epochs_alive == 1);
  CHECK(s.oldest_epoch_alive == s.epoch);
  CHECK(s.snapshots_alive == 0);

  kv_snapshot held = cache.snapshot();
  const std::uint64_t pinned = held.epoch();
  for (int i = 1; i <= 3; ++i) write_now(io, cache, static_cast<std::size_t>(i), 1);
  s = cache.stats();
  CHECK(s.epoch == pinned + 3);
  CHECK(s.epochs_alive == 2);  // the pinned one and the latest; those between are gone
  CHECK(s.oldest_epoch_alive == pinned);
  CHECK(s.snapshots_alive == 1);

  // Moves and prefixes keep one snapshot open; a second pin of the same
  // epoch is a second snapshot.
  kv_snapshot moved = std::move(held);
  kv_snapshot narrowed = std::move(moved).prefix(1);
  kv_snapshot latest = cache.snapshot();
  CHECK(cache.stats().snapshots_alive == 2);
  narrowed = kv_snapshot();  // released: the pinned epoch goes
  s = cache.stats();
  CHECK(s.snapshots_alive == 1);
  CHECK(s.epochs_alive == 1);
  CHECK(s.oldest_epoch_alive == s.epoch);
  latest = kv_snapshot();
  CHECK(cache.stats().snapshots_alive == 0);
}

TEST_CASE("two reader threads pinning and releasing while the actor publishes: the counts settle back",
          "[observability][concurrency]") {
  asio::thread_pool pool(2);
  kv_cache_config config = small_config();
  config.max_tokens_per_seq = 256;
  layer_kv_cache cache(pool, config);
  test::blocking sync{cache};
  REQUIRE_FALSE(sync.initialize(1));
  std::atomic<bool> done{false};
  std::atomic<int> out_of_order{0};
  auto reader = [&] {
    while (!done) {
      kv_snapshot a = cache.snapshot();
      const kv_cache_stats s = cache.stats();
      // The snapshot just taken is alive, so the oldest epoch is no newer.
      if (s.oldest_epoch_alive > a.epoch() || s.snapshots_alive < 1) ++out_of_order;
    }
  };
  std::thread r1(reader), r2(reader);
  const std::size_t width = config.token_width();
  for (std::size_t i = 0; i < config.max_tokens_per_seq; ++i) {
    const auto v = token_pattern(width, i, 1);
    REQUIRE_FALSE(sync.write(i, v, v));
  }
  done = true;
  r1.join();
  r2.join();
  CHECK(out_of_order.load() == 0);
  const kv_cache_stats s = cache.stats();
  CHECK(s.snapshots_alive == 0);
  CHECK(s.epochs_alive == 1);
  CHECK(s.oldest_epoch_alive == s.epoch);
  pool.join();
}

TEST_CASE("requests_per_drain counts each drain in the bucket of its size", "[observability]") {
  asio::io_context io;
  layer_kv_cache cache = initialized_cache(io, small_config());  // one drain of 1
  const std::size_t width = cache.config().token_width();
  std::vector<std::vector<float>> tokens;
  for (std::size_t i = 0; i < 5; ++i) tokens.push_back(token_pattern(width, i, 1));
  for (std::size_t i = 0; i < 5; ++i)
    cache.async_write(i, tokens[i], tokens[i], [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  io.run();  // one drain takes all five
  const kv_cache_stats s = cache.stats();
  kv_cache_stats::drain_histogram want{};
  want[0] = 1;  // [1, 2): the initialize
  want[2] = 1;  // [4, 8): the five writes
  CHECK(s.requests_per_drain == want);
  CHECK(std::accumulate(want.begin(), want.end(), std::uint64_t{0}) == s.drains);
}

TEST_CASE("the event hook reports blocks allocated and freed and epochs published, in order, for its pool",
          "[observability][events]") {
  asio::io_context io;
  const kv_cache_config config = small_config();  // 4 tokens per block
  auto pool = kv_block_pool::for_caches(config);
  std::vector<kv_event> events;
  pool.set_event_handler([&](const kv_event& e) { events.push_back(e); });
  {
    layer_kv_cache cache(io, config, pool);
    const std::uint64_t id = cache.stats().cache_id;
    cache.async_initialize(1, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
    io.run();
    io.restart();
    REQUIRE(events.size() == 1);
    CHECK(events[0].what == kv_event::kind::epoch_published);
    CHECK(events[0].cache == id);
    CHECK(events[0].epoch == cache.stats().epoch);
    CHECK(events[0].size == 1);

    events.clear();
    write_now(io, cache, 0, 1);  // the first block
    REQUIRE(events.size() == 2);
    CHECK(events[0].what == kv_event::kind::block_allocated);
    CHECK(events[0].cache == id);
    CHECK(events[1].what == kv_event::kind::epoch_published);
    CHECK(events[1].size == 1);

    events.clear();
    cache.async_truncate(0, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
    io.run();
    io.restart();
    // The block goes once no epoch needs it: when the old epoch is replaced.
    const auto count = [&](kv_event::kind k) {
      return std::count_if(events.begin(), events.end(), [k](const kv_event& e) { return e.what == k; });
    };
    CHECK(count(kv_event::kind::block_freed) == 1);
    CHECK(count(kv_event::kind::epoch_published) == 1);
  }
  // Turned off, it is not called.
  pool.set_event_handler({});
  events.clear();
  layer_kv_cache other(io, config, pool);
  other.async_initialize(1, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  io.run();
  io.restart();
  write_now(io, other, 0, 1);
  CHECK(other.stats().blocks_in_use == 1);
  CHECK(events.empty());
}

TEST_CASE("event handlers may be replaced while caches on two threads allocate and publish",
          "[observability][events][concurrency]") {
  asio::thread_pool threads(2);
  const kv_cache_config config = small_config();
  auto pool = kv_block_pool::for_caches(config);
  std::atomic<std::size_t> first{0}, second{0};
  pool.set_event_handler([&](const kv_event&) { ++first; });
  layer_kv_cache a(threads, config, pool), b(threads, config, pool);
  test::blocking sa{a}, sb{b};
  REQUIRE_FALSE(sa.initialize(1));
  REQUIRE_FALSE(sb.initialize(1));
  std::atomic<int> failures{0};  // no asserts off the test thread
  std::thread other([&] {
    for (std::size_t i = 0; i < config.max_tokens_per_seq; ++i) {
      const auto v = token_pattern(config.token_width(), i, 2);
      if (sb.write(i, v, v)) ++failures;
    }
  });
  for (std::size_t i = 0; i < config.max_tokens_per_seq; ++i) {
    if (i == config.max_tokens_per_seq / 2) pool.set_event_handler([&](const kv_event&) { ++second; });
    const auto v = token_pattern(config.token_width(), i, 1);
    REQUIRE_FALSE(sa.write(i, v, v));
  }
  other.join();
  CHECK(failures.load() == 0);
  CHECK(first.load() > 0);
  CHECK(second.load() > 0);
  threads.join();
}

}  // namespace observability_tests
