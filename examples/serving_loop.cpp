// A real decoder on ghostlink: a small Llama-style model (tiny_llama.hpp,
// random weights from a fixed seed) serving several sequences at once, each
// a coroutine on a thread pool with its KV in a ghostlink sequence cache.
//
// The model is hybrid, as Gemma's are: its sequences have the layout
// kv_model_layout::interleaved(layers, 3, window, sinks), so every third
// layer attends every token and the others a window of the last `window`
// tokens beside the first `sinks` (attention sinks), and those layers drop
// the blocks no later token attends. The defaults (16-token window, 4
// sinks, 160 tokens) decode past ten windows; `--window 0` runs every layer
// at full attention (kv_model_layout::full) instead.
//
// Every forward pass is one step (async_begin_step): layer by layer it
// computes the new tokens' queries, keys and values, starts the layer's
// write without awaiting it, and attends (ghostlink::attend, within the
// layer's window and sinks) over the layer's tokens before the step with
// its own tokens pending; the commit awaits the writes once. The prompt is
// one step of many tokens (a causal prefill, by default twice the window);
// each decoded token is one step. Sequence 0 is forked after its prompt
// into a parallel sample; sequence 1 decodes speculatively: now and then it
// verifies three drafted tokens in one step, keeps those the model agrees
// with and truncates the rest away (the layout's rollback_tokens, 3, keeps
// what the windows need for that).
//
// At the end every generated position's logits are checked against a
// recompute of the whole sequence that uses no cache and masks each layer
// as the layout does, and the cache's token ids against the tokens
// generated; any mismatch fails the program. The same prompts are then
// served again at full attention (checked the same way), and the blocks
// each run's pool holds at the end are printed side by side: what the
// windows save. The hybrid run's must be within the layout's bound.
//
//   serving_loop [--sequences N] [--layers N] [--prompt N] [--steps N] [--threads N]
//                [--window W (0: full attention)] [--sinks S]
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/this_coro.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "tiny_llama.hpp"

namespace {

using ghostlink::token_id;
using clock_type = std::chrono::steady_clock;
using use_awaitable_t = asio::use_awaitable_t<>;
constexpr use_awaitable_t awaitable;

struct options {
  std::size_t sequences = 8, layers = 8, prompt = 32, steps = 128, threads = 2;
  std::size_t window = 16, sinks = 4;  // window 0: every layer full
};

/// The layout the options ask for: every third layer full and the others
/// windowed, or every layer full for `--window 0`.
ghostlink::kv_model_layout layout_of(const options& o) {
  if (o.window == 0) return ghostlink::kv_model_layout::full(o.layers);
  auto layout = ghostlink::kv_model_layout::interleaved(o.layers, 3, o.window, o.sinks);
  // Sequence 1's speculative rounds take back up to three drafted tokens:
  // without room for them in the windows, those truncates would fail with
  // outside_window.
  layout.rollback_tokens = 3;
  return layout;
}

/// What one sequence generated: its tokens, the logits that chose each
/// token after the prompt (`logits[i]` at position `prompt - 1 + i`), and
/// its timings.
struct record {
  std::string name;
  std::vector<token_id> tokens;
  std::vector<std::vector<float>> logits;
  std::vector<double> step_seconds;  // each single-token decode step
  std::size_t drafted = 0, accepted = 0, rollbacks = 0;
  ghostlink::sequence_kv_cache cache;
};

/// Runs tokens through the model as steps of one ghostlink sequence.
class decoder {
 public:
  decoder(const tiny_llama::model& m, ghostlink::sequence_kv_cache seq) : m_(m), seq_(std::move(seq)) {}

  const ghostlink::sequence_kv_cache& sequence() const { return seq_; }

  /// The logits of each of `ids`, fed at positions `sequence().size()` on,
  /// which become part of the sequence: one step (tiny_llama::forward).
  asio::awaitable<std::vector<std::vector<float>>> forward(std::vector<token_id> ids) {
    return tiny_llama::forward(m_, seq_, std::move(ids));
  }

