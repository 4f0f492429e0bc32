// decode_step: L layers x B sequences, each prefilled with S tokens
// (untimed), then S decode steps (contexts S..2S). A step writes one token
// to every layer of every sequence and runs each layer's attention over all
// of that layer's tokens. Two ways to write a step:
// - layer by layer: per layer, write its token, then attend (ghostlink: one
//   co_await per layer cache);
// - one append per step: every layer's token at once, then attend every
//   layer (ghostlink: one sequence_kv_cache::async_append per step);
// - through a step (decode_layer_order, a forward pass): per layer, write
//   its token, then attend over it (ghostlink: one sequence step per decode
//   step: one begin request, write() and snapshot(l) per layer on the
//   coroutine's thread, one commit request; the lock designs as layer by
//   layer);
// - with pending tokens (decode_pending): through a step, but per layer
//   the attention runs over the layer's tokens before the step with the
//   new token pending (ghostlink::attend over snapshot_before(l)).
// ghostlink: one coroutine per sequence on a T-thread pool, attention from
// snapshot blocks, every cache on one block pool preallocated before the
// clock starts (as the lock designs allocate their buffers). Every lock baseline is driven from T threads (the
// sequences split over them): rwlock_zero_copy attends straight from the
// buffer under the shared lock; rwlock and mutex copy the range out (the
// seed's read_range). strand_only: coroutines as ghostlink, reads copied
// through the strand. --element picks the storage type (the lock designs
// store the same type).
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <future>
#include <memory>
#include <string>
#include <thread>

#include "../arena.hpp"
#include "../baselines/locked_cache.hpp"
#include "../baselines/strand_cache.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

enum class shape { layer_by_layer, append_per_step, through_step, pending };

kv_cache_config decode_config(const options& o) {
  kv_cache_config c = o.config();
  c.max_tokens_per_seq = 2 * o.steps;
  return c;
}

/// Laps (fresh caches, prefilled, then o.steps timed steps) until
/// o.seconds of decoding; steps per second of decoding time.
template <class Lap>
double steps_per_second(const options& o, Lap lap) {
  return double(o.steps) * laps_per_second(o.seconds, lap);
}

template <storage_element T>
void attend(const options& o, const basic_kv_snapshot<T>& snap) {
  attention a(o.heads, o.head_dim);
  a.over(snap);
  keep(a.checksum());
}

template <storage_element T>
asio::awaitable<void> layer_by_layer(const options& o, std::vector<basic_layer_kv_cache<T>>& layers,
                                     const std::vector<token>& data) {
  for (std::size_t step = o.steps; step < 2 * o.steps; ++step)
    for (auto& cache : layers) {
      co_await cache.async_write(step, data[step].keys, data[step].values, asio::use_awaitable);
      attend(o, cache.snapshot());
    }
}

/// Appends tokens [first, end) to `seq`, one append per token; attends
/// after each when `decode`.
template <storage_element T>
asio::awaitable<void> append_per_step(const options& o, basic_sequence_kv_cache<T>& seq, const std::vector<token>& data,
                                      std::size_t first, std::size_t end, bool decode) {
  std::vector<std::span<const float>> keys(o.layers), values(o.layers);
  for (std::size_t step = first; step < end; ++step) {
    for (std::size_t l = 0; l < o.layers; ++l) {
      keys[l] = data[step].keys;
      values[l] = data[step].values;
    }
    co_await seq.async_append(keys, values, asio::use_awaitable);
    if (!decode) continue;
    const auto snap = seq.snapshot();
    for (std::size_t l = 0; l < o.layers; ++l) attend(o, snap.layer(l));
  }
}

