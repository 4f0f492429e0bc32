// Completion: every async operation works with every completion token; a
// handler never runs inside the initiating call, runs on its associated
// executor (a coroutine on its own, never on the cache's strand), allocates
// with its associated allocator and keeps its executor's context busy; the
// caller's spans are copied when the write applies.

#include "support.hpp"

#include <asio/bind_allocator.hpp>
#include <asio/bind_executor.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/strand.hpp>
#include <asio/this_coro.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

using namespace ghostlink;
namespace t = ghostlink::test;

namespace {

constexpr int rounds = 20;

std::error_code err(kv_errc e) { return make_error_code(e); }

/// Inputs for the small config (8 floats a token, 16 tokens): tokens 1..3,
/// a too-short token, a batch of tokens 2..3 and one with an entry past the end.
struct tokens {
  tokens() = default;
  tokens(const tokens&) = delete;  // the batches point into this object
  std::size_t w = t::small_config().token_width();
  std::vector<float> k1 = t::token_pattern(w, 1, 1), v1 = t::token_pattern(w, 1, 2);
  std::vector<float> k2 = t::token_pattern(w, 2, 1), v2 = t::token_pattern(w, 2, 2);
  std::vector<float> k3 = t::token_pattern(w, 3, 1), v3 = t::token_pattern(w, 3, 2);
  std::vector<float> too_short = t::filled(w - 1, 9.0f);
  std::array<kv_write, 2> batch{{{2, k2, v2}, {3, k3, v3}}};
  std::array<kv_write, 2> bad_batch{{{2, k1, v1}, {16, k1, v1}}};  // 16 == max_tokens_per_seq
};

std::vector<float> concat(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const auto* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

/// A 2-thread pool and a cache on it. Nothing else keeps the pool busy, so
/// joining it waits for every pending handler.
struct fixture {
  asio::thread_pool pool{2};
  layer_kv_cache cache{pool, t::small_config()};
  tokens tk;
  ~fixture() { pool.join(); }
};

/// The calls every token is tried with: five that succeed, in this order, on
/// a fresh cache, then five that fail. With `Deferred`, each makes a deferred
/// operation and launches it with the token.
template <bool Deferred>
struct calls {
  layer_kv_cache& c;
  const tokens& tk;

  template <class Token, class Start>
  static auto launch(Token tok, Start start) {
    if constexpr (Deferred) return start(t::deferred)(std::move(tok));
    else return start(std::move(tok));
  }
#define GHOSTLINK_CALL(name, ...) \
  template <class Token>          \
  auto name(Token tok) const { return launch(std::move(tok), [&](auto k) { return c.__VA_ARGS__; }); }
  GHOSTLINK_CALL(initialize, async_initialize(4, std::move(k)))
  GHOSTLINK_CALL(write, async_write(1, tk.k1, tk.v1, std::move(k)))
  GHOSTLINK_CALL(write_batch, async_write_batch(tk.batch, std::move(k)))
  GHOSTLINK_CALL(read_kv, async_read_kv(1, std::move(k)))
  GHOSTLINK_CALL(read_range, async_read_range(1, 4, std::move(k)))
  GHOSTLINK_CALL(bad_initialize, async_initialize(0, std::move(k)))
  GHOSTLINK_CALL(bad_write, async_write(1, tk.too_short, tk.too_short, std::move(k)))
  GHOSTLINK_CALL(bad_write_batch, async_write_batch(tk.bad_batch, std::move(k)))
  GHOSTLINK_CALL(bad_read_kv, async_read_kv(4, std::move(k)))
  GHOSTLINK_CALL(bad_read_range, async_read_range(3, 1, std::move(k)))
#undef GHOSTLINK_CALL
};

/// What those calls completed with.
struct outcome {
  std::error_code initialize, write, write_batch, read_kv, read_range;
  kv_entry entry;
  kv_range range;
  std::error_code bad_initialize, bad_write, bad_write_batch, bad_read_kv, bad_read_range;
};

void check(const outcome& o, const fixture& f) {
  const tokens& tk = f.tk;
  const std::error_code ok;
  const std::tuple<const char*, std::error_code, std::error_code> codes[] = {
      {"initialize", o.initialize, ok},
      {"write", o.write, ok},
      {"write_batch", o.write_batch, ok},
      {"read_kv", o.read_kv, ok},
      {"read_range", o.read_range, ok},
      {"initialize(0)", o.bad_initialize, err(kv_errc::zero_length)},
      {"write of a short token", o.bad_write, err(kv_errc::width_mismatch)},
      {"write_batch with index 16", o.bad_write_batch, err(kv_errc::index_out_of_range)},
      {"read_kv(4)", o.bad_read_kv, err(kv_errc::index_out_of_range)},
      {"read_range(3, 1)", o.bad_read_range, err(kv_errc::invalid_range)}};
  for (const auto& [call, got, expected] : codes) {
    INFO("call: " << call);
    CHECK(got == expected);
  }
  INFO("values read back are the ones written");
  CHECK(o.entry.keys == tk.k1);
  CHECK(o.entry.values == tk.v1);
  CHECK((o.range.begin == 1 && o.range.end == 4));
  CHECK(o.range.keys == concat({&tk.k1, &tk.k2, &tk.k3}));
  CHECK(o.range.values == concat({&tk.v1, &tk.v2, &tk.v3}));
  INFO("the failed calls left the stored data alone");
  kv_range stored;
  const std::vector<float> zeros(tk.w, 0.0f);
  CHECK(f.cache.snapshot().read_range(0, 4, stored) == ok);
  CHECK(stored.keys == concat({&zeros, &tk.k1, &tk.k2, &tk.k3}));
  CHECK(f.cache.size() == 4);
}

/// The error of a call: thrown as `std::system_error` (use_awaitable,
/// use_future) or the tuple's first element (as_tuple).
template <class T>
asio::awaitable<std::error_code> code_of(asio::awaitable<T> op) {
  std::error_code ec;
  try {
    co_await std::move(op);
  } catch (const std::system_error& e) {
    ec = e.code();
  }
  co_return ec;
}

template <class... T>
asio::awaitable<std::error_code> code_of(asio::awaitable<std::tuple<std::error_code, T...>> op) {
  co_return std::get<0>(co_await std::move(op));
}

template <class T>
std::error_code code_of(std::future<T> f) {
  try {
    f.get();
  } catch (const std::system_error& e) {
    return e.code();
  }
  return {};
}

/// The value of a call that succeeded (a tuple's error is in `ec`).
template <class T>
asio::awaitable<T> value_of(asio::awaitable<T> op, std::error_code&) {
  co_return co_await std::move(op);
}

template <class T>
asio::awaitable<T> value_of(asio::awaitable<std::tuple<std::error_code, T>> op, std::error_code& ec) {
  auto [e, value] = co_await std::move(op);
  ec = e;
  co_return std::move(value);
}

/// Every call, co_awaited: `tok` is use_awaitable or as_tuple(use_awaitable);
/// with `Deferred`, each deferred operation is launched with `tok`.
template <bool Deferred, class Token>
asio::awaitable<outcome> with_awaitable(calls<Deferred> k, Token tok) {
  outcome o;
  o.initialize = co_await code_of(k.initialize(tok));
  o.write = co_await code_of(k.write(tok));
  o.write_batch = co_await code_of(k.write_batch(tok));
  o.entry = co_await value_of(k.read_kv(tok), o.read_kv);
  o.range = co_await value_of(k.read_range(tok), o.read_range);
  o.bad_initialize = co_await code_of(k.bad_initialize(tok));
  o.bad_write = co_await code_of(k.bad_write(tok));
  o.bad_write_batch = co_await code_of(k.bad_write_batch(tok));
  o.bad_read_kv = co_await code_of(k.bad_read_kv(tok));
  o.bad_read_range = co_await code_of(k.bad_read_range(tok));
  co_return o;
}

template <bool Deferred = false, class Token>
outcome awaited(fixture& f, Token tok) {
  return t::run(f.pool.get_executor(), with_awaitable(calls<Deferred>{f.cache, f.tk}, tok));
}

/// Starts a call with a plain callback lambda, waits for it and returns the
/// callback's arguments.
template <class... T, class Start>
std::tuple<std::error_code, T...> wait_callback(Start start) {
  auto p = std::make_shared<std::promise<std::tuple<std::error_code, T...>>>();
  auto result = p->get_future();
  start([p](std::error_code ec, T... v) { p->set_value({ec, std::move(v)...}); });
  return result.get();
}

/// Every call with a plain callback (with `Deferred`: the deferred operation
/// is launched with it).
template <bool Deferred>
outcome with_callbacks(calls<Deferred> k) {
  outcome o;
  std::tie(o.initialize) = wait_callback([&](auto h) { k.initialize(h); });
  std::tie(o.write) = wait_callback([&](auto h) { k.write(h); });
  std::tie(o.write_batch) = wait_callback([&](auto h) { k.write_batch(h); });
  std::tie(o.read_kv, o.entry) = wait_callback<kv_entry>([&](auto h) { k.read_kv(h); });
  std::tie(o.read_range, o.range) = wait_callback<kv_range>([&](auto h) { k.read_range(h); });
  std::tie(o.bad_initialize) = wait_callback([&](auto h) { k.bad_initialize(h); });
  std::tie(o.bad_write) = wait_callback([&](auto h) { k.bad_write(h); });
  std::tie(o.bad_write_batch) = wait_callback([&](auto h) { k.bad_write_batch(h); });
  std::tie(o.bad_read_kv, std::ignore) = wait_callback<kv_entry>([&](auto h) { k.bad_read_kv(h); });
  std::tie(o.bad_read_range, std::ignore) = wait_callback<kv_range>([&](auto h) { k.bad_read_range(h); });
  return o;
}

/// One call of the "never inline" check.
struct probe {
  std::string op;
  std::error_code expected, ec;
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
  auto start = [&](const char* op, std::error_code expected, auto call) {
    probe& p = ps.emplace_back(probe{op, expected, {}, 0, false});
    call(bind([&p](std::error_code ec, auto&&...) {
      p.ec = ec;
      ++p.runs;
    }));
    p.ran_inside = p.runs != 0;
  };
  start("initialize(4)", {}, [&](auto h) { c.async_initialize(4, h); });
  start("initialize(0)", err(kv_errc::zero_length), [&](auto h) { c.async_initialize(0, h); });
  start("write", {}, [&](auto h) { c.async_write(1, tk.k1, tk.v1, h); });
  start("short write", err(kv_errc::width_mismatch),
        [&](auto h) { c.async_write(1, tk.too_short, tk.too_short, h); });
  start("write_batch", {}, [&](auto h) { c.async_write_batch(tk.batch, h); });
  start("bad write_batch", err(kv_errc::index_out_of_range),
        [&](auto h) { c.async_write_batch(tk.bad_batch, h); });
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
  std::error_code ec;
  std::thread::id thread;
  bool on_cache_strand = false, on_target = false;
};

/// A callback (either completion signature) that records where it ran.
template <class Target>
auto recorder(where& w, const layer_kv_cache& c, Target target) {
  return [&w, &c, target](std::error_code ec, auto&&...) {
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

struct alloc_counts {
  std::atomic<int> allocations{0}, deallocations{0};
};

template <class T>
struct counting_allocator {
  using value_type = T;
  alloc_counts* counts;
  explicit counting_allocator(alloc_counts& c) noexcept : counts(&c) {}
  template <class U>
  counting_allocator(const counting_allocator<U>& o) noexcept : counts(o.counts) {}
  T* allocate(std::size_t n) {
    ++counts->allocations;
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    ++counts->deallocations;
    std::allocator<T>().deallocate(p, n);
  }
  template <class U>
  bool operator==(const counting_allocator<U>& o) const noexcept { return counts == o.counts; }
};

}  // namespace

TEST_CASE("every operation completes through asio::use_awaitable; errors throw system_error",
          "[completion]") {
  fixture f;
  const auto tok = asio::use_awaitable;
  static_assert(std::is_same_v<decltype(f.cache.async_initialize(1, tok)), asio::awaitable<void>>);
  static_assert(std::is_same_v<decltype(f.cache.async_read_kv(0, tok)), asio::awaitable<kv_entry>>);
  INFO("token: asio::use_awaitable");
  check(awaited(f, tok), f);
}

TEST_CASE("every operation completes through deferred, co_awaited and launched with a callback",
          "[completion]") {
  fixture f;
  SECTION("co_await") {
    // Asio 1.22 cannot co_await a deferred operation itself: launch it with use_awaitable.
    INFO("token: deferred, then co_await op(asio::use_awaitable)");
    check(awaited<true>(f, asio::use_awaitable), f);
  }
  SECTION("callback") {
    INFO("token: deferred, then op(callback)");
    check(with_callbacks(calls<true>{f.cache, f.tk}), f);
  }
}

TEST_CASE("every operation completes through asio::use_future; errors throw system_error from get()",
          "[completion]") {
  fixture f;
  calls<false> k{f.cache, f.tk};
  const auto tok = asio::use_future;
  static_assert(std::is_same_v<decltype(k.write(tok)), std::future<void>>);
  static_assert(std::is_same_v<decltype(k.read_kv(tok)), std::future<kv_entry>>);
  static_assert(std::is_same_v<decltype(k.read_range(tok)), std::future<kv_range>>);
  INFO("token: asio::use_future");
  outcome o;
  o.initialize = code_of(k.initialize(tok));
  o.write = code_of(k.write(tok));
  o.write_batch = code_of(k.write_batch(tok));
  o.entry = k.read_kv(tok).get();
  o.range = k.read_range(tok).get();
  o.bad_initialize = code_of(k.bad_initialize(tok));
  o.bad_write = code_of(k.bad_write(tok));
  o.bad_write_batch = code_of(k.bad_write_batch(tok));
  o.bad_read_kv = code_of(k.bad_read_kv(tok));
  o.bad_read_range = code_of(k.bad_read_range(tok));
  check(o, f);
}

TEST_CASE("every operation completes through as_tuple(asio::use_awaitable)", "[completion]") {
  fixture f;
  const auto tok = t::as_tuple(asio::use_awaitable);
  using std::error_code, std::tuple;
  static_assert(std::is_same_v<decltype(f.cache.async_initialize(1, tok)), asio::awaitable<tuple<error_code>>>);
  static_assert(
      std::is_same_v<decltype(f.cache.async_read_kv(0, tok)), asio::awaitable<tuple<error_code, kv_entry>>>);
  INFO("token: as_tuple(asio::use_awaitable)");
  check(awaited(f, tok), f);
}

TEST_CASE("every operation completes through a plain callback", "[completion]") {
  fixture f;
  INFO("token: a lambda");
  check(with_callbacks(calls<false>{f.cache, f.tk}), f);
}

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
    REQUIRE(code_of(cache.async_initialize(4, asio::use_future)) == std::error_code{});
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
  std::error_code prepared = err(kv_errc::not_initialized);
  cache.async_initialize(4, [&](std::error_code ec) { prepared = ec; });
  io.run();
  REQUIRE(prepared == std::error_code{});
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
  REQUIRE(seen.size() == 5 * rounds);
  for (std::size_t i = 0; i < seen.size(); ++i) {
    INFO("resume " << i << ", after " << seen[i].after);
    CHECK_FALSE(seen[i].on_cache_strand);
    CHECK(seen[i].on_own_executor);
  }
}

TEST_CASE("a callback without an associated executor runs on the executor the cache was made from",
          "[completion]") {
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
  auto bound = [&](where& into) {
    return asio::bind_executor(other, recorder(into, f.cache, other.get_executor()));
  };
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
  std::vector<std::error_code> results;
  auto h = asio::bind_allocator(counting_allocator<void>(counts), [&](auto ec) { results.push_back(ec); });
  cache.async_initialize(4, h);
  cache.async_write(1, tk.k1, tk.v1, h);
  cache.async_write_batch(tk.batch, h);
  const int allocated_by_calls = counts.allocations.load();
  io.run();
  CAPTURE(allocated_by_calls, counts.allocations.load(), counts.deallocations.load());
  CHECK(results == std::vector<std::error_code>(3));
  CHECK(allocated_by_calls >= 3);  // at least one request per call
  CHECK(counts.allocations.load() == counts.deallocations.load());
}

TEST_CASE("a pending cache write keeps io.run() from returning before its handler ran", "[completion]") {
  asio::io_context io;  // its only work: the handler of the pending write
  fixture f;            // the cache runs on the pool
  REQUIRE(code_of(f.cache.async_initialize(4, asio::use_future)) == std::error_code{});
  int ran = 0;
  std::error_code ec = err(kv_errc::not_initialized);
  for (int round = 0; round < rounds; ++round) {
    CAPTURE(round);
    f.cache.async_write(1, f.tk.k1, f.tk.v1, asio::bind_executor(io, [&](std::error_code e) {
                          ec = e;
                          ++ran;
                        }));
    io.run();
    io.restart();
    CHECK(ran == round + 1);
    CHECK(ec == std::error_code{});
  }
}

TEST_CASE("a write copies the caller's spans: changing them after completion changes nothing", "[completion]") {
  fixture f;
  const std::vector<float> k = t::token_pattern(f.tk.w, 5, 1), v = t::token_pattern(f.tk.w, 5, 2);
  {
    std::vector<float> keys = k, values = v;
    const std::array<kv_write, 1> batch{{{3, keys, values}}};
    REQUIRE(code_of(f.cache.async_initialize(4, asio::use_future)) == std::error_code{});
    REQUIRE(code_of(f.cache.async_write(2, keys, values, asio::use_future)) == std::error_code{});
    REQUIRE(code_of(f.cache.async_write_batch(batch, asio::use_future)) == std::error_code{});
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
