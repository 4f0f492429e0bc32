// decode_speculative: L layers x B sequences, prefilled with S tokens, then
// speculative steps until a context reaches 2S. A step, on every layer:
// append the K/V of 4 draft tokens (one batch), truncate the 1-3 the target
// model rejects, and append the target model's token. No attention: the
// figure is the cost of the cache operations a rollback makes. ghostlink:
// one coroutine per sequence on a T-thread pool, one co_await per
// operation; rwlock_zero_copy: the seed's design called directly from T
// threads. Also reported: blocks ghostlink copied per step (0 when no
// snapshot pins an older epoch: the target token rewrites in place).
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <future>
#include <memory>
#include <thread>

#include "../baselines/locked_cache.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

constexpr std::size_t drafts = 4;

kv_cache_config speculative_config(const options& o) {
  kv_cache_config c = o.config();
  c.max_tokens_per_seq = 2 * o.steps;
  return c;
}

/// Tokens the target model rejects at step `step` of sequence `seq`: 1..3.
std::size_t rejected(std::size_t seq, std::size_t step) { return 1 + (seq + step) % 3; }

/// The steps of sequence `seq`: per step, the size it starts at and the
/// tokens it keeps of the drafts (the target token goes at `kept`).
struct step_plan {
  std::size_t size, kept;
};
std::vector<step_plan> plan(const options& o, std::size_t seq) {
  std::vector<step_plan> steps;
  for (std::size_t size = o.steps; size + drafts <= 2 * o.steps;) {
    const std::size_t kept = size + drafts - rejected(seq, steps.size());
    steps.push_back({size, kept});
    size = kept + 1;
  }
  return steps;
}

asio::awaitable<void> speculate(const options& o, std::size_t seq, std::vector<layer_kv_cache>& layers,
                                const std::vector<token>& data, const std::vector<std::vector<kv_write>>& batches,
                                std::size_t& steps) {
  for (const step_plan& p : plan(o, seq)) {
    for (auto& cache : layers) {
      co_await cache.async_write_batch(batches[p.size], asio::use_awaitable);
      co_await cache.async_truncate(p.kept, asio::use_awaitable);
      co_await cache.async_write(p.kept, data[p.kept].keys, data[p.kept].values, asio::use_awaitable);
    }
    ++steps;
  }
}

struct result {
  double steps_per_s = 0;
  double copies_per_step = 0;
};

/// batches[i]: the drafts [i, i + 4), for every i a step may start at.
std::vector<std::vector<kv_write>> draft_batches(const options& o, const std::vector<token>& data) {
  std::vector<std::vector<kv_write>> batches(2 * o.steps);
  for (std::size_t i = 0; i + drafts <= 2 * o.steps; ++i) batches[i] = writes_of(data, i, i + drafts);
  return batches;
}

result run_ghostlink(const options& o, const std::vector<token>& data) {
  asio::thread_pool pool(o.threads);
  const kv_cache_config config = speculative_config(o);
  const std::vector<std::vector<kv_write>> batches = draft_batches(o, data);
  const std::vector<kv_write> prefill = writes_of(data, 0, o.steps);

  double decoding = 0;
  std::size_t steps = 0;
  std::uint64_t copies = 0;
  while (decoding < o.seconds) {
    const kv_block_pool blocks = kv_block_pool::for_caches(config);
    std::vector<std::vector<layer_kv_cache>> seqs(o.sequences);
    std::vector<std::future<void>> ready;
    for (auto& layers : seqs)
      for (std::size_t l = 0; l < o.layers; ++l) {
        layers.emplace_back(pool, config, blocks);
        layers.back().async_initialize(1, asio::use_future).get();
        ready.push_back(layers.back().async_write_batch(prefill, asio::use_future));
      }
    for (auto& f : ready) f.get();
    const std::uint64_t copies_before = blocks.stats().cow_copies;
    std::vector<std::size_t> done(o.sequences, 0);
    const auto t0 = clock_type::now();
    std::vector<std::future<void>> running;
    for (std::size_t s = 0; s < o.sequences; ++s)
      running.push_back(asio::co_spawn(pool, speculate(o, s, seqs[s], data, batches, done[s]), asio::use_future));
    for (auto& f : running) f.get();
    decoding += seconds_since(t0);
    copies += blocks.stats().cow_copies - copies_before;
    // A step is one token position of every sequence and layer: count the
    // steps of sequence 0 (all run the same number, give or take one).
    steps += done[0];
  }
  return {double(steps) / decoding, double(copies) / double(steps * o.sequences * o.layers)};
}

double run_locked(const options& o, const std::vector<token>& data) {
  const kv_cache_config config = speculative_config(o);
  const std::vector<std::vector<kv_write>> batches = draft_batches(o, data);
  double decoding = 0;
  std::size_t steps = 0;
  while (decoding < o.seconds) {
    std::vector<std::vector<std::unique_ptr<rwlock_cache>>> seqs(o.sequences);
    for (auto& layers : seqs)
      for (std::size_t l = 0; l < o.layers; ++l) {
        layers.push_back(std::make_unique<rwlock_cache>(config));
        layers.back()->initialize(1);
        for (std::size_t i = 0; i < o.steps; ++i) layers.back()->write(i, data[i].keys, data[i].values);
      }
    std::vector<std::size_t> done(o.sequences, 0);
    auto decode = [&](std::size_t first_seq) {
      for (std::size_t s = first_seq; s < o.sequences; s += o.threads)
        for (const step_plan& p : plan(o, s)) {
          for (auto& cache : seqs[s]) {
            cache->write_batch(batches[p.size]);
            cache->truncate(p.kept);
            cache->write(p.kept, data[p.kept].keys, data[p.kept].values);
          }
          ++done[s];
        }
    };
    const auto t0 = clock_type::now();
    on_threads(o.threads, decode);
    decoding += seconds_since(t0);
    steps += done[0];
  }
  return double(steps) / decoding;
}

}  // namespace

void decode_speculative(const options& o, report& out) {
  std::vector<token> data = tokens_for(o, 2 * o.steps);
  out.run("decode_speculative", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "1 steps", "speculative steps (4 drafts, 1-3 rejected)", "steps/s");
    metric& copies = declare(m, "2 copies", "blocks copied per layer-step", "blocks", false);
    if (o.wants("ghostlink")) {
      const result r = run_ghostlink(o, data);
      rate.values["ghostlink"] = r.steps_per_s;
      copies.values["ghostlink"] = r.copies_per_step;
    }
    if (o.wants("rwlock_zero_copy")) rate.values["rwlock_zero_copy"] = run_locked(o, data);
  });
  out.add_note("decode_speculative", std::to_string(o.layers) + " layers x " + std::to_string(o.sequences) +
                                         " sequences, contexts " + std::to_string(o.steps) + ".." +
                                         std::to_string(2 * o.steps) + ", no attention (cache operations only), " +
                                         std::to_string(o.threads) + " threads; nothing pins an older epoch");
}

}  // namespace ghostlink::bench
