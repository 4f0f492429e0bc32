// write_single: one writer, sequential writes of one token each: ghostlink
// and strand_only through co_await on a one-thread io_context, the locked
// baselines by direct call. Every implementation appends tokens 0..N-1 and
// starts over: ghostlink and strand_only with a fresh cache per lap (a new
// sequence), the locked baselines overwriting their one buffer in place.
// "round robin": the same writes spread over 64 caches in turn (token i to
// cache i % 64), as a decode step writes one token to each of many layers.
// round_trip_floor: the contract's least round trip (dispatch onto a strand,
// completion queued on the coroutine's executor with tracked work) with no
// storage: the bound on any write through a strand-owned actor.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/defer.hpp>
#include <asio/detached.hpp>
#include <asio/dispatch.hpp>
#include <asio/io_context.hpp>
#include <asio/strand.hpp>
#include <asio/use_awaitable.hpp>

#include <algorithm>
#include <memory>
#include <optional>
#include <vector>

#include "../baselines/locked_cache.hpp"
#include "../baselines/strand_cache.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

struct outcome {
  double ops_per_s = 0;
  latencies lat;
};

template <class Cache>
asio::awaitable<void> write_laps(asio::io_context& io, const options& o, outcome& out) {
  const kv_cache_config config = o.config();
  const token t(config.token_width(), 1);
  std::optional<Cache> cache;
  const auto t0 = clock_type::now();
  std::size_t i = 0;
  for (; seconds_since(t0) < o.seconds; ++i) {
    if (i % o.tokens == 0) {
      cache.emplace(io.get_executor(), config);
      co_await cache->async_initialize(1, asio::use_awaitable);
    }
    const auto s = clock_type::now();
    // NOLINTNEXTLINE(bugprone-unchecked-optional-access): emplaced when i == 0
    co_await cache->async_write(i % o.tokens, t.keys, t.values, asio::use_awaitable);
    out.lat.add(s);
  }
  out.ops_per_s = double(i) / seconds_since(t0);
}

/// The round robin's caches: contexts of up to 1024 tokens, so that 64 of
/// them stay within a few hundred MiB.
kv_cache_config round_robin_config(const options& o) {
  kv_cache_config c = o.config();
  c.max_tokens_per_seq = std::min<std::size_t>(c.max_tokens_per_seq, 1024);
  return c;
}

/// Round robin over `caches` caches: each write goes to the next cache.
template <class Cache>
asio::awaitable<void> round_robin_laps(asio::io_context& io, const options& o, std::size_t caches, outcome& out) {
  const kv_cache_config config = round_robin_config(o);
  const std::size_t tokens = config.max_tokens_per_seq;
  const token t(config.token_width(), 1);
  std::vector<Cache> all;
  const auto t0 = clock_type::now();
  std::size_t i = 0;
  for (; seconds_since(t0) < o.seconds; ++i) {
    const std::size_t index = i / caches % tokens;
    if (i % (caches * tokens) == 0) {
      all.clear();
      for (std::size_t c = 0; c < caches; ++c) {
        all.emplace_back(io.get_executor(), config);
        co_await all.back().async_initialize(1, asio::use_awaitable);
      }
    }
    const auto s = clock_type::now();
    co_await all[i % caches].async_write(index, t.keys, t.values, asio::use_awaitable);
    out.lat.add(s);
  }
  out.ops_per_s = double(i) / seconds_since(t0);
}

template <class Cache>
outcome round_robin(const options& o, std::size_t caches) {
  outcome out;
  asio::io_context io;
  asio::co_spawn(io, round_robin_laps<Cache>(io, o, caches, out), asio::detached);
  io.run();
  return out;
}

template <class Cache>
outcome round_robin_direct(const options& o, std::size_t caches) {
  outcome out;
  const kv_cache_config config = round_robin_config(o);
  const token t(config.token_width(), 1);
  std::vector<std::unique_ptr<Cache>> all;
  for (std::size_t c = 0; c < caches; ++c) {
    all.push_back(std::make_unique<Cache>(config));
    all.back()->initialize(1);
  }
  out.ops_per_s = ops_per_second(o.seconds, [&](std::size_t i) {
    const auto s = clock_type::now();
    all[i % caches]->write(i / caches % config.max_tokens_per_seq, t.keys, t.values);
    out.lat.add(s);
  });
  return out;
}

