// prefill: a prompt of P tokens (2048) into a sequence of L layers (32), in
// chunks of 256 tokens: one multi-token async_append per chunk (one request
// per layer), against a memcpy of the same bytes into buffers allocated
// beforehand (rwlock_zero_copy's contiguous buffers, one lock per layer and
// chunk). ghostlink's figure includes taking the blocks from the pool; the
// sequence's creation is not timed, as the lock's allocation is not.
#include <ghostlink/kv_cache.hpp>

#include <asio/thread_pool.hpp>
#include <asio/use_future.hpp>

#include <algorithm>
#include <memory>
#include <vector>

#include "../baselines/locked_cache.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

constexpr std::size_t chunk_tokens = 256;

/// The prompt, token-major: P tokens of keys and of values.
struct prompt {
  std::size_t tokens = 0, width = 0;
  std::vector<float> keys, values;
  prompt(std::size_t tokens, std::size_t width) : tokens(tokens), width(width) {
    for (std::size_t i = 0; i < tokens; ++i) {
      const token t(width, i);
      keys.insert(keys.end(), t.keys.begin(), t.keys.end());
      values.insert(values.end(), t.values.begin(), t.values.end());
    }
  }
  /// Chunk `c`'s first token and token count.
  static std::size_t first(std::size_t c) { return c * chunk_tokens; }
  std::size_t count(std::size_t c) const { return std::min(chunk_tokens, tokens - first(c)); }
  std::size_t chunks() const { return (tokens + chunk_tokens - 1) / chunk_tokens; }
  std::span<const float> keys_of(std::size_t c) const {
    return std::span(keys).subspan(first(c) * width, count(c) * width);
  }
  std::span<const float> values_of(std::size_t c) const {
    return std::span(values).subspan(first(c) * width, count(c) * width);
  }
};

double run_ghostlink(const options& o, const prompt& p) {
  asio::thread_pool threads(o.threads);
  const auto pool = kv_block_pool::for_caches(o.config());
  const double rate = laps_per_second(o.seconds, [&] {
    const sequence_kv_cache seq(threads, o.layers, o.config(), pool);
    std::vector<std::span<const float>> keys(o.layers), values(o.layers);
    const auto t0 = clock_type::now();
    for (std::size_t c = 0; c < p.chunks(); ++c) {
      std::fill(keys.begin(), keys.end(), p.keys_of(c));
      std::fill(values.begin(), values.end(), p.values_of(c));
      seq.async_append(keys, values, asio::use_future).get();
    }
    const double s = seconds_since(t0);
    keep(float(seq.size()));
    return s;
  });
  threads.join();
  return rate;
}

double run_memcpy(const options& o, const prompt& p) {
  return laps_per_second(o.seconds, [&] {
    std::vector<std::unique_ptr<rwlock_cache>> layers;
    for (std::size_t l = 0; l < o.layers; ++l) {
      layers.push_back(std::make_unique<rwlock_cache>(o.config()));
      layers.back()->initialize(1);  // allocates its buffers: not timed
    }
    std::vector<kv_write> writes(chunk_tokens);
    const auto t0 = clock_type::now();
    for (std::size_t c = 0; c < p.chunks(); ++c) {
      for (std::size_t t = 0; t < p.count(c); ++t)
        writes[t] = {p.first(c) + t, p.keys_of(c).subspan(t * p.width, p.width),
                     p.values_of(c).subspan(t * p.width, p.width)};
      for (auto& layer : layers) layer->write_batch(std::span(writes).first(p.count(c)));
    }
    const double s = seconds_since(t0);
    keep(float(layers.back()->size()));
    return s;
  });
}

}  // namespace

void prefill(const options& o, report& out) {
  const prompt p(std::min<std::size_t>(2048, o.tokens), o.config().token_width());
  out.run("prefill", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(
        m, "rate", "prompts of " + std::to_string(p.tokens) + " tokens x " + std::to_string(o.layers) + " layers",
        "prompts/s");
    if (o.wants("ghostlink")) rate.values["ghostlink"] = run_ghostlink(o, p);
    if (o.wants("rwlock_zero_copy")) rate.values["rwlock_zero_copy"] = run_memcpy(o, p);
  });
  out.add_note("prefill", "in chunks of 256 tokens; rwlock_zero_copy here is a memcpy of each chunk into buffers "
                          "allocated beforehand, one lock per layer and chunk");
}

}  // namespace ghostlink::bench
