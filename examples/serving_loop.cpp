// A simulated decode loop: several sequences, each a coroutine on a thread
// pool, each with its own stack of layer caches. Every step appends the new
// token's keys and values to every layer (co_await async_write_batch), then
// computes that step's attention output for every layer and head straight
// from a snapshot's blocks (for_each_block, no copy). At the end a
// single-threaded reference recomputes every output from the raw inputs and
// the program fails if any differs.
//
//   serving_loop [--sequences N] [--layers N] [--steps N] [--threads N]
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <string>
#include <vector>

namespace {

struct shape {
  std::size_t sequences = 8, layers = 4, steps = 192, threads = 2;
  std::size_t heads = 4, head_dim = 64;
  std::size_t width() const { return heads * head_dim; }
};

/// Deterministic inputs: the same (sequence, layer, step, kind) always gives
/// the same vector, so the reference can regenerate what was written.
enum class kind : std::uint64_t { query = 1, key = 2, value = 3 };

std::vector<float> input(const shape& s, std::size_t seq, std::size_t layer, std::size_t step, kind k) {
  std::vector<float> v(s.width());
  std::uint64_t x =
      (seq * 1000003 + layer * 10007 + step * 101 + static_cast<std::uint64_t>(k)) * 0x9E3779B97F4A7C15ull;
  for (float& f : v) {
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    f = static_cast<float>(static_cast<double>(x >> 40) / double(1ull << 24) * 2.0 - 1.0);
  }
  return v;
}

/// softmax(q . k_j / sqrt(d)) . v_j over tokens j, one head, in one pass
/// with a running maximum (online softmax).
struct head_accumulator {
  float max = -INFINITY, sum = 0;
  std::vector<float> out;