/// Decode steps [o.steps, 2 * o.steps) of `seq` through sequence steps:
/// each layer's token written, then attended with the step's snapshot.
template <storage_element T>
asio::awaitable<void> step_by_step(const options& o, basic_sequence_kv_cache<T>& seq, const std::vector<token>& data) {
  for (std::size_t step = o.steps; step < 2 * o.steps; ++step) {
    const auto open = co_await seq.async_begin_step(1, asio::use_awaitable);
    for (std::size_t l = 0; l < o.layers; ++l) {
      keep(float(open.write(l, data[step].keys, data[step].values).value()));
      attend(o, open.snapshot(l));
    }
    co_await open.async_commit(asio::use_awaitable);
  }
}

/// As step_by_step, attending with each layer's token pending.
template <storage_element T>
asio::awaitable<void> step_pending(const options& o, basic_sequence_kv_cache<T>& seq, const std::vector<token>& data) {
  attention a(o.heads, o.head_dim);
  for (std::size_t step = o.steps; step < 2 * o.steps; ++step) {
    const auto open = co_await seq.async_begin_step(1, asio::use_awaitable);
    for (std::size_t l = 0; l < o.layers; ++l) {
      keep(float(open.write(l, data[step].keys, data[step].values).value()));
      a.over(open.snapshot_before(l), {data[step].keys, data[step].values});
      keep(a.checksum());
    }
    co_await open.async_commit(asio::use_awaitable);
  }
}

template <storage_element T>
double run_ghostlink(const options& o, const std::vector<token>& data, shape how) {
  asio::thread_pool pool(o.threads);
  const std::vector<kv_write> batch = writes_of(data, 0, o.steps);
  // One pool for every cache, its memory written before the clock starts,
  // as the lock designs allocate each buffer at its longest: each lap's
  // caches take their blocks from it, with no page fault while they decode.
  kv_block_pool blocks = kv_block_pool::for_caches<T>(decode_config(o));
  blocks.preallocate(preallocated_blocks(decode_config(o), o.sequences * o.layers, blocks.blocks_per_extent()));
  return steps_per_second(o, [&] {
    std::vector<std::vector<basic_layer_kv_cache<T>>> layered(o.sequences);
    std::vector<basic_sequence_kv_cache<T>> seqs;
    std::vector<std::future<void>> ready;
    for (std::size_t s = 0; s < o.sequences; ++s) {
      if (how == shape::layer_by_layer) {
        for (std::size_t l = 0; l < o.layers; ++l) {
          layered[s].emplace_back(pool, decode_config(o), blocks);
          layered[s].back().async_initialize(1, asio::use_future).get();
          ready.push_back(layered[s].back().async_write_batch(batch, asio::use_future));
        }
      } else {
        seqs.reserve(o.sequences);
        seqs.emplace_back(pool, o.layers, decode_config(o), blocks);
        ready.push_back(
            asio::co_spawn(pool, append_per_step(o, seqs.back(), data, 0, o.steps, false), asio::use_future));
      }
    }
    for (auto& f : ready) f.get();
    const auto t0 = clock_type::now();
    std::vector<std::future<void>> running;
    for (std::size_t s = 0; s < o.sequences; ++s) {
      if (how == shape::layer_by_layer)
        running.push_back(asio::co_spawn(pool, layer_by_layer(o, layered[s], data), asio::use_future));
      else if (how == shape::through_step)
        running.push_back(asio::co_spawn(pool, step_by_step(o, seqs[s], data), asio::use_future));
      else if (how == shape::pending)
        running.push_back(asio::co_spawn(pool, step_pending(o, seqs[s], data), asio::use_future));
      else
        running.push_back(
            asio::co_spawn(pool, append_per_step(o, seqs[s], data, o.steps, 2 * o.steps, true), asio::use_future));
    }
    for (auto& f : running) f.get();
    return seconds_since(t0);
  });
}

asio::awaitable<void> strand_decode(const options& o, std::vector<std::unique_ptr<strand_cache>>& layers,
                                    const std::vector<token>& data) {
  kv_range r;
  for (std::size_t step = o.steps; step < 2 * o.steps; ++step)
    for (auto& cache : layers) {
      co_await cache->async_write(step, data[step].keys, data[step].values, asio::use_awaitable);
      co_await cache->async_read_range(0, step + 1, r, asio::use_awaitable);
      attention a(o.heads, o.head_dim);
      a.over(r.keys, r.values);
      keep(a.checksum());
    }
}