 private:
  const tiny_llama::model& m_;
  ghostlink::sequence_kv_cache seq_;
};

using tiny_llama::greedy;
using tiny_llama::sample;

/// Decodes `r` until it holds `length` tokens (a speculative round may pass
/// it by up to three).
asio::awaitable<void> decode(decoder& dec, record& r, std::size_t length, std::uint64_t seed, bool speculative) {
  std::mt19937_64 rng(seed);
  for (std::size_t round = 0; r.tokens.size() < length; ++round) {
    const token_id next = speculative ? greedy(r.logits.back()) : sample(r.logits.back(), rng);
    if (speculative && round % 8 == 7) {
      // Draft the three tokens that followed the last three (a prompt-lookup
      // draft), verify them with `next` in one step of four causal rows,
      // keep the drafts the model agrees with and roll back the rest.
      const std::size_t at = r.tokens.size();
      std::vector<token_id> ids(1, next);  // (no initializer list: GCC 12 rejects one in a coroutine)
      ids.insert(ids.end(), r.tokens.end() - 3, r.tokens.end());
      const auto rows = co_await dec.forward(ids);
      r.tokens.push_back(next);
      r.logits.push_back(rows[0]);
      std::size_t kept = 0;
      while (kept < 3 && greedy(rows[kept]) == ids[kept + 1]) {
        ++kept;
        r.tokens.push_back(ids[kept]);
        r.logits.push_back(rows[kept]);
      }
      r.drafted += 3;
      r.accepted += kept;
      if (kept < 3) {
        co_await dec.sequence().async_truncate(at + 1 + kept, awaitable);
        ++r.rollbacks;
      }
      continue;
    }
    const auto start = clock_type::now();
    const auto rows = co_await dec.forward(std::vector<token_id>(1, next));
    r.step_seconds.push_back(std::chrono::duration<double>(clock_type::now() - start).count());
    r.tokens.push_back(next);
    r.logits.push_back(rows[0]);
  }
}

/// Serves sequence `i`: prefill its prompt, then decode. Sequence 0 also
/// forks into `child` after the prompt and decodes it on its own coroutine.
asio::awaitable<void> serve(const tiny_llama::model& m, const options& o, std::size_t i, record& r, record* child,
                            std::promise<void>* child_done) {
  decoder dec(m, r.cache);
  std::mt19937_64 prompt_rng(100 + i);
  for (std::size_t t = 0; t < o.prompt; ++t) r.tokens.push_back(static_cast<token_id>(prompt_rng() % m.shape().vocab));
  const auto rows = co_await dec.forward(r.tokens);  // the prefill: one step, causal
  r.logits.push_back(rows.back());
  const std::size_t length = o.prompt + o.steps;
  if (child) {
    child->cache = co_await r.cache.async_fork(awaitable);  // shares the prompt's blocks
    child->tokens = r.tokens;
    child->logits = r.logits;
    auto ex = co_await asio::this_coro::executor;
    asio::co_spawn(
        ex,
        [&m, child, length]() -> asio::awaitable<void> {
          decoder forked(m, child->cache);
          co_await decode(forked, *child, length, 7777, false);
        },
        [child_done](const std::exception_ptr& e) {
          if (e)
            child_done->set_exception(e);
          else
            child_done->set_value();
        });
  }
  co_await decode(dec, r, length, 1 + i, i == 1);
}

/// Positions whose logits differ from the cacheless recompute under
/// `layout`'s masks, and the largest difference.
std::pair<std::size_t, double> check(const tiny_llama::model& m, const options& o,
                                     const ghostlink::kv_model_layout& layout, const record& r) {
  const auto expected = tiny_llama::recompute(m, r.tokens, o.prompt - 1, layout);
  std::size_t bad = expected.size() == r.logits.size() ? 0 : 1;
  double worst = 0;
  for (std::size_t p = 0; p < std::min(expected.size(), r.logits.size()); ++p)
    bad += tiny_llama::logits_differ(expected[p], r.logits[p], worst);
  if (r.cache.size() != r.tokens.size() || r.cache.snapshot().token_ids() != r.tokens) ++bad;
  return {bad, worst};
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument("missing value for " + flag);
    char* end = nullptr;
    const std::size_t value = std::strtoull(argv[i + 1], &end, 10);
    if (end == argv[i + 1] || *end != '\0')
      throw std::invalid_argument("not a number for " + flag + ": " + argv[i + 1]);
    if (value == 0 && flag != "--window" && flag != "--sinks")
      throw std::invalid_argument("values must be positive: " + flag);
    if (flag == "--sequences")
      o.sequences = value;
    else if (flag == "--layers")
      o.layers = value;
    else if (flag == "--prompt")
      o.prompt = value;
    else if (flag == "--steps")
      o.steps = value;
    else if (flag == "--threads")
      o.threads = value;
    else if (flag == "--window")
      o.window = value;
    else if (flag == "--sinks")
      o.sinks = value;
    else
      throw std::invalid_argument("unknown flag " + flag);
  }
  if (o.prompt < 3) throw std::invalid_argument("--prompt must be at least 3 (the speculative draft reads 3 tokens)");
  return o;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * double(v.size())))];
}