  explicit head_accumulator(std::size_t dim) : out(dim, 0.0f) {}
  void add(const float* q, const float* k, const float* v, std::size_t dim) {
    float dot = 0;
    for (std::size_t i = 0; i < dim; ++i) dot += q[i] * k[i];
    const float logit = dot / std::sqrt(float(dim));
    const float new_max = std::max(max, logit);
    const float scale = std::exp(max - new_max), w = std::exp(logit - new_max);
    for (std::size_t i = 0; i < dim; ++i) out[i] = out[i] * scale + w * v[i];
    sum = sum * scale + w;
    max = new_max;
  }
  void finish() {
    for (float& o : out) o /= sum;
  }
};

/// Attention output of one layer for query `q` over every token in `snap`.
std::vector<float> attend(const shape& s, const ghostlink::kv_snapshot& snap, const std::vector<float>& q) {
  std::vector<head_accumulator> heads(s.heads, head_accumulator(s.head_dim));
  const auto ec = snap.for_each_block(
      0, snap.size(), [&](std::size_t, std::size_t count, std::span<const float> k, std::span<const float> v) {
        for (std::size_t t = 0; t < count; ++t)
          for (std::size_t h = 0; h < s.heads; ++h) {
            const std::size_t at = t * s.width() + h * s.head_dim;
            heads[h].add(q.data() + h * s.head_dim, k.data() + at, v.data() + at, s.head_dim);
          }
      });
  if (ec) throw std::system_error(ec);
  std::vector<float> out;
  for (auto& h : heads) {
    h.finish();
    out.insert(out.end(), h.out.begin(), h.out.end());
  }
  return out;
}

/// The same attention, single-threaded, from regenerated inputs and a plain
/// two-pass softmax.
std::vector<float> reference(const shape& s, std::size_t seq, std::size_t layer, std::size_t step) {
  const auto q = input(s, seq, layer, step, kind::query);
  std::vector<std::vector<float>> keys, values;
  for (std::size_t j = 0; j <= step; ++j) {
    keys.push_back(input(s, seq, layer, j, kind::key));
    values.push_back(input(s, seq, layer, j, kind::value));
  }
  std::vector<float> out(s.width(), 0.0f);
  for (std::size_t h = 0; h < s.heads; ++h) {
    const std::size_t base = h * s.head_dim;
    std::vector<double> logits(step + 1);
    for (std::size_t j = 0; j <= step; ++j) {
      double dot = 0;
      for (std::size_t i = 0; i < s.head_dim; ++i) dot += double(q[base + i]) * keys[j][base + i];
      logits[j] = dot / std::sqrt(double(s.head_dim));
    }
    const double max = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (double& l : logits) sum += (l = std::exp(l - max));
    for (std::size_t j = 0; j <= step; ++j)
      for (std::size_t i = 0; i < s.head_dim; ++i) out[base + i] += float(logits[j] / sum * values[j][base + i]);
  }
  return out;
}

/// One sequence's decode loop. outputs[layer][step] receives that step's
/// attention output.
asio::awaitable<void> decode(const shape& s, std::size_t seq, std::vector<ghostlink::layer_kv_cache>& layers,
                             std::vector<std::vector<std::vector<float>>>& outputs) {
  for (auto& cache : layers) co_await cache.async_initialize(1, asio::use_awaitable);
  for (std::size_t step = 0; step < s.steps; ++step) {
    for (std::size_t l = 0; l < s.layers; ++l) {
      const auto k = input(s, seq, l, step, kind::key), v = input(s, seq, l, step, kind::value);
      const ghostlink::kv_write token[] = {{step, k, v}};
      co_await layers[l].async_write_batch(token, asio::use_awaitable);
      // Read-your-writes: the snapshot includes the token just written.
      outputs[l][step] = attend(s, layers[l].snapshot(), input(s, seq, l, step, kind::query));
    }
  }
}

shape parse(int argc, char** argv) {
  shape s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::size_t value = std::strtoull(argv[i + 1], nullptr, 10);
    if (value == 0) throw std::invalid_argument("values must be positive: " + flag);
    if (flag == "--sequences")
      s.sequences = value;
    else if (flag == "--layers")
      s.layers = value;
    else if (flag == "--steps")
      s.steps = value;
    else if (flag == "--threads")
      s.threads = value;
    else
      throw std::invalid_argument("unknown flag " + flag);
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) try {
  const shape s = parse(argc, argv);
  asio::thread_pool pool(s.threads);
  const ghostlink::kv_cache_config config{.max_tokens_per_seq = s.steps, .num_heads = s.heads, .head_dim = s.head_dim};

  std::vector<std::vector<ghostlink::layer_kv_cache>> caches(s.sequences);
  std::vector<std::vector<std::vector<std::vector<float>>>> outputs(
      s.sequences, std::vector<std::vector<std::vector<float>>>(s.layers, std::vector<std::vector<float>>(s.steps)));
  for (auto& layers : caches)
    for (std::size_t l = 0; l < s.layers; ++l) layers.emplace_back(pool, config);

  const auto start = std::chrono::steady_clock::now();
  std::vector<std::future<void>> running;
  for (std::size_t seq = 0; seq < s.sequences; ++seq)
    running.push_back(asio::co_spawn(pool, decode(s, seq, caches[seq], outputs[seq]), asio::use_future));
  for (auto& r : running) r.get();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::uint64_t epochs = 0;
  std::size_t bytes = 0;
  for (auto& layers : caches)
    for (auto& cache : layers) {
      const auto st = cache.stats();
      epochs += st.epoch;
      bytes += st.bytes_in_use;
    }

  double worst = 0;
  std::size_t mismatches = 0;
  for (std::size_t seq = 0; seq < s.sequences; ++seq)
    for (std::size_t l = 0; l < s.layers; ++l)
      for (std::size_t step = 0; step < s.steps; ++step) {
        const auto expected = reference(s, seq, l, step);
        for (std::size_t i = 0; i < expected.size(); ++i) {
          const double diff = std::abs(double(expected[i]) - outputs[seq][l][step][i]);
          worst = std::max(worst, diff);
          if (diff > 1e-4) ++mismatches;
        }
      }

  const double tokens = double(s.sequences * s.steps);
  std::printf("serving_loop: %zu sequences x %zu layers x %zu steps on %zu threads\n", s.sequences, s.layers, s.steps,
              s.threads);
  std::printf("  decode:     %.0f tokens/s (%.0f layer-token writes/s, attention included) in %.3f s\n",
              tokens / seconds, tokens * double(s.layers) / seconds, seconds);
  std::printf("  epochs:     %llu published across %zu layer caches\n", static_cast<unsigned long long>(epochs),
              s.sequences * s.layers);
  std::printf("  stored:     %.2f MiB in blocks (%.2f MiB of keys and values written)\n",
              static_cast<double>(bytes) / 1048576.0,
              tokens * double(s.layers * s.width() * 2 * sizeof(float)) / 1048576.0);
  std::printf("  reference:  %s (max abs diff %.2e over %zu outputs)\n", mismatches ? "MISMATCH" : "match", worst,
              s.sequences * s.layers * s.steps);
  return mismatches ? 1 : 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "serving_loop: %s\n", e.what());
  return 2;
}