double run_strand(const options& o, const std::vector<token>& data) {
  asio::thread_pool pool(o.threads);
  return steps_per_second(o, [&] {
    std::vector<std::vector<std::unique_ptr<strand_cache>>> seqs(o.sequences);
    for (auto& layers : seqs)
      for (std::size_t l = 0; l < o.layers; ++l) {
        layers.push_back(std::make_unique<strand_cache>(pool.get_executor(), decode_config(o)));
        layers.back()->async_initialize(1, asio::use_future).get();
        for (std::size_t i = 0; i < o.steps; ++i)
          layers.back()->async_write(i, data[i].keys, data[i].values, asio::use_future).get();
      }
    const auto t0 = clock_type::now();
    std::vector<std::future<void>> running;
    running.reserve(seqs.size());
    for (auto& layers : seqs) running.push_back(asio::co_spawn(pool, strand_decode(o, layers, data), asio::use_future));
    for (auto& f : running) f.get();
    return seconds_since(t0);
  });
}

/// Attention over [0, n) of a lock design: zero-copy from the buffer, or
/// through a copy (float storage only, as the seed's read_range).
template <class Cache>
void attend_locked(const options& o, const Cache& cache, std::size_t n, bool zero_copy, kv_range& r) {
  attention a(o.heads, o.head_dim);
  if (zero_copy) {
    cache.visit_range(0, n, [&](auto k, auto v) { a.over(k, v); });
  } else {
    if constexpr (requires { cache.read_range(0, n, r); }) {
      cache.read_range(0, n, r);
      a.over(r.keys, r.values);
    }
  }
  keep(a.checksum());
}

/// A lock design called directly; sequences split over o.threads threads.
template <class Cache>
double run_locked(const options& o, const std::vector<token>& data, shape how, bool zero_copy) {
  return steps_per_second(o, [&] {
    std::vector<std::vector<std::unique_ptr<Cache>>> seqs(o.sequences);
    for (auto& layers : seqs)
      for (std::size_t l = 0; l < o.layers; ++l) {
        layers.push_back(std::make_unique<Cache>(decode_config(o)));
        layers.back()->initialize(1);
        for (std::size_t i = 0; i < o.steps; ++i) layers.back()->write(i, data[i].keys, data[i].values);
      }
    auto decode = [&](std::size_t first_seq) {
      kv_range r;
      for (std::size_t step = o.steps; step < 2 * o.steps; ++step)
        for (std::size_t s = first_seq; s < o.sequences; s += o.threads) {
          if (how != shape::append_per_step) {
            for (auto& cache : seqs[s]) {
              cache->write(step, data[step].keys, data[step].values);
              attend_locked(o, *cache, step + 1, zero_copy, r);
            }
          } else {
            for (auto& cache : seqs[s]) cache->write(step, data[step].keys, data[step].values);
            for (auto& cache : seqs[s]) attend_locked(o, *cache, step + 1, zero_copy, r);
          }
        }
    };
    const auto t0 = clock_type::now();
    on_threads(o.threads, decode);
    return seconds_since(t0);
  });
}

/// "L layers x B sequences, element, contexts a..b": every decode note's start.
std::string shape_note(const options& o) {
  return std::to_string(o.layers) + " layers x " + std::to_string(o.sequences) + " sequences, " + o.element +
         ", contexts " + std::to_string(o.steps) + ".." + std::to_string(2 * o.steps);
}

