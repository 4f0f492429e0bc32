// Backpressure: with `max_pending` requests queued, a new request waits for
// room (FIFO, allocating nothing) instead of growing the mailbox; it is
// applied after the queued ones, in the order requests were initiated, and
// the mailbox's memory stays bounded however many producers write at once.
#include "common/support.hpp"
#include "testing/hooks.hpp"

#include "common/asio_compat.hpp"

#include <algorithm>
#include <atomic>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <thread>

namespace backpressure_tests {

using namespace ghostlink;
using ghostlink::test::initialized_cache;
using ghostlink::test::small_config;
using ghostlink::test::token_pattern;

namespace {

kv_cache_config bounded_config(std::size_t max_pending, std::size_t tokens = 16) {
  kv_cache_config c = small_config();
  c.max_tokens_per_seq = tokens;
  c.max_pending = max_pending;
  return c;
}

/// The keys of token `index` in the latest epoch.
std::vector<float> keys_at(const layer_kv_cache& cache, std::size_t index) {
  kv_entry e;
  REQUIRE_FALSE(cache.snapshot().read_kv(index, e));
  return e.keys;
}

}  // namespace

TEST_CASE("max_pending = 0 is an invalid config", "[backpressure]") {
  asio::io_context io;
  try {
    layer_kv_cache cache(io, bounded_config(0));
    FAIL("a cache with max_pending = 0 was made");
  } catch (const std::system_error& e) {
    CHECK(e.code() == kv_errc::invalid_config);
  }
}

TEST_CASE("beyond max_pending, new writes wait for room and apply after the queued ones, in order", "[backpressure]") {
  asio::io_context io;
  layer_kv_cache cache = initialized_cache(io, bounded_config(2));
  const std::size_t width = cache.config().token_width();
  constexpr int writes = 7;
  std::vector<std::vector<float>> tokens;
  for (int tag = 0; tag < writes; ++tag) tokens.push_back(token_pattern(width, 0, tag));

  std::vector<int> completed;
  for (int tag = 0; tag < writes; ++tag)
    cache.async_write(0, tokens[tag], tokens[tag], [&, tag](ghostlink::error_code ec) {
      CHECK_FALSE(ec);
      completed.push_back(tag);
    });

  kv_cache_stats s = cache.stats();
  CHECK(s.requests_queued == 2);
  CHECK(s.requests_waiting == writes - 2);
  CHECK(s.requests_delayed == writes - 2);

  io.run();
  std::vector<int> in_order(writes);
  for (int tag = 0; tag < writes; ++tag) in_order[tag] = tag;
  CHECK(completed == in_order);
  CHECK(keys_at(cache, 0) == tokens.back());  // the last initiated wins
  s = cache.stats();
  CHECK(s.requests_queued == 0);
  CHECK(s.requests_waiting == 0);
  CHECK(s.requests_applied == writes + 1);  // and the initialize
}

TEST_CASE("a request cancelled while it waits for room completes with operation_aborted and stores nothing",
          "[backpressure][cancellation]") {
  asio::io_context io;
  layer_kv_cache cache = initialized_cache(io, bounded_config(1));
  const std::size_t width = cache.config().token_width();
  const auto first = token_pattern(width, 0, 1), waiting = token_pattern(width, 0, 2);

  std::optional<ghostlink::error_code> first_ec, waiting_ec;
  asio::cancellation_signal signal;
  cache.async_write(0, first, first, [&](ghostlink::error_code ec) { first_ec = ec; });
  cache.async_write(0, waiting, waiting,
                    asio::bind_cancellation_slot(signal.slot(), [&](ghostlink::error_code ec) { waiting_ec = ec; }));
  REQUIRE(cache.stats().requests_waiting == 1);
  signal.emit(asio::cancellation_type::terminal);
  io.run();

  REQUIRE(first_ec.has_value());
  REQUIRE(waiting_ec.has_value());
  CHECK_FALSE(*first_ec);
  CHECK(*waiting_ec == asio::error::operation_aborted);
  CHECK(keys_at(cache, 0) == first);
  CHECK(cache.stats().requests_cancelled == 1);
}

TEST_CASE("requests waiting for room are destroyed unrun with the context, and free the cache",
          "[backpressure][shutdown]") {
  auto alive = std::make_shared<int>(0);  // every handler holds a copy
  {
    asio::io_context io;
    layer_kv_cache cache = initialized_cache(io, bounded_config(2));
    const auto v = token_pattern(cache.config().token_width(), 0, 1);
    for (int i = 0; i < 6; ++i)
      cache.async_write(0, v, v, [alive, cache](ghostlink::error_code) { FAIL("a handler ran"); });
    REQUIRE(cache.stats().requests_waiting == 4);
    CHECK(alive.use_count() == 7);
    cache = layer_kv_cache();  // only the handlers hold the cache now
    // The context dies with the drain queued: every handler, queued or
    // waiting, is destroyed unrun, and with them the last handles (the
    // teardown check fails the test if the cache's pool outlives them).
  }
  CHECK(alive.use_count() == 1);
}

TEST_CASE("two producer threads against one consumer thread: the queue never exceeds the bound, "
          "every write applies once, each thread's writes in order",
          "[backpressure][concurrency]") {
  constexpr std::size_t max_pending = 8;
  constexpr int per_thread = 2000;
  asio::io_context io;
  layer_kv_cache cache = initialized_cache(io, bounded_config(max_pending));
  const std::size_t width = cache.config().token_width();
  // Thread t overwrites token t with 0, 1, 2, ...: in order, a reader never
  // sees the value go back.
  std::vector<std::vector<float>> values;
  for (int n = 0; n < per_thread; ++n) values.emplace_back(width, static_cast<float>(n));

  std::atomic<int> done{0};
  std::atomic<std::size_t> peak_queued{0};
  std::atomic<bool> went_back{false};
  auto work = asio::make_work_guard(io);
  std::thread consumer([&] { io.run(); });
  auto produce = [&](std::size_t token) {
    float last_seen = -1;
    for (int n = 0; n < per_thread; ++n) {
      cache.async_write(token, values[n], values[n], [&](ghostlink::error_code ec) {
        if (ec) went_back = true;  // reported below; no asserts off the test thread
        const std::size_t q = cache.stats().requests_queued;
        std::size_t peak = peak_queued.load();
        while (q > peak && !peak_queued.compare_exchange_weak(peak, q)) {
        }
        done.fetch_add(1);
      });
      if (n % 64 == 0 && cache.size() > token) {
        kv_entry e;
        if (!cache.snapshot().read_kv(token, e)) {
          if (e.keys[0] < last_seen) went_back = true;
          last_seen = e.keys[0];
        }
      }
    }
  };
  std::thread a(produce, 1), b(produce, 2);
  a.join();
  b.join();
  work.reset();
  consumer.join();  // run() returns once every handler has run

  CHECK(done.load() == 2 * per_thread);
  CHECK_FALSE(went_back.load());
  CHECK(peak_queued.load() <= max_pending);
  const kv_cache_stats s = cache.stats();
  CHECK(s.requests_queued == 0);
  CHECK(s.requests_waiting == 0);
  CHECK(s.requests_applied == 2 * per_thread + 1);
  CHECK(keys_at(cache, 1) == values.back());
  CHECK(keys_at(cache, 2) == values.back());
}

namespace {

/// What one run of the producers scenario saw.
struct producers_run {
  std::size_t queued_after_burst = 0;
  std::size_t peak_queued = 0;
  std::uint64_t mailbox_growth = 0;  // bytes the mailbox grew by
  std::size_t writes_applied = 0;
  bool every_token_right = false;
};

/// `producers` producers (initiated from two threads) each write their own
/// token `rounds` times, issuing the next write from the completion of the
/// last, to a cache whose actor a single slow thread runs only after every
/// producer has started.
producers_run run_producers(std::size_t producers, std::size_t max_pending, int rounds) {
  asio::io_context consumer;
  kv_cache_config config = bounded_config(max_pending, producers);
  config.num_heads = 1;
  layer_kv_cache cache = initialized_cache(consumer, config);
  const std::size_t width = cache.config().token_width();
  std::vector<std::vector<float>> round_values;
  for (int r = 0; r < rounds; ++r) round_values.emplace_back(width, static_cast<float>(r));

  producers_run result;
  const std::uint64_t bytes_before = detail::mailbox_bytes_allocated();
  std::uint64_t bytes_peak = bytes_before;
  struct producer {
    std::size_t token = 0;
    int round = 0;
  };
  std::vector<producer> state(producers);
  std::function<void(producer&)> write_next = [&](producer& p) {
    const auto& v = round_values[p.round];
    cache.async_write(p.token, v, v, [&, pp = &p](ghostlink::error_code ec) {
      REQUIRE_FALSE(ec);  // handlers run on this (the test) thread
      result.peak_queued = std::max(result.peak_queued, cache.stats().requests_queued);
      bytes_peak = std::max(bytes_peak, detail::mailbox_bytes_allocated());
      ++result.writes_applied;
      if (++pp->round < rounds) write_next(*pp);
    });
  };
  auto start = [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) {
      state[i].token = i;
      write_next(state[i]);
    }
  };
  std::thread a(start, 0, producers / 2), b(start, producers / 2, producers);
  a.join();
  b.join();
  result.queued_after_burst = cache.stats().requests_queued;
  bytes_peak = std::max(bytes_peak, detail::mailbox_bytes_allocated());

