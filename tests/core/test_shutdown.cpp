// Shutdown with work in flight: the last handle dropped, the io_context
// stopped, the execution context destroyed. Nothing crashes, leaks or
// hangs (ASan/LSan in CI; the teardown check counts block pools), and each
// pending handler is either run or destroyed unrun, as Asio destroys the
// handlers of a destroyed context:
// - last handle dropped: queued writes still apply and complete normally
//   (the queued drain holds the actor);
// - io_context stopped: handlers wait; run() again completes them;
// - context destroyed: every pending handler is destroyed unrun.
#include "common/support.hpp"

#include "common/asio_compat.hpp"

#include <atomic>
#include <memory>

namespace shutdown_tests {

using namespace ghostlink;
using ghostlink::test::small_config;
using ghostlink::test::token_pattern;

namespace {

/// Counts how its handlers end: `ran` calls (and with which errors), and
/// `alive` shared references, one per handler not yet destroyed.
struct probe {
  std::shared_ptr<int> alive = std::make_shared<int>(0);
  std::atomic<int> ran{0}, failed{0};

  auto handler() {
    return [this, token = alive](ghostlink::error_code ec, auto&&...) {
      ++ran;
      if (ec) ++failed;
    };
  }
  long pending_handlers() const { return alive.use_count() - 1; }
};

constexpr int writes = 20;

}  // namespace

TEST_CASE("dropping the last handle with writes queued still applies and completes them", "[shutdown]") {
  asio::io_context io;
  probe p;
  const auto v = token_pattern(small_config().token_width(), 0, 1);
  {
    layer_kv_cache cache(io, small_config());
    cache.async_initialize(1, p.handler());
    for (int i = 0; i < writes; ++i) cache.async_write(i % 8, v, v, p.handler());
  }  // the last handle is gone; the requests and the queued drain are not
  io.run();
  CHECK(p.ran == writes + 1);
  CHECK(p.failed == 0);
  CHECK(p.pending_handlers() == 0);
}

TEST_CASE("stopping the io_context leaves pending writes waiting; running it again completes them", "[shutdown]") {
  asio::io_context io;
  probe p;
  layer_kv_cache cache(io, small_config());
  const auto v = token_pattern(small_config().token_width(), 0, 1);
  cache.async_initialize(1, p.handler());
  for (int i = 0; i < writes; ++i) cache.async_write(i % 8, v, v, p.handler());
  io.stop();
  io.run();  // returns at once: stopped
  CHECK(p.ran == 0);
  CHECK(cache.size() == 0);
  io.restart();
  io.run();
  CHECK(p.ran == writes + 1);
  CHECK(p.failed == 0);
  CHECK(cache.size() == 8);
}

TEST_CASE("destroying a stopped io_context destroys every pending handler unrun and frees the caches", "[shutdown]") {
  probe p;
  {
    asio::io_context io;
    layer_kv_cache cache(io, small_config());
    sequence_kv_cache seq(io, 3, small_config());
    const auto v = token_pattern(small_config().token_width(), 0, 1);
    const std::vector<std::span<const float>> per_layer(3, std::span<const float>(v));
    cache.async_initialize(1, p.handler());
    for (int i = 0; i < writes; ++i) cache.async_write(i % 8, v, v, p.handler());
    cache.async_fork(p.handler());
    cache.async_truncate(2, p.handler());
    seq.async_append(per_layer, per_layer, p.handler());
    io.stop();
    io.run();
    CHECK(p.pending_handlers() == writes + 4);
  }  // every handle, then the context, destroyed with all of it pending
  CHECK(p.ran == 0);
  CHECK(p.pending_handlers() == 0);
}

TEST_CASE("destroying a thread_pool with writes in flight neither hangs nor leaks", "[shutdown]") {
  probe p;
  const auto v = token_pattern(small_config().token_width(), 0, 1);  // outlives the pool: writes read it
  {
    asio::thread_pool threads(2);
    layer_kv_cache cache(threads, small_config());
    cache.async_initialize(1, p.handler());
    for (int i = 0; i < writes; ++i) cache.async_write(i % 8, v, v, p.handler());
    threads.stop();
  }  // some handlers ran, the rest are destroyed with the pool
  CHECK(p.ran <= writes + 1);
  CHECK(p.failed == 0);
  CHECK(p.pending_handlers() == 0);
}

}  // namespace shutdown_tests