template <storage_element T>
void run_all(const options& o, report& out) {
  const std::vector<token> data = tokens_for(o, 2 * o.steps);  // prefill, then decode
  out.run("decode_step", o, [&](std::map<std::string, metric>& m) {
    for (shape how : {shape::layer_by_layer, shape::append_per_step}) {
      metric& rate =
          declare(m, how == shape::layer_by_layer ? "1 layer by layer" : "2 append per step",
                  how == shape::layer_by_layer ? "decode steps, layer by layer" : "decode steps, one append per step",
                  "steps/s");
      if (o.wants("ghostlink")) rate.values["ghostlink"] = run_ghostlink<T>(o, data, how);
      using rwlock_t = locked_cache<std::shared_mutex, T>;
      if (o.wants("rwlock_zero_copy")) rate.values["rwlock_zero_copy"] = run_locked<rwlock_t>(o, data, how, true);
      if constexpr (std::is_same_v<T, float>) {
        if (how == shape::append_per_step) continue;
        if (o.wants("rwlock")) rate.values["rwlock"] = run_locked<rwlock_cache>(o, data, how, false);
        if (o.wants("mutex")) rate.values["mutex"] = run_locked<mutex_cache>(o, data, how, false);
        if (o.wants("strand_only")) rate.values["strand_only"] = run_strand(o, data);
      }
    }
  });
  out.add_note("decode_step", shape_note(o) + " tokens per lap (prefill and cache creation not " +
                                  "timed); every implementation on " + std::to_string(o.threads) + " threads");
}

template <storage_element T>
void run_layer_order(const options& o, report& out) {
  const std::vector<token> data = tokens_for(o, 2 * o.steps);  // prefill, then decode
  out.run("decode_layer_order", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "steps", "decode steps, layer by layer through a step", "steps/s");
    if (o.wants("ghostlink")) rate.values["ghostlink"] = run_ghostlink<T>(o, data, shape::through_step);
    using rwlock_t = locked_cache<std::shared_mutex, T>;
    if (o.wants("rwlock_zero_copy"))
      rate.values["rwlock_zero_copy"] = run_locked<rwlock_t>(o, data, shape::through_step, true);
  });
  out.add_note("decode_layer_order", shape_note(o) +
                                         "; ghostlink: begin, per layer write() then attend over step.snapshot(l), "
                                         "commit; rwlock_zero_copy: per layer write then attend under the shared lock");
}

template <storage_element T>
void run_pending(const options& o, report& out) {
  const std::vector<token> data = tokens_for(o, 2 * o.steps);  // prefill, then decode
  out.run("decode_pending", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "1 steps", "decode steps", "steps/s");
    metric& tpot = declare(m, "2 tpot", "time per output token (mean)", "us", false);
    const auto add = [&](const char* name, double steps_per_s) {
      rate.values[name] = steps_per_s;
      tpot.values[name] = 1e6 / steps_per_s;  // each sequence makes one token per step
    };
    if (o.wants("ghostlink")) {
      add("ghostlink", run_ghostlink<T>(o, data, shape::pending));
      add("await_each_layer", run_ghostlink<T>(o, data, shape::through_step));
    }
    using rwlock_t = locked_cache<std::shared_mutex, T>;
    if (o.wants("rwlock_zero_copy")) add("rwlock_zero_copy", run_locked<rwlock_t>(o, data, shape::through_step, true));
  });
  out.add_note("decode_pending", shape_note(o) + "; ghostlink: per layer write(), attend over snapshot_before(l) with "
                                                 "the token pending; await_each_layer: decode_layer_order's ghostlink "
                                                 "(write(), then attend over snapshot(l))");
}

}  // namespace

void decode_pending(const options& o, report& out) {
  with_element(o, [&]<storage_element T>() { run_pending<T>(o, out); });
}

void decode_layer_order(const options& o, report& out) {
  with_element(o, [&]<storage_element T>() { run_layer_order<T>(o, out); });
}

void decode_step(const options& o, report& out) {
  with_element(o, [&]<storage_element T>() { run_all<T>(o, out); });
}

}  // namespace ghostlink::bench