/// The most blocks of `block_tokens` tokens that a sequence of `tokens`
/// tokens may hold in `layout`: every token of a full layer, and a
/// windowed layer's bound (kv_model_layout) or its tokens, if fewer.
std::size_t blocks_bound(const ghostlink::kv_model_layout& layout, std::size_t tokens, std::size_t block_tokens) {
  const auto blocks = [block_tokens](std::size_t n) { return (n + block_tokens - 1) / block_tokens; };
  std::size_t bound = 0;
  for (const ghostlink::kv_layer_layout& l : layout.layers)
    bound += l.window == 0
                 ? blocks(tokens)
                 : std::min(blocks(tokens), blocks(l.sink_tokens) + blocks(l.window + layout.rollback_tokens) + 1);
  return bound;
}

/// What serving every sequence on one layout gave, checked.
struct run {
  double seconds = 0;
  std::size_t generated = 0, bad = 0, drafted = 0, accepted = 0, rollbacks = 0;
  std::vector<double> steps;
  double worst = 0;
  /// The pool's counters once every sequence is done (idle, so exact),
  /// every sequence still alive.
  ghostlink::kv_pool_stats pool;
  std::size_t bound = 0;  // blocks_bound summed over the sequences (forks share, so a bound)
  bool past_bound = false;  // the pool held more than `bound`
};

