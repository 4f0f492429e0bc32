// batched_step: a decode batch of B sequences (16 and 64) of L layers (32),
// driven by one coroutine, as a server's decode loop drives its batch. Each
// decode step begins a step on every sequence, writes every layer of every
// sequence (write(), on the coroutine's thread), and commits them. The
// begins and the commits are one batched call each
// (basic_sequence_kv_cache::async_begin_steps, basic_sequence_step::
// async_commit_all) or B co_awaits each, one after the other. Steps per
// second of the whole batch, begins, writes and commits all timed; no
// attention, so the figure is the cache's own cost. Sequences are made,
// untimed, for every lap, on one pool preallocated before the clock starts.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <string>
#include <vector>

#include "../arena.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

using step_type = sequence_kv_cache::step_type;

/// Seconds spent on the decode steps.
asio::awaitable<double> decode(const options& o, const std::vector<sequence_kv_cache>& seqs, const token& t,
                               bool batched) {
  std::vector<step_type> open(seqs.size());
  const auto t0 = clock_type::now();
  for (std::size_t step = 0; step < o.steps; ++step) {
    if (batched) {  // an error arrives as a thrown std::system_error
      open = co_await sequence_kv_cache::async_begin_steps(seqs, 1, asio::use_awaitable);
    } else {
      for (std::size_t b = 0; b < seqs.size(); ++b) open[b] = co_await seqs[b].async_begin_step(1, asio::use_awaitable);
    }
    for (std::size_t l = 0; l < o.layers; ++l)
      for (const step_type& s : open) keep(float(s.write(l, t.keys, t.values).value()));
    if (batched) {
      keep(float((co_await step_type::async_commit_all(open, asio::use_awaitable)).size()));
    } else {
      for (const step_type& s : open) co_await s.async_commit(asio::use_awaitable);
    }
  }
  co_return seconds_since(t0);
}

double run(const options& o, std::size_t batch, bool batched) {
  asio::thread_pool threads(o.threads);
  kv_cache_config config = o.config();
  config.max_tokens_per_seq = o.steps;
  const token t(config.token_width(), 1);
  // One pool for every sequence, its memory written before the clock
  // starts: the figure is the cache's cost, not the system's page faults.
  kv_block_pool blocks = kv_block_pool::for_caches<float>(config);
  blocks.preallocate(preallocated_blocks(config, batch * o.layers, blocks.blocks_per_extent()));
  const double laps = laps_per_second(o.seconds, [&] {
    std::vector<sequence_kv_cache> seqs;
    for (std::size_t b = 0; b < batch; ++b) seqs.emplace_back(threads, o.layers, config, blocks);
    return asio::co_spawn(threads, decode(o, seqs, t, batched), asio::use_future).get();
  });
  threads.join();
  return laps * double(o.steps);
}

}  // namespace

void batched_step(const options& o, report& out) {
  out.run("batched_step", o, [&](std::map<std::string, metric>& m) {
    for (std::size_t batch : {std::size_t{16}, std::size_t{64}}) {
      const std::string b = std::to_string(batch);
      metric& one = declare(m, "B=" + b + " 1 call", "B=" + b + ", one begin and one commit call per step", "steps/s");
      metric& each =
          declare(m, "B=" + b + " 2 awaits", "B=" + b + ", " + b + " begin and commit awaits per step", "steps/s");
      if (o.wants("ghostlink")) {
        one.values["ghostlink"] = run(o, batch, true);
        each.values["ghostlink"] = run(o, batch, false);
      }
    }
  });
  out.add_note("batched_step", std::to_string(o.layers) + " layers, " + std::to_string(o.steps) +
                                   " decode steps per lap from one coroutine on " + std::to_string(o.threads) +
                                   " threads; begins, writes and commits timed");
}

}  // namespace ghostlink::bench