  consumer.run();  // the consumer, one thread, starts only now
  result.mailbox_growth = bytes_peak - bytes_before;
  const kv_snapshot snap = cache.snapshot();
  result.every_token_right = snap.size() == producers;
  for (std::size_t i = 0; i < producers && result.every_token_right; ++i) {
    kv_entry e;
    result.every_token_right = !snap.read_kv(i, e) && e.keys == round_values.back();
  }
  return result;
}

}  // namespace

TEST_CASE("10,000 producers and a slow consumer: the mailbox stays bounded by max_pending", "[backpressure]") {
  constexpr std::size_t producers = 10'000, max_pending = 64;
  constexpr int rounds = 3;
  const producers_run bounded = run_producers(producers, max_pending, rounds);
  const producers_run unbounded = run_producers(producers, std::numeric_limits<std::size_t>::max(), rounds);
  INFO("mailbox growth: bounded " << bounded.mailbox_growth << " bytes, unbounded " << unbounded.mailbox_growth);

  CHECK(bounded.writes_applied == producers * rounds);
  CHECK(bounded.every_token_right);
  CHECK(bounded.queued_after_burst == max_pending);
  CHECK(bounded.peak_queued <= max_pending);
  // Without the bound the same burst queues every producer's write, and the
  // mailbox grows with them: 10,000 pointers are 80,000 bytes at least.
  CHECK(unbounded.writes_applied == producers * rounds);
  CHECK(unbounded.queued_after_burst == producers);
  CHECK(unbounded.mailbox_growth >= producers * sizeof(void*));
  CHECK(bounded.mailbox_growth * 10 < unbounded.mailbox_growth);
}

TEST_CASE("a sequence whose layers have a bound appends through it", "[backpressure][sequence]") {
  asio::io_context io;
  sequence_kv_cache seq(io, 3, bounded_config(1));
  const std::size_t width = seq.config().token_width();
  std::vector<std::vector<float>> tokens;
  for (int t = 0; t < 4; ++t) tokens.push_back(token_pattern(width, static_cast<std::size_t>(t), 1));
  std::vector<std::span<const float>> per_layer(3);
  int appended = 0;
  std::function<void()> append_next = [&] {
    std::fill(per_layer.begin(), per_layer.end(), std::span<const float>(tokens[appended]));
    seq.async_append(per_layer, per_layer, [&](ghostlink::error_code ec) {
      REQUIRE_FALSE(ec);
      if (++appended < 4) append_next();
    });
  };
  append_next();
  io.run();
  CHECK(appended == 4);
  CHECK(seq.size() == 4);
}

}  // namespace backpressure_tests
