// Where and when handlers run: never inside the initiating call, on their
// associated executor (a coroutine on its own, never on the cache's strand),
// allocating with their associated allocator, keeping their executor's
// context busy; the caller's spans are copied when the write applies.

#include "common/completion_support.hpp"

#ifdef GHOSTLINK_CATCH2_V3
#include <catch2/generators/catch_generators.hpp>
#endif

namespace completion_executors_tests {

using namespace ghostlink;
using namespace ghostlink::test::completion;
namespace t = ghostlink::test;

namespace {
struct probe {
  std::string op;
  ghostlink::error_code expected, ec;
  int runs = 0;
  bool ran_inside = false;  // the handler had run when the initiating call returned
};

/// Starts every operation once, on a cache holding 4 tokens, each with a
/// callback passed through `bind`, and notes whether the callback had run by
/// the time the call returned. Call it where no handler can run concurrently.
template <class Bind>
std::vector<probe> start_probes(layer_kv_cache& c, const tokens& tk, Bind bind) {
  std::vector<probe> ps;
  ps.reserve(10);
  auto start = [&](const char* op, ghostlink::error_code expected, auto call) {
    probe& p = ps.emplace_back(probe{op, expected, {}, 0, false});
    call(bind([&p](ghostlink::error_code ec, auto&&...) {
      p.ec = ec;
      ++p.runs;
    }));
    p.ran_inside = p.runs != 0;
  };
  start("initialize(4)", {}, [&](auto h) { c.async_initialize(4, h); });
  start("initialize(0)", err(kv_errc::zero_length), [&](auto h) { c.async_initialize(0, h); });
  start("write", {}, [&](auto h) { c.async_write(1, tk.k1, tk.v1, h); });
  start("short write", err(kv_errc::width_mismatch), [&](auto h) { c.async_write(1, tk.too_short, tk.too_short, h); });
  start("write_batch", {}, [&](auto h) { c.async_write_batch(tk.batch, h); });
  start("bad write_batch", err(kv_errc::index_out_of_range), [&](auto h) { c.async_write_batch(tk.bad_batch, h); });
  start("read_kv(0)", {}, [&](auto h) { c.async_read_kv(0, h); });
  start("read_kv(99)", err(kv_errc::index_out_of_range), [&](auto h) { c.async_read_kv(99, h); });
  start("read_range(0, 4)", {}, [&](auto h) { c.async_read_range(0, 4, h); });
  start("read_range(3, 1)", err(kv_errc::invalid_range), [&](auto h) { c.async_read_range(3, 1, h); });
  return ps;
}

void check_probes(const std::vector<probe>& ps) {
  REQUIRE(ps.size() == 10);
  for (const probe& p : ps) {
    INFO("operation: " << p.op);
    CHECK_FALSE(p.ran_inside);
    CHECK(p.runs == 1);
    CHECK(p.ec == p.expected);
  }
}

/// What a coroutine saw when it resumed after one co_await.
struct resume_point {
  const char* after;
  bool on_cache_strand, on_own_executor;
};

template <class OwnExecutor>
asio::awaitable<std::vector<resume_point>> watch_resumes(layer_kv_cache& c, const tokens& tk) {
  const auto ex = co_await asio::this_coro::executor;
  const OwnExecutor* own = ex.template target<OwnExecutor>();
  std::vector<resume_point> seen;
  auto note = [&](const char* after) {
    seen.push_back({after, c.get_executor().running_in_this_thread(), own && own->running_in_this_thread()});
  };
  for (int round = 0; round < rounds; ++round) {
    co_await c.async_initialize(4, asio::use_awaitable);
    note("async_initialize");
    co_await c.async_write(1, tk.k1, tk.v1, asio::use_awaitable);
    note("async_write");
    co_await c.async_write_batch(tk.batch, asio::use_awaitable);
    note("async_write_batch");
    co_await c.async_initialize(0, t::as_tuple(asio::use_awaitable));
    note("failed async_initialize");
    co_await c.async_read_kv(1, asio::use_awaitable);
    note("async_read_kv");
  }
  co_return seen;
}

/// Where a handler ran: its thread, on the cache's strand or not, and on the
/// executor it should run on (`target`) or not.
struct where {
  int runs = 0;
  ghostlink::error_code ec;
  std::thread::id thread;
  bool on_cache_strand = false, on_target = false;
};

/// A callback (either completion signature) that records where it ran.
template <class Target>
auto recorder(where& w, const layer_kv_cache& c, Target target) {
  return [&w, &c, target](ghostlink::error_code ec, auto&&...) {
    w = {w.runs + 1, ec, std::this_thread::get_id(), c.get_executor().running_in_this_thread(),
         target.running_in_this_thread()};
  };
}

/// Each handler ran once, on its target executor, on the cache's strand or
/// not, and on `thread` unless that is `std::thread::id()`.
void check_ran(const std::array<where, 3>& w, const char* ops, bool on_cache_strand, std::thread::id thread) {
  for (std::size_t i = 0; i < w.size(); ++i) {
    INFO("operation " << i << " of " << ops);
    CHECK(w[i].runs == 1);
    CHECK(w[i].on_target);
    CHECK(w[i].on_cache_strand == on_cache_strand);
    if (thread != std::thread::id()) CHECK(w[i].thread == thread);
  }
}

}  // namespace
TEST_CASE("a handler never runs inside the initiating call, on a thread_pool", "[completion]") {
  // The calls start on a strand that is also where their handlers run: a
  // handler that has run when its call returns ran inside the call.
  const bool cache_on_strand = GENERATE(false, true);
  INFO((cache_on_strand ? "plain callbacks, the cache made from the strand" : "callbacks bound to the strand"));
  for (int round = 0; round < rounds; ++round) {
    CAPTURE(round);
    fixture f;
    auto strand = asio::make_strand(f.pool);
    layer_kv_cache on_strand(asio::any_io_executor(strand), t::small_config());
    layer_kv_cache& cache = cache_on_strand ? on_strand : f.cache;
    REQUIRE(code_of(cache.async_initialize(4, asio::use_future)) == ghostlink::error_code{});
    std::vector<probe> ps;
    asio::post(strand, [&] {
      if (cache_on_strand)
        ps = start_probes(cache, f.tk, [](auto h) { return h; });
      else
        ps = start_probes(cache, f.tk, [&](auto h) { return asio::bind_executor(strand, std::move(h)); });
    });
    f.pool.join();
    check_probes(ps);
  }
}

TEST_CASE("a handler never runs inside the initiating call, on an io_context not yet running", "[completion]") {
  asio::io_context io;
  layer_kv_cache cache(io, t::small_config());
  tokens tk;
  ghostlink::error_code prepared = err(kv_errc::not_initialized);
  cache.async_initialize(4, [&](ghostlink::error_code ec) { prepared = ec; });
  io.run();
  REQUIRE(prepared == ghostlink::error_code{});
  io.restart();
  std::vector<probe> ps = start_probes(cache, tk, [](auto h) { return h; });
  io.run();
  check_probes(ps);
}

TEST_CASE("a coroutine resumes on its own executor, not on the cache's strand", "[completion]") {
  fixture f;
  std::vector<resume_point> seen;
  SECTION("spawned on the thread_pool") {
    seen = t::run(f.pool.get_executor(), watch_resumes<asio::thread_pool::executor_type>(f.cache, f.tk));
  }
  SECTION("spawned on its own strand") {
    auto strand = asio::make_strand(f.pool);
    seen = t::run(strand, watch_resumes<decltype(strand)>(f.cache, f.tk));
  }
  REQUIRE(seen.size() == std::size_t{5} * rounds);
  for (std::size_t i = 0; i < seen.size(); ++i) {
    INFO("resume " << i << ", after " << seen[i].after);
    CHECK_FALSE(seen[i].on_cache_strand);
    CHECK(seen[i].on_own_executor);
  }
}

TEST_CASE("a callback without an associated executor runs on the executor the cache was made from", "[completion]") {
  asio::io_context io;
  layer_kv_cache cache(io, t::small_config());
  tokens tk;
  std::array<where, 3> w;
  cache.async_initialize(4, recorder(w[0], cache, io.get_executor()));
  cache.async_write(1, tk.k1, tk.v1, recorder(w[1], cache, io.get_executor()));
  cache.async_read_kv(0, recorder(w[2], cache, io.get_executor()));
  io.run();
  check_ran(w, "initialize, write, read_kv", false, std::this_thread::get_id());
}

TEST_CASE("a handler bound to the cache's strand runs on the strand", "[completion]") {
  fixture f;
  std::array<where, 3> w;
  auto bound = [&](where& into, auto strand) {
    return asio::bind_executor(strand, recorder(into, f.cache, f.cache.get_executor()));
  };
  f.cache.async_initialize(4, bound(w[0], f.cache.get_executor()));
  f.cache.async_write(1, f.tk.k1, f.tk.v1, bound(w[1], f.cache.get_executor()));
  f.cache.async_read_range(0, 0, bound(w[2], f.cache.get_executor()));
  f.pool.join();
  check_ran(w, "initialize, write, read_range", true, std::thread::id());
}

TEST_CASE("a handler bound to another io_context runs on that io_context's thread", "[completion]") {
  asio::io_context other;
  fixture f;  // the cache runs on the pool
  std::array<where, 3> w;
  auto bound = [&](where& into) { return asio::bind_executor(other, recorder(into, f.cache, other.get_executor())); };
  f.cache.async_initialize(4, bound(w[0]));
  f.cache.async_write(1, f.tk.k1, f.tk.v1, bound(w[1]));
  f.cache.async_read_kv(99, bound(w[2]));
  other.run();  // this thread is the other io_context's
  check_ran(w, "initialize, write, failed read_kv", false, std::this_thread::get_id());
  CHECK(w[2].ec == err(kv_errc::index_out_of_range));
}

TEST_CASE("the handler's associated allocator allocates the request", "[completion]") {
  asio::io_context io;
  layer_kv_cache cache(io, t::small_config());
  tokens tk;
  alloc_counts counts;
  std::vector<ghostlink::error_code> results;
  auto h = asio::bind_allocator(counting_allocator<void>(counts), [&](auto ec) { results.push_back(ec); });
  cache.async_initialize(4, h);
  cache.async_write(1, tk.k1, tk.v1, h);
  cache.async_write_batch(tk.batch, h);
  const int allocated_by_calls = counts.allocations.load();
  io.run();
  CAPTURE(allocated_by_calls, counts.allocations.load(), counts.deallocations.load());
  CHECK(results == std::vector<ghostlink::error_code>(3));
  CHECK(allocated_by_calls >= 3);  // at least one request per call
  CHECK(counts.allocations.load() == counts.deallocations.load());
}

TEST_CASE("a pending cache write keeps io.run() from returning before its handler ran", "[completion]") {
  asio::io_context io;  // its only work: the handler of the pending write
  fixture f;            // the cache runs on the pool
  REQUIRE(code_of(f.cache.async_initialize(4, asio::use_future)) == ghostlink::error_code{});
  int ran = 0;
  ghostlink::error_code ec = err(kv_errc::not_initialized);
  for (int round = 0; round < rounds; ++round) {
    CAPTURE(round);
    f.cache.async_write(1, f.tk.k1, f.tk.v1, asio::bind_executor(io, [&](ghostlink::error_code e) {
                          ec = e;
                          ++ran;
                        }));
    io.run();
    io.restart();
    CHECK(ran == round + 1);
    CHECK(ec == ghostlink::error_code{});
  }
}

TEST_CASE("a write copies the caller's spans: changing them after completion changes nothing", "[completion]") {
  fixture f;
  const std::vector<float> k = t::token_pattern(f.tk.w, 5, 1), v = t::token_pattern(f.tk.w, 5, 2);
  {
    std::vector<float> keys = k, values = v;
    const std::array<kv_write, 1> batch{{{3, keys, values}}};
    REQUIRE(code_of(f.cache.async_initialize(4, asio::use_future)) == ghostlink::error_code{});
    REQUIRE(code_of(f.cache.async_write(2, keys, values, asio::use_future)) == ghostlink::error_code{});
    REQUIRE(code_of(f.cache.async_write_batch(batch, asio::use_future)) == ghostlink::error_code{});
    std::ranges::fill(keys, -1.0f);
    std::ranges::fill(values, -2.0f);
    kv_entry e = f.cache.async_read_kv(2, asio::use_future).get();
    INFO("token 2 after the caller's vectors were overwritten");
    CHECK(e.keys == k);
    CHECK(e.values == v);
  }
  for (std::size_t i : {2u, 3u}) {
    INFO("token " << i << " after the caller's vectors were destroyed");
    kv_entry e = f.cache.async_read_kv(i, asio::use_future).get();
    CHECK(e.keys == k);
    CHECK(e.values == v);
  }
}

}  // namespace completion_executors_tests
