// decode_step: L layers x B sequences; each step appends one token to every
// layer of every sequence and then runs that layer's attention over all of
// its tokens. ghostlink: one coroutine per sequence on a T-thread pool,
// co_await per append, attention from snapshot blocks. rwlock / mutex: the
// seed's synchronous API driven directly from one thread (copying reads);
// "rwlock_T_threads" runs the same with the sequences split over T threads.
// strand_only: coroutines as ghostlink, reads copied through the strand.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <future>
#include <memory>
#include <thread>

#include "../baselines/locked_cache.hpp"
#include "../baselines/strand_cache.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

kv_cache_config decode_config(const options& o) {
  kv_cache_config c = o.config();
  c.max_tokens_per_seq = o.steps;
  return c;
}

/// Laps of `o.steps` steps over fresh caches until o.seconds; steps per
/// second of decoding time (cache creation excluded).
template <class Lap>
double steps_per_second(const options& o, Lap lap) {
  double decoding = 0;
  std::size_t steps = 0;
  while (decoding < o.seconds) {
    decoding += lap();
    steps += o.steps;
  }
  return double(steps) / decoding;
}

asio::awaitable<void> decode_ghostlink(const options& o, std::vector<layer_kv_cache>& layers,
                                       const std::vector<token>& data) {
  for (std::size_t step = 0; step < o.steps; ++step)
    for (auto& cache : layers) {
      co_await cache.async_write(step, data[step].keys, data[step].values, asio::use_awaitable);
      attention a(o.heads, o.head_dim);
      cache.snapshot().for_each_block(0, step + 1, [&](std::size_t, std::size_t n, auto k, auto v) { a.add(n, k, v); });
      keep(a.checksum());
    }
}

asio::awaitable<void> decode_strand(const options& o, std::vector<std::unique_ptr<strand_cache>>& layers,
                                    const std::vector<token>& data) {
  kv_range r;
  for (std::size_t step = 0; step < o.steps; ++step)
    for (auto& cache : layers) {
      co_await cache->async_write(step, data[step].keys, data[step].values, asio::use_awaitable);
      co_await cache->async_read_range(0, step + 1, r, asio::use_awaitable);
      attention a(o.heads, o.head_dim);
      a.add(step + 1, r.keys, r.values);
      keep(a.checksum());
    }
}

template <class Cache>
double run_actor(const options& o, const std::vector<token>& data) {
  asio::thread_pool pool(o.threads);
  return steps_per_second(o, [&] {
    std::vector<std::vector<Cache>> seqs(o.sequences);
    std::vector<std::vector<std::unique_ptr<strand_cache>>> strand_seqs(o.sequences);
    std::vector<std::future<void>> init;
    for (std::size_t s = 0; s < o.sequences; ++s)
      for (std::size_t l = 0; l < o.layers; ++l) {
        if constexpr (std::is_same_v<Cache, layer_kv_cache>) {
          seqs[s].emplace_back(pool, decode_config(o));
          init.push_back(seqs[s].back().async_initialize(1, asio::use_future));
        } else {
          strand_seqs[s].push_back(std::make_unique<strand_cache>(pool.get_executor(), decode_config(o)));
          init.push_back(strand_seqs[s].back()->async_initialize(1, asio::use_future));
        }
      }
    for (auto& f : init) f.get();
    const auto t0 = clock_type::now();
    std::vector<std::future<void>> running;
    for (std::size_t s = 0; s < o.sequences; ++s) {
      if constexpr (std::is_same_v<Cache, layer_kv_cache>)
        running.push_back(asio::co_spawn(pool, decode_ghostlink(o, seqs[s], data), asio::use_future));
      else
        running.push_back(asio::co_spawn(pool, decode_strand(o, strand_seqs[s], data), asio::use_future));
    }
    for (auto& f : running) f.get();
    return seconds_since(t0);
  });
}

/// The seed's API called directly; sequences split over `threads` threads.
template <class Cache>
double run_direct(const options& o, const std::vector<token>& data, std::size_t threads) {
  return steps_per_second(o, [&] {
    std::vector<std::vector<std::unique_ptr<Cache>>> seqs(o.sequences);
    for (auto& layers : seqs)
      for (std::size_t l = 0; l < o.layers; ++l) {
        layers.push_back(std::make_unique<Cache>(decode_config(o)));
        layers.back()->initialize(1);
      }
    auto decode = [&](std::size_t first_seq) {
      kv_range r;
      for (std::size_t step = 0; step < o.steps; ++step)
        for (std::size_t s = first_seq; s < o.sequences; s += threads)
          for (auto& cache : seqs[s]) {
            cache->write(step, data[step].keys, data[step].values);
            cache->read_range(0, step + 1, r);
            attention a(o.heads, o.head_dim);
            a.add(step + 1, r.keys, r.values);
            keep(a.checksum());
          }
    };
    const auto t0 = clock_type::now();
    std::vector<std::thread> workers;
    for (std::size_t t = 1; t < threads; ++t) workers.emplace_back(decode, t);
    decode(0);
    for (auto& w : workers) w.join();
    return seconds_since(t0);
  });
}

}  // namespace

void decode_step(const options& o, report& out) {
  std::vector<token> data;
  for (std::size_t i = 0; i < o.steps; ++i) data.emplace_back(o.config().token_width(), i);
  out.run("decode_step", o, [&](std::map<std::string, metric>& m) {
    metric& rate = m["steps"];
    rate.name = "decode steps (all layers, all seqs)";
    rate.unit = "steps/s";
    if (o.wants("ghostlink")) rate.values["ghostlink"] = run_actor<layer_kv_cache>(o, data);
    if (o.wants("rwlock")) {
      rate.values["rwlock"] = run_direct<rwlock_cache>(o, data, 1);
      rate.values["rwlock_" + std::to_string(o.threads) + "_threads"] = run_direct<rwlock_cache>(o, data, o.threads);
    }
    if (o.wants("mutex")) rate.values["mutex"] = run_direct<mutex_cache>(o, data, 1);
    if (o.wants("strand_only")) rate.values["strand_only"] = run_actor<strand_cache>(o, data);
  });
  out.add_note("decode_step", std::to_string(o.layers) + " layers x " + std::to_string(o.sequences) +
                                  " sequences, contexts growing 1.." + std::to_string(o.steps) +
                                  " tokens per lap; cache creation not timed");
}

}  // namespace ghostlink::bench
