// write_concurrent: C coroutines on a 2-thread pool, each appending tokens
// to its own layer cache and to one cache they all share (group commit at
// work there). The locked baselines write the same tokens from one thread
// by direct call, uncontended: the fastest a lock around a buffer goes.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <future>
#include <memory>

#include "../baselines/locked_cache.hpp"
#include "../baselines/strand_cache.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

struct outcome {
  double tokens_per_s = 0;
  double requests_per_epoch = 0;
};

/// Tokens each coroutine appends per lap, so the shared cache holds them all.
std::size_t per_coroutine(const options& o) { return std::max<std::size_t>(1, o.tokens / o.coroutines); }

template <class Cache>
asio::awaitable<void> appender(Cache& own, Cache& shared, std::size_t first, std::size_t count, const token& t) {
  for (std::size_t k = 0; k < count; ++k) {
    co_await own.async_write(k, t.keys, t.values, asio::use_awaitable);
    co_await shared.async_write(first + k, t.keys, t.values, asio::use_awaitable);
  }
}

/// Laps of: fresh caches, every coroutine appends its tokens; until o.seconds.
template <class Cache>
outcome through_actor(const options& o) {
  asio::thread_pool pool(o.threads);
  const token t(o.config().token_width(), 3);
  const std::size_t per = per_coroutine(o);
  std::size_t tokens = 0;
  double requests = 0, epochs = 0;
  const auto t0 = clock_type::now();
  while (seconds_since(t0) < o.seconds) {
    Cache shared(pool.get_executor(), o.config());
    std::vector<std::unique_ptr<Cache>> own;
    std::vector<std::future<void>> init;
    init.push_back(shared.async_initialize(1, asio::use_future));
    for (std::size_t c = 0; c < o.coroutines; ++c) {
      own.push_back(std::make_unique<Cache>(pool.get_executor(), o.config()));
      init.push_back(own.back()->async_initialize(1, asio::use_future));
    }
    for (auto& f : init) f.get();
    std::vector<std::future<void>> running;
    for (std::size_t c = 0; c < o.coroutines; ++c)
      running.push_back(asio::co_spawn(pool, appender(*own[c], shared, c * per, per, t), asio::use_future));
    for (auto& f : running) f.get();
    tokens += 2 * o.coroutines * per;
    if constexpr (std::is_same_v<Cache, layer_kv_cache>) {
      const auto s = shared.stats();
      requests += double(s.requests_applied - 1);  // minus the initialize
      epochs += double(s.epoch - 1);
    }
  }
  return {double(tokens) / seconds_since(t0), epochs > 0 ? requests / epochs : 0};
}

template <class Cache>
outcome direct(const options& o) {
  const token t(o.config().token_width(), 3);
  const std::size_t per = per_coroutine(o);
  Cache shared(o.config());
  std::vector<std::unique_ptr<Cache>> own;
  shared.initialize(1);
  for (std::size_t c = 0; c < o.coroutines; ++c) {
    own.push_back(std::make_unique<Cache>(o.config()));
    own.back()->initialize(1);
  }
  std::size_t tokens = 0;
  const auto t0 = clock_type::now();
  while (seconds_since(t0) < o.seconds) {
    for (std::size_t c = 0; c < o.coroutines; ++c)
      for (std::size_t k = 0; k < per; ++k) {
        own[c]->write(k, t.keys, t.values);
        shared.write(c * per + k, t.keys, t.values);
      }
    tokens += 2 * o.coroutines * per;
  }
  return {double(tokens) / seconds_since(t0), 0};
}

}  // namespace

void write_concurrent(const options& o, report& out) {
  out.run("write_concurrent", o, [&](std::map<std::string, metric>& m) {
    metric& rate = m["1"];
    rate.name = "tokens written";
    rate.unit = "tokens/s";
    metric& group = m["2"];
    group.name = "requests per epoch, shared cache";
    group.unit = "requests";
    if (o.wants("ghostlink")) {
      const outcome g = through_actor<layer_kv_cache>(o);
      rate.values["ghostlink"] = g.tokens_per_s;
      group.values["ghostlink"] = g.requests_per_epoch;
    }
    if (o.wants("rwlock")) rate.values["rwlock"] = direct<rwlock_cache>(o).tokens_per_s;
    if (o.wants("mutex")) rate.values["mutex"] = direct<mutex_cache>(o).tokens_per_s;
    if (o.wants("strand_only")) rate.values["strand_only"] = through_actor<strand_cache>(o).tokens_per_s;
  });
  out.add_note("write_concurrent", "ghostlink and strand_only: coroutines on the pool, fresh caches per lap "
                                   "(creation included); rwlock and mutex: one thread, direct calls, uncontended");
}

}  // namespace ghostlink::bench
