// fork: a sequence of P tokens (4096) across L layers (32) forked, against
// copying it in the seed's design (each layer's valid tokens copied into a
// new cache). Also the blocks a fork adds to the pool before either side
// writes, per layer.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <memory>

#include "../baselines/locked_cache.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

/// Tokens in the forked sequence: 4096, or what fits.
std::size_t prompt_tokens(const options& o) { return std::min<std::size_t>(4096, o.tokens); }

/// Blocks of `block_tokens` that `tokens` tokens fill.
std::size_t blocks_of(const options& o, std::size_t tokens) { return (tokens + o.block_tokens - 1) / o.block_tokens; }

asio::awaitable<void> prefill(sequence_kv_cache seq, const std::vector<token>& data, std::size_t layers) {
  std::vector<std::span<const float>> keys(layers), values(layers);
  for (const token& t : data) {
    std::fill(keys.begin(), keys.end(), std::span<const float>(t.keys));
    std::fill(values.begin(), values.end(), std::span<const float>(t.values));
    co_await seq.async_append(keys, values, asio::use_awaitable);
  }
}

}  // namespace

void fork(const options& o, report& out) {
  std::vector<token> data = tokens_for(o, prompt_tokens(o));
  const std::string shape = std::to_string(data.size()) + " tokens x " + std::to_string(o.layers) + " layers";

  out.run("fork", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "rate", "forks of " + shape, "forks/s");
    metric& extra = declare(m, "extra", "blocks a fork adds, per layer", "blocks", false);

    if (o.wants("ghostlink")) {
      asio::thread_pool threads(o.threads);
      const auto pool = kv_block_pool::for_caches(o.config());
      sequence_kv_cache seq(threads, o.layers, o.config(), pool);
      asio::co_spawn(threads, prefill(seq, data, o.layers), asio::use_future).get();
      const std::size_t before = pool.stats().blocks_in_use;
      {
        sequence_kv_cache child = seq.async_fork(asio::use_future).get();
        extra.values["ghostlink"] = double(pool.stats().blocks_in_use - before) / double(o.layers);
      }
      rate.values["ghostlink"] = ops_per_second(o.seconds, [&](std::size_t) {
        sequence_kv_cache child = seq.async_fork(asio::use_future).get();
        keep(float(child.size()));
      });
      threads.join();
    }
    if (o.wants("rwlock")) {
      std::vector<rwlock_cache> layers;
      for (std::size_t l = 0; l < o.layers; ++l) {
        layers.emplace_back(o.config());
        layers.back().initialize(1);
        for (std::size_t i = 0; i < data.size(); ++i) layers.back().write(i, data[i].keys, data[i].values);
      }
      extra.values["rwlock"] = double(blocks_of(o, data.size()));
      rate.values["rwlock"] = ops_per_second(o.seconds, [&](std::size_t) {
        std::vector<rwlock_cache> copy;
        copy.reserve(layers.size());
        for (const auto& l : layers) copy.push_back(l.copy());
        keep(float(copy.back().size()));
      });
    }
  });
  out.add_note("fork", "rwlock: the seed's design copies every layer's valid tokens; its 'blocks' are that copy in "
                       "16-token units");
}

}  // namespace ghostlink::bench