template <class Cache>
outcome through_actor(const options& o) {
  outcome out;
  asio::io_context io;
  asio::co_spawn(io, write_laps<Cache>(io, o, out), asio::detached);
  io.run();
  return out;
}

/// The contract's least round trip, with no storage behind it: dispatch
/// onto a strand, then queue the completion on the handler's executor with
/// its work tracked (what every ghostlink write must do at the least).
template <class Token>
auto async_round_trip(asio::strand<asio::any_io_executor>& strand, Token&& token) {
  return asio::async_initiate<Token, void(std::error_code)>(
      [&strand](auto handler) {
        auto work = asio::prefer(asio::get_associated_executor(handler, strand.get_inner_executor()),
                                 asio::execution::outstanding_work.tracked);
        asio::dispatch(strand, [h = std::move(handler), work]() mutable {
          asio::defer(work, [h = std::move(h)]() mutable { std::move(h)(std::error_code{}); });
        });
      },
      token);
}

outcome round_trip_floor(const options& o) {
  outcome out;
  asio::io_context io;
  auto strand = asio::make_strand(asio::any_io_executor(io.get_executor()));
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        const auto t0 = clock_type::now();
        std::size_t i = 0;
        for (; seconds_since(t0) < o.seconds; ++i) {
          const auto s = clock_type::now();
          co_await async_round_trip(strand, asio::use_awaitable);
          out.lat.add(s);
        }
        out.ops_per_s = double(i) / seconds_since(t0);
      },
      asio::detached);
  io.run();
  return out;
}

template <class Cache>
outcome direct(const options& o) {
  outcome out;
  const token t(o.config().token_width(), 1);
  Cache cache(o.config());
  cache.initialize(1);
  out.ops_per_s = ops_per_second(o.seconds, [&](std::size_t i) {
    const auto s = clock_type::now();
    cache.write(i % o.tokens, t.keys, t.values);
    out.lat.add(s);
  });
  return out;
}

}  // namespace

void write_single(const options& o, report& out) {
  out.run("write_single", o, [&](std::map<std::string, metric>& m) {
    metric& ops = declare(m, "1 ops", "sequential writes", "ops/s");
    metric& p50 = declare(m, "2 p50", "write latency p50", "ns", false);
    metric& p99 = m["3 p99"];
    p99 = p50;
    p99.name = "write latency p99";
    auto record = [&](const std::string& impl, outcome r) {
      ops.values[impl] = r.ops_per_s;
      p50.values[impl] = r.lat.p(0.5);
      p99.values[impl] = r.lat.p(0.99);
    };
    if (o.wants("ghostlink")) record("ghostlink", through_actor<layer_kv_cache>(o));
    if (o.wants("rwlock")) record("rwlock", direct<rwlock_cache>(o));
    if (o.wants("mutex")) record("mutex", direct<mutex_cache>(o));
    if (o.wants("strand_only")) record("strand_only", through_actor<strand_cache>(o));
    if (o.wants("round_trip_floor")) record("round_trip_floor", round_trip_floor(o));

    constexpr std::size_t caches = 64;
    metric& rr = declare(m, "4 round robin", "sequential writes, round robin over 64 caches", "ops/s");
    metric& rr99 = m["5 round robin p99"];
    rr99 = p99;
    rr99.values.clear();
    rr99.name = "round robin write latency p99";
    auto record_rr = [&](const std::string& impl, outcome r) {
      rr.values[impl] = r.ops_per_s;
      rr99.values[impl] = r.lat.p(0.99);
    };
    if (o.wants("ghostlink")) record_rr("ghostlink", round_robin<layer_kv_cache>(o, caches));
    if (o.wants("rwlock")) record_rr("rwlock", round_robin_direct<rwlock_cache>(o, caches));
    if (o.wants("mutex")) record_rr("mutex", round_robin_direct<mutex_cache>(o, caches));
  });
  out.add_note("write_single", "ghostlink and strand_only: co_await on a one-thread io_context (a full round "
                               "trip through the actor per write); rwlock and mutex: direct calls");
}

}  // namespace ghostlink::bench
