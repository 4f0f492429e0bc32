// Lifetimes: what frees what, and when; waiting threads are never stranded.
#include "common/support.hpp"

#include "common/asio_compat.hpp"

#include <chrono>
#include <future>
#include <memory>
#include <optional>

namespace lifetime_tests {

using namespace ghostlink;
using ghostlink::test::cache_fixture;
using ghostlink::test::filled;
using ghostlink::test::small_config;

TEST_CASE("a pool thread that blocks on its own write still sees it complete", "[lifetime]") {
  // The drain of a write started on a pool thread must not wait in that
  // thread's private queue while the thread blocks.
  cache_fixture f;
  std::promise<ghostlink::error_code> outcome;
  asio::post(f.pool, [&] {
    const auto v = filled(f.width, 1.0f);
    auto init = f.cache.async_initialize(1, asio::use_future);
    auto write = f.cache.async_write(0, v, v, asio::use_future);
    ghostlink::error_code ec;
    try {
      init.get();
      write.get();
    } catch (const ghostlink::test::async_error& e) {
      ec = e.code();
    }
    outcome.set_value(ec);
  });
  auto done = outcome.get_future();
  // A bound, not a synchronisation: a stranded drain would never complete.
  REQUIRE(done.wait_for(std::chrono::seconds(30)) == std::future_status::ready);
  CHECK_FALSE(done.get());
  CHECK(f.cache.size() == 1);
}

TEST_CASE("a cache and its context may go as soon as a write awaited on another context completes", "[lifetime]") {
  // The write is submitted from a thread of `other`; its completion resumes
  // the coroutine on `other` while that thread may still be returning from
  // the submission. Nothing it still holds may reach the cache's context,
  // which goes right after (once, under CI, a strand reference did and
  // hung the process). A race: many rounds, each a chance to lose it.
  constexpr int rounds = 200;
  asio::thread_pool other(2);
  int completed = 0;
  for (int round = 0; round < rounds; ++round) {
    asio::thread_pool pool(1);
    layer_kv_cache cache(pool, small_config());
    cache.async_initialize(1, asio::use_future).get();
    const auto v = filled(small_config().token_width(), static_cast<float>(round));
    auto write = [&]() -> asio::awaitable<void> { co_await cache.async_write(0, v, v, asio::use_awaitable); };
    asio::co_spawn(other, write(), asio::use_future).get();
    completed += cache.size() == 1 ? 1 : 0;
  }  // each round: the cache, then its context
  CHECK(completed == rounds);
}

TEST_CASE("destroying the context with requests queued frees the cache and the handlers", "[lifetime]") {
  std::weak_ptr<int> handler_state;
  bool ran = false;
  {
    asio::io_context io;
    layer_kv_cache cache(io, small_config());
    auto state = std::make_shared<int>(7);
    handler_state = state;
    // The handler owns a handle to the cache: cache -> mailbox -> handler -> cache.
    cache.async_initialize(1, [cache, state, &ran](ghostlink::error_code) { ran = true; });
  }  // io destroyed without ever running
  CHECK_FALSE(ran);
  CHECK(handler_state.expired());
}

TEST_CASE("an overwritten block is freed once no epoch can read it, while an older snapshot is pinned", "[lifetime]") {
  auto config = small_config();
  config.block_tokens = 1;
  cache_fixture f(config);
  REQUIRE_FALSE(f.sync.initialize(1));
  f.write_pattern(0, 1);
  kv_snapshot old = f.cache.snapshot();  // can read block 0 only
  f.write_pattern(1, 1);
  f.write_pattern(1, 2);  // copies block 1; the first block 1 is unreachable now
  CHECK(f.cache.stats().blocks_in_use == 2);
  old = kv_snapshot{};
  CHECK(f.cache.stats().blocks_in_use == 2);
}

TEST_CASE("every block is freed when the cache and its snapshots are gone", "[lifetime]") {
  std::optional<cache_fixture> f(std::in_place);
  REQUIRE_FALSE(f->sync.initialize(3));
  for (std::size_t t = 0; t < 9; ++t) f->write_pattern(t, 1);
  kv_snapshot survivor = f->cache.snapshot();
  const std::size_t width = f->width;
  f.reset();  // cache handle and pool gone; the snapshot still reads
  kv_entry entry;
  REQUIRE_FALSE(survivor.read_kv(8, entry));
  CHECK(entry.keys == ghostlink::test::token_pattern(width, 8, 1));
}

}  // namespace lifetime_tests
