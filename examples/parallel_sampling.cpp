// Parallel sampling: a prompt is prefilled once into a whole-model sequence
// cache, then forked into N samples that decode independently, each a
// coroutine on a thread pool. Forking copies no token data: every sample
// shares the prompt's blocks, and a shared block is copied only when a
// sample writes into it. The pool's statistics, printed after each phase,
// show the prompt stored once; at the end every sample's every layer is
// checked token by token against what was written, and the program fails
// if anything differs or any block outlives the caches.
//
//   parallel_sampling [--samples N] [--layers N] [--prompt N] [--decode N]
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

struct shape {
  std::size_t samples = 8, layers = 8, prompt = 1000, decode = 100;
  ghostlink::kv_cache_config config{.max_tokens_per_seq = 8192, .num_heads = 4, .head_dim = 64, .block_tokens = 16};
};

/// Token `index` of sample `sample` (0 for the prompt) in `layer`: every
/// float distinct, so a token read from the wrong place shows.
std::vector<float> token(const shape& s, std::size_t sample, std::size_t layer, std::size_t index, float kind) {
  std::vector<float> v(s.config.token_width());
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = kind * float(sample * 1'000'000 + layer * 10'000 + index) + float(i) / float(v.size());
  return v;
}

/// Appends tokens [from, to) of `sample` to `seq`, one decode step each.
asio::awaitable<void> decode(const shape& s, ghostlink::sequence_kv_cache seq, std::size_t sample, std::size_t from,
                             std::size_t to) {
  for (std::size_t index = from; index < to; ++index) {
    std::vector<std::vector<float>> keys, values;
    std::vector<std::span<const float>> key_spans, value_spans;
    for (std::size_t layer = 0; layer < s.layers; ++layer) {
      keys.push_back(token(s, sample, layer, index, 1.0f));
      values.push_back(token(s, sample, layer, index, -1.0f));
    }
    for (std::size_t layer = 0; layer < s.layers; ++layer) {
      key_spans.emplace_back(keys[layer]);
      value_spans.emplace_back(values[layer]);
    }
    co_await seq.async_append(key_spans, value_spans, asio::use_awaitable);
  }
}

/// Mismatching floats in `seq`: the prompt's tokens, then `sample`'s own.
std::size_t mismatches(const shape& s, const ghostlink::sequence_kv_cache& seq, std::size_t sample) {
  std::size_t bad = 0;
  const auto snap = seq.snapshot();
  if (snap.size() != s.prompt + s.decode) return snap.size() + 1;
  ghostlink::kv_entry e;
  for (std::size_t layer = 0; layer < s.layers; ++layer)
    for (std::size_t index = 0; index < snap.size(); ++index) {
      const std::size_t owner = index < s.prompt ? 0 : sample;
      if (snap.layer(layer).read_kv(index, e) || e.keys != token(s, owner, layer, index, 1.0f) ||
          e.values != token(s, owner, layer, index, -1.0f))
        ++bad;
    }
  return bad;
}

void print(const char* phase, const ghostlink::kv_block_pool& pool) {
  const ghostlink::kv_pool_stats st = pool.stats();
  std::printf("%-28s blocks in use %6zu (%7.1f MiB)  shared %6zu  copied on write %4llu  peak %6zu\n", phase,
              st.blocks_in_use, double(st.bytes_in_use()) / (1 << 20), st.blocks_shared,
              static_cast<unsigned long long>(st.cow_copies), st.peak_blocks_in_use);
}

std::size_t blocks_for(const shape& s, std::size_t tokens) {
  return s.layers * ((tokens + s.config.block_tokens - 1) / s.config.block_tokens);
}

bool parse(int argc, char** argv, shape& s) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::size_t value = std::strtoull(argv[i + 1], nullptr, 10);
    if (value == 0) return false;
    if (flag == "--samples")
      s.samples = value;
    else if (flag == "--layers")
      s.layers = value;
    else if (flag == "--prompt")
      s.prompt = value;
    else if (flag == "--decode")
      s.decode = value;
    else
      return false;
  }
  return argc % 2 == 1 && s.prompt + s.decode <= s.config.max_tokens_per_seq;
}

}  // namespace

int main(int argc, char** argv) try {
  shape s;
  if (!parse(argc, argv, s)) {
    std::fprintf(stderr, "usage: parallel_sampling [--samples N] [--layers N] [--prompt N] [--decode N]\n");
    return 2;
  }
  std::printf("%zu samples of a %zu-token prompt, %zu layers, %zu tokens decoded per sample\n", s.samples, s.prompt,
              s.layers, s.decode);
  std::size_t bad = 0;
  {
    asio::thread_pool threads(2);
    const auto pool = ghostlink::kv_block_pool::for_caches(s.config);
    ghostlink::sequence_kv_cache prompt(threads, s.layers, s.config, pool);
    asio::co_spawn(threads, decode(s, prompt, 0, 0, s.prompt), asio::use_future).get();
    print("after prefill", pool);

    std::vector<ghostlink::sequence_kv_cache> samples;
    for (std::size_t i = 0; i < s.samples; ++i) samples.push_back(prompt.async_fork(asio::use_future).get());
    print("after forking", pool);

    std::vector<std::future<void>> running;
    for (std::size_t i = 0; i < s.samples; ++i)
      running.push_back(
          asio::co_spawn(threads, decode(s, samples[i], i + 1, s.prompt, s.prompt + s.decode), asio::use_future));
    for (auto& r : running) r.get();
    print("after decoding", pool);

    for (std::size_t i = 0; i < s.samples; ++i) bad += mismatches(s, samples[i], i + 1);
    const std::size_t separate = s.samples * blocks_for(s, s.prompt + s.decode);
    const std::size_t used = pool.stats().blocks_in_use;
    std::printf("stored once: %zu blocks in use; %zu samples stored separately would need %zu (%.1fx)\n", used,
                s.samples, separate, double(separate) / double(used));
    samples.clear();
    prompt = {};
    threads.join();
    print("after release", pool);
    if (pool.stats().blocks_in_use != 0) ++bad;
  }
  if (bad != 0) {
    std::fprintf(stderr, "FAILED: %zu mismatching tokens or leaked blocks\n", bad);
    return 1;
  }
  std::printf("every sample's every token checked: OK\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "parallel_sampling: %s\n", e.what());
  return 2;
}