/// Serves `o.sequences` sequences of `layout` and sequence 0's fork on
/// `threads`, all taking their blocks from one pool, then checks each
/// against the recompute under `layout`'s masks.
run serve_all(const tiny_llama::model& model, const options& o, const ghostlink::kv_model_layout& layout,
              asio::thread_pool& threads) {
  const tiny_llama::dims& dims = model.shape();
  const ghostlink::kv_cache_config config{
      .max_tokens_per_seq = o.prompt + o.steps + 4, .num_heads = dims.kv_heads, .head_dim = dims.head_dim};
  const auto blocks = ghostlink::kv_block_pool::for_caches(config);

  std::vector<std::unique_ptr<record>> records;
  for (std::size_t i = 0; i < o.sequences; ++i)
    records.push_back(std::make_unique<record>(record{"sequence " + std::to_string(i),
                                                      {},
                                                      {},
                                                      {},
                                                      0,
                                                      0,
                                                      0,
                                                      ghostlink::sequence_kv_cache(threads, layout, config, blocks)}));
  records.push_back(std::make_unique<record>(record{"sequence 0's fork", {}, {}, {}, 0, 0, 0, {}}));
  std::promise<void> child_done;

  run out;
  const auto start = clock_type::now();
  std::vector<std::future<void>> running;
  for (std::size_t i = 0; i < o.sequences; ++i)
    running.push_back(
        asio::co_spawn(threads, serve(model, o, i, *records[i], i == 0 ? records.back().get() : nullptr, &child_done),
                       asio::use_future));
  for (auto& r : running) r.get();
  child_done.get_future().get();
  out.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  out.pool = blocks.stats();

  for (const auto& r : records) {
    out.generated += r->tokens.size() - o.prompt;
    out.steps.insert(out.steps.end(), r->step_seconds.begin(), r->step_seconds.end());
    out.drafted += r->drafted;
    out.accepted += r->accepted;
    out.rollbacks += r->rollbacks;
    out.bound += blocks_bound(layout, r->cache.size(), config.block_tokens);
    const auto [b, w] = check(model, o, layout, *r);
    if (b) std::fprintf(stderr, "serving_loop: %s: %zu positions differ from the recompute\n", r->name.c_str(), b);
    out.bad += b;
    out.worst = std::max(out.worst, w);
  }
  out.past_bound = out.pool.blocks_in_use > out.bound;
  if (out.past_bound)
    std::fprintf(stderr, "serving_loop: %zu blocks held, past the layout's bound of %zu\n", out.pool.blocks_in_use,
                 out.bound);
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  tiny_llama::dims dims;
  dims.layers = o.layers;
  const tiny_llama::model model(dims);
  asio::thread_pool pool(o.threads);
  const ghostlink::kv_model_layout layout = layout_of(o);

  const run r = serve_all(model, o, layout, pool);
  // The same prompts at full attention, for the memory the windows save.
  const bool compare = layout.windowed();
  const run full = compare ? serve_all(model, o, ghostlink::kv_model_layout::full(o.layers), pool) : run{};

  std::printf("serving_loop: %zu sequences + 1 fork, %zu-layer model (%zu query / %zu KV heads of %zu), %zu-token "
              "prompts, %zu tokens each, %zu threads\n",
              o.sequences, dims.layers, dims.query_heads, dims.kv_heads, dims.head_dim, o.prompt, o.steps, o.threads);
  if (compare) {
    const std::size_t full_layers = o.layers / 3;
    std::printf("  layout:      interleaved(%zu, 3, %zu, %zu): %zu of %zu layers attend every token, %zu a %zu-token "
                "window and %zu sinks (rollback %zu)\n",
                o.layers, o.window, o.sinks, full_layers, o.layers, o.layers - full_layers, o.window, o.sinks,
                layout.rollback_tokens);
  } else {
    std::printf("  layout:      full(%zu): every layer attends every token\n", o.layers);
  }
  std::printf("  decode:      %.0f tokens/s (%zu tokens in %.3f s, prefill included)\n",
              double(r.generated) / r.seconds, r.generated, r.seconds);
  std::printf("  per token:   p50 %.3f ms, p99 %.3f ms (one decode step of one sequence)\n",
              percentile(r.steps, 0.50) * 1e3, percentile(r.steps, 0.99) * 1e3);
  std::printf("  speculative: %zu of %zu drafted tokens kept, %zu rollbacks\n", r.accepted, r.drafted, r.rollbacks);
  std::printf("  recompute:   %s (max abs logit diff %.2e, every generated position of every sequence, the layout's "
              "masks applied)\n",
              r.bad ? "MISMATCH" : "match", r.worst);
  if (compare) {
    std::printf("  blocks held: %zu at the end (peak %zu; bound %zu) against %zu (peak %zu) at full attention on the "
                "same prompts: %.2fx\n",
                r.pool.blocks_in_use, r.pool.peak_blocks_in_use, r.bound, full.pool.blocks_in_use,
                full.pool.peak_blocks_in_use, double(r.pool.blocks_in_use) / double(full.pool.blocks_in_use));
    std::printf("  full run:    %.0f tokens/s (%zu tokens in %.3f s), recompute %s (max abs logit diff %.2e)\n",
                double(full.generated) / full.seconds, full.generated, full.seconds, full.bad ? "MISMATCH" : "match",
                full.worst);
  } else {
    std::printf("  blocks held: %zu at the end (peak %zu)\n", r.pool.blocks_in_use, r.pool.peak_blocks_in_use);
  }
  return r.bad || full.bad || r.past_bound || full.past_bound ? 1 : 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "serving_loop: %s\n", e.what());
  return 2;
}
