// Per-operation cancellation: a write cancelled before the actor applies it
// completes with operation_aborted and stores nothing; one the actor has
// already applied completes normally. Both races, through a bound
// cancellation slot and through awaitable_operators' `||` with a timer.
#include "common/support.hpp"

#include "common/asio_compat.hpp"

#include <atomic>
#include <future>
#include <optional>
#include <random>
#include <thread>
#include <variant>

namespace cancellation_tests {

using namespace ghostlink;
using ghostlink::test::small_config;
using ghostlink::test::token_pattern;

namespace {

constexpr auto aborted = asio::error::operation_aborted;

/// Token `index` as stored (keys and values) by `snap`, or nothing past its end.
std::optional<kv_entry> stored(const kv_snapshot& snap, std::size_t index) {
  kv_entry e;
  if (snap.read_kv(index, e)) return std::nullopt;
  return e;
}

}  // namespace

TEST_CASE("a write cancelled before the actor applies it completes with operation_aborted and stores nothing",
          "[cancellation]") {
  asio::io_context io;  // not running yet: the request waits in the mailbox
  layer_kv_cache cache(io, small_config());
  const auto v = token_pattern(cache.config().token_width(), 3, 1);
  cache.async_initialize(2, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  io.run();
  io.restart();
  const std::uint64_t epoch_before = cache.snapshot().epoch();

  asio::cancellation_signal signal;
  std::optional<ghostlink::error_code> result;
  cache.async_write(3, v, v,
                    asio::bind_cancellation_slot(signal.slot(), [&](ghostlink::error_code ec) { result = ec; }));
  signal.emit(asio::cancellation_type::terminal);
  io.run();

  REQUIRE(result.has_value());
  CHECK(*result == aborted);
  CHECK(cache.size() == 2);
  CHECK(cache.snapshot().epoch() == epoch_before);  // nothing published
  CHECK(cache.stats().requests_cancelled == 1);
  CHECK(cache.stats().requests_failed == 0);
}

TEST_CASE("a write the actor has applied completes normally when cancelled afterwards", "[cancellation]") {
  asio::io_context io;
  layer_kv_cache cache(io, small_config());
  const auto v = token_pattern(cache.config().token_width(), 1, 1);
  cache.async_initialize(1, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  io.run();
  io.restart();

  asio::cancellation_signal signal;
  std::optional<ghostlink::error_code> result;
  cache.async_write(1, v, v,
                    asio::bind_cancellation_slot(signal.slot(), [&](ghostlink::error_code ec) { result = ec; }));
  REQUIRE(io.run_one() == 1);  // the drain: applied and published, the completion queued
  REQUIRE_FALSE(result.has_value());
  signal.emit(asio::cancellation_type::terminal);
  io.run();

  REQUIRE(result.has_value());
  CHECK_FALSE(*result);
  const auto got = stored(cache.snapshot(), 1);
  REQUIRE(got.has_value());
  CHECK(got->keys == v);
  CHECK(cache.stats().requests_cancelled == 0);
}

TEST_CASE("a cancelled fork completes with operation_aborted and an empty handle", "[cancellation]") {
  asio::io_context io;
  layer_kv_cache cache(io, small_config());
  asio::cancellation_signal signal;
  std::optional<ghostlink::error_code> result;
  layer_kv_cache child;
  cache.async_fork(asio::bind_cancellation_slot(signal.slot(), [&](ghostlink::error_code ec, layer_kv_cache c) {
    result = ec;
    child = std::move(c);
  }));
  signal.emit(asio::cancellation_type::terminal);
  io.run();
  REQUIRE(result.has_value());
  CHECK(*result == aborted);
  CHECK_FALSE(child.valid());
}

TEST_CASE("write || timer: the timer winning cancels the write before it is applied", "[cancellation]") {
  using namespace asio::experimental::awaitable_operators;
  asio::io_context coroutine_io, cache_io;  // the cache's actor runs only after the race is decided
  layer_kv_cache cache(cache_io, small_config());
  const auto v = token_pattern(cache.config().token_width(), 0, 1);
  cache.async_initialize(1, [](ghostlink::error_code) {});
  cache_io.run();
  cache_io.restart();

  std::optional<std::size_t> winner;
  asio::co_spawn(
      coroutine_io,
      [&]() -> asio::awaitable<void> {
        asio::steady_timer timer(coroutine_io, std::chrono::steady_clock::duration::zero());
        auto r = co_await (cache.async_write(0, v, v, asio::use_awaitable) || timer.async_wait(asio::use_awaitable));
        winner = r.index();
      },
      asio::detached);
  // The timer completes and `||` cancels the write; the write's completion
  // (after the cache's drain) ends the coroutine.
  for (int round = 0; round < 1000 && !winner; ++round) {
    coroutine_io.poll();
    cache_io.poll();
  }
  REQUIRE(winner.has_value());
  CHECK(*winner == 1);
  CHECK(cache.stats().requests_cancelled == 1);
  CHECK(stored(cache.snapshot(), 0)->keys == std::vector<float>(v.size(), 0.0f));  // still the zeros of initialize
}

TEST_CASE("write || timer: the write winning is stored and the timer is cancelled", "[cancellation]") {
  using namespace asio::experimental::awaitable_operators;
  asio::io_context io;
  layer_kv_cache cache(io, small_config());
  const auto v = token_pattern(cache.config().token_width(), 0, 2);
  cache.async_initialize(1, [](ghostlink::error_code) {});
  io.run();
  io.restart();

  std::optional<std::size_t> winner;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        asio::steady_timer timer(io, std::chrono::hours(1));
        auto r = co_await (cache.async_write(0, v, v, asio::use_awaitable) || timer.async_wait(asio::use_awaitable));
        winner = r.index();
      },
      asio::detached);
  io.run();  // bounded: the timer is cancelled when the write wins
  REQUIRE(winner.has_value());
  CHECK(*winner == 0);
  CHECK(stored(cache.snapshot(), 0)->keys == v);
}

TEST_CASE("writes cancelled at random from another thread are either stored and successful or absent and aborted",
          "[cancellation][concurrency]") {
  asio::thread_pool pool(2);
  const kv_cache_config config{.max_tokens_per_seq = 512, .num_heads = 2, .head_dim = 4, .block_tokens = 4};
  layer_kv_cache cache(pool, config);
  const std::size_t n = config.max_tokens_per_seq, width = config.token_width();
  REQUIRE_FALSE(test::blocking{cache}.initialize(n));

  std::vector<std::vector<float>> data;
  for (std::size_t i = 0; i < n; ++i) data.push_back(token_pattern(width, i, 1));
  // Each write's handler and its cancellation run on one strand, as Asio
  // requires of a cancellation slot; the strand's threads are the pool's.
  std::vector<asio::cancellation_signal> signals(n);
  std::vector<std::atomic<int>> outcome(n);  // 0 pending, 1 ok, 2 aborted, 3 other
  std::atomic<std::size_t> done{0};
  std::promise<void> all_done;
  auto strand = asio::make_strand(pool);
  std::mt19937 rng(7);
  for (std::size_t i = 0; i < n; ++i) {
    cache.async_write(
        i, data[i], data[i],
        asio::bind_executor(strand, asio::bind_cancellation_slot(signals[i].slot(), [&, i](ghostlink::error_code ec) {
                              outcome[i] = !ec ? 1 : ec == aborted ? 2 : 3;
                              if (done.fetch_add(1) + 1 == n) all_done.set_value();
                            })));
    if (rng() % 2)
      asio::post(strand, [&, i] {
        if (outcome[i] == 0) signals[i].emit(asio::cancellation_type::terminal);
      });
  }
  all_done.get_future().wait();
  pool.join();

  const kv_snapshot snap = cache.snapshot();
  std::size_t ok = 0, cancelled = 0;
  for (std::size_t i = 0; i < n; ++i) {
    INFO("token " << i << " outcome " << outcome[i].load());
    const auto got = stored(snap, i);
    REQUIRE(got.has_value());
    REQUIRE(outcome[i] != 3);
    if (outcome[i] == 1) {
      ++ok;
      CHECK(got->keys == data[i]);
    } else {
      ++cancelled;
      CHECK(got->keys == std::vector<float>(width, 0.0f));
    }
  }
  CHECK(cache.stats().requests_cancelled == cancelled);
  INFO(ok << " stored, " << cancelled << " cancelled");
  CHECK(ok + cancelled == n);
}

}  // namespace cancellation_tests
