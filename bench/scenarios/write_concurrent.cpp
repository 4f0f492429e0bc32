// write_concurrent: C coroutines on a 2-thread pool, each appending tokens
// to its own layer cache and to one cache they all share (group commit at
// work there), one token per request and then B tokens per request (a
// prefill chunk). The locked baselines write the same tokens in the same
// requests from one thread by direct call, uncontended: the fastest a lock
// around a buffer goes.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <atomic>
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

/// Tokens each coroutine appends per lap (a multiple of `batch`), so the
/// shared cache holds them all.
std::size_t per_coroutine(const options& o, std::size_t batch) {
  return std::max<std::size_t>(1, o.tokens / o.coroutines / batch) * batch;
}

/// `batch` copies of token `t` at indices first, first + 1, ...
struct request_entries {
  std::vector<kv_write> entries;
  request_entries(const token& t, std::size_t batch) : entries(batch, kv_write{0, t.keys, t.values}) {}
  std::span<const kv_write> at(std::size_t first) {
    for (std::size_t i = 0; i < entries.size(); ++i) entries[i].index = first + i;
    return entries;
  }
};

/// Appends `count` tokens, `batch` per request, to `own` and to the end of
/// `shared` (whose next free index is `next`).
template <class Cache>
asio::awaitable<void> appender(Cache& own, Cache& shared, std::atomic<std::size_t>& next, std::size_t count,
                               std::size_t batch, const token& t) {
  request_entries mine(t, batch), theirs(t, batch);
  for (std::size_t k = 0; k < count; k += batch) {
    if (batch == 1) {
      co_await own.async_write(k, t.keys, t.values, asio::use_awaitable);
      co_await shared.async_write(next.fetch_add(1), t.keys, t.values, asio::use_awaitable);
    } else {
      co_await own.async_write_batch(mine.at(k), asio::use_awaitable);
      co_await shared.async_write_batch(theirs.at(next.fetch_add(batch)), asio::use_awaitable);
    }
  }
}

/// Laps of: fresh caches, every coroutine appends its tokens; until o.seconds.
template <class Cache>
outcome through_actor(const options& o, std::size_t batch) {
  asio::thread_pool pool(o.threads);
  const token t(o.config().token_width(), 3);
  const std::size_t per = per_coroutine(o, batch);
  std::atomic<std::size_t> next{0};
  std::size_t tokens = 0;
  double requests = 0, epochs = 0, filling = 0;
  while (filling < o.seconds) {
    Cache shared(pool.get_executor(), o.config());
    next = 0;
    std::vector<std::unique_ptr<Cache>> own;
    std::vector<std::future<void>> init;
    init.push_back(shared.async_initialize(1, asio::use_future));
    for (std::size_t c = 0; c < o.coroutines; ++c) {
      own.push_back(std::make_unique<Cache>(pool.get_executor(), o.config()));
      init.push_back(own.back()->async_initialize(1, asio::use_future));
    }
    for (auto& f : init) f.get();
    const auto t0 = clock_type::now();
    std::vector<std::future<void>> running;
    for (std::size_t c = 0; c < o.coroutines; ++c)
      running.push_back(asio::co_spawn(pool, appender(*own[c], shared, next, per, batch, t), asio::use_future));
    for (auto& f : running) f.get();
    filling += seconds_since(t0);
    tokens += 2 * o.coroutines * per;
    if constexpr (std::is_same_v<Cache, layer_kv_cache>) {
      const auto s = shared.stats();
      requests += double(s.requests_applied - 1);  // minus the initialize
      epochs += double(s.epoch - 1);
    }
  }
  return {double(tokens) / filling, epochs > 0 ? requests / epochs : 0};
}

template <class Cache>
outcome direct(const options& o, std::size_t batch) {
  const token t(o.config().token_width(), 3);
  const std::size_t per = per_coroutine(o, batch);
  request_entries mine(t, batch), theirs(t, batch);
  // The seed's design at its best: buffers allocated once and reused, so
  // each lap writes into warm, already-faulted memory.
  Cache shared(o.config());
  std::vector<std::unique_ptr<Cache>> own;
  shared.initialize(1);
  for (std::size_t c = 0; c < o.coroutines; ++c) {
    own.push_back(std::make_unique<Cache>(o.config()));
    own.back()->initialize(1);
  }
  std::size_t tokens = 0;
  double filling = 0;
  while (filling < o.seconds) {
    const auto t0 = clock_type::now();
    std::size_t next = 0;
    for (std::size_t c = 0; c < o.coroutines; ++c)
      for (std::size_t k = 0; k < per; k += batch, next += batch) {
        own[c]->write_batch(mine.at(k));
        shared.write_batch(theirs.at(next));
      }
    filling += seconds_since(t0);
    tokens += 2 * o.coroutines * per;
  }
  return {double(tokens) / filling, 0};
}

}  // namespace

void write_concurrent(const options& o, report& out) {
  out.run("write_concurrent", o, [&](std::map<std::string, metric>& m) {
    const std::size_t batches[] = {1, o.batch};
    for (std::size_t i = 0; i < 2; ++i) {
      const std::size_t batch = batches[i];
      metric& rate =
          declare(m, std::to_string(i) + "a", "tokens written, " + std::to_string(batch) + "/request", "tokens/s");
      metric& group = declare(m, std::to_string(i) + "b", "requests per epoch, shared", "requests");
      if (o.wants("ghostlink")) {
        const outcome g = through_actor<layer_kv_cache>(o, batch);
        rate.values["ghostlink"] = g.tokens_per_s;
        group.values["ghostlink"] = g.requests_per_epoch;
      }
      if (o.wants("rwlock")) rate.values["rwlock"] = direct<rwlock_cache>(o, batch).tokens_per_s;
      if (o.wants("mutex")) rate.values["mutex"] = direct<mutex_cache>(o, batch).tokens_per_s;
      if (o.wants("strand_only") && batch == 1)
        rate.values["strand_only"] = through_actor<strand_cache>(o, batch).tokens_per_s;
    }
  });
  out.add_note("write_concurrent", "ghostlink and strand_only: coroutines on the pool filling fresh caches each "
                                   "lap; rwlock and mutex: one thread, direct calls, uncontended, refilling the "
                                   "same warm buffers each lap; only the filling is timed");
}

}  // namespace ghostlink::bench
