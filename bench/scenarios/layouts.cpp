// Model layouts (issue 43): what windowed layers save, in memory and in
// attention, against full layers of the same sequence length. Gemma 3's
// layout, interleaved(32, 6, 1024): 27 layers slide over a 1,024-token
// window, 5 keep every token.
// - layout_memory: a 32-layer sequence of that layout grown to 32,768
//   tokens against one of full(32), each on a pool of its own: the blocks
//   and bytes the pool holds once the last token is published, the most
//   it held on the way, and the ratio. Half storage, 2 heads x 64 dims
//   (block counts do not depend on the token's width); --block-tokens.
// - attend_window: one decode row's attention (ghostlink::attend, 32 query
//   heads over 8 KV heads of 128 dims, Llama-3-8B's shape) over a
//   32,768-token layer with a 1,024-token window against a full layer of
//   the same sequence: steps per second on one thread, the same kernel,
//   and the ratio. --element.
// - decode_hybrid: decode steps of interleaved(32, 6, 1024) against
//   full(32) at --tokens (8,192) tokens of context, --threads sequences on
//   --threads threads, one coroutine each, --steps steps through sequence
//   steps as decode_layer_order drives them (begin, per layer write() and
//   attend over snapshot(l), commit); --heads x --head-dim, --element.
// Every sequence grows by 256-token appends. --quick: windows of 128 and
// shorter sequences.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <algorithm>
#include <cmath>
#include <future>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

constexpr std::size_t model_layers = 32, full_every = 6;  // Gemma 3's interleaving
constexpr std::size_t chunk_tokens = 256;                 // tokens per append while a sequence grows

std::size_t window_of(const options& o) { return o.quick ? 128 : 1024; }

kv_model_layout hybrid_layout(const options& o) {
  return kv_model_layout::interleaved(model_layers, full_every, window_of(o));
}

std::size_t blocks_of(std::size_t tokens, std::size_t block_tokens) {
  return (tokens + block_tokens - 1) / block_tokens;
}

/// Appends tokens to `seq` until it holds `tokens`, `rows` at a time (token
/// `i` is `rows`' token `i % chunk_tokens`), the same in every layer.
template <storage_element T>
void grow(const basic_sequence_kv_cache<T>& seq, const token_rows& rows, std::size_t tokens) {
  std::vector<std::span<const float>> keys(seq.num_layers()), values(seq.num_layers());
  while (seq.size() < tokens) {
    const std::size_t n = std::min(chunk_tokens, tokens - seq.size());
    std::fill(keys.begin(), keys.end(), rows.keys_of(0, n));
    std::fill(values.begin(), values.end(), rows.values_of(0, n));
    seq.async_append(keys, values, asio::use_future).get();
  }
}

// --- layout_memory ---

std::size_t memory_context(const options& o) { return o.quick ? 2048 : 32768; }

kv_cache_config memory_config(const options& o) {
  return {.max_tokens_per_seq = memory_context(o), .num_heads = 2, .head_dim = 64, .block_tokens = o.block_tokens};
}

/// The pool's counters once a sequence of `layout` on a pool of its own
/// has grown to memory_context(o) tokens.
kv_pool_stats held_after_growing(const options& o, const kv_model_layout& layout, const token_rows& rows) {
  asio::thread_pool threads(o.threads);
  const kv_block_pool pool = kv_block_pool::for_caches<half>(memory_config(o));
  kv_pool_stats held;
  {
    const basic_sequence_kv_cache<half> seq(threads, layout, memory_config(o), pool);
    grow(seq, rows, memory_context(o));
    held = pool.stats();
  }
  threads.join();
  return held;
}

// --- attend_window ---

std::size_t window_context(const options& o) { return o.quick ? 2048 : 32768; }

constexpr attention_shape llama_shape{.query_heads = 32, .kv_heads = 8, .head_dim = 128};

/// One decode row's attention, as attend_window runs it.
struct decode_row {
  std::vector<float> query, out;
  decode_row() : query(llama_shape.query_heads * llama_shape.head_dim), out(query.size()) {
    for (std::size_t i = 0; i < query.size(); ++i) query[i] = query_value(i);
  }
  template <class... Kv>
  void attend(const Kv&... kv) {
    if (const std::error_code ec = ghostlink::attend(kv..., query, out, llama_shape))
      throw std::system_error(ec, "ghostlink::attend");
    float s = 0;
    for (float x : out) s += x;
    keep(s);
  }
};

/// Fails unless attending `windowed` (the last token's row) gives what
/// attending exactly its window's tokens, contiguous, gives.
template <storage_element T>
void check_window(const basic_kv_snapshot<T>& windowed, const token_rows& rows, std::size_t window,
                  std::size_t block_tokens) {
  const std::size_t width = rows.width, n = windowed.size();
  // It holds at most ceil(W / B) + 1 blocks: kept_from() is no further back.
  if (windowed.window() != window || windowed.kept_from() + (blocks_of(window, block_tokens) + 1) * block_tokens < n)
    fail("attend_window", "the windowed layer holds from position " + std::to_string(windowed.kept_from()) + " of " +
                              std::to_string(n) + " with a window of " + std::to_string(windowed.window()));
  const std::size_t stored = width / elements_per<T>;  // Ts per token
  std::vector<T> keys(window * stored), values(window * stored);
  for (std::size_t i = 0; i < window; ++i) {
    const std::size_t p = (n - window + i) % chunk_tokens;
    convert<T, float>(rows.keys_of(p, 1), keys.data() + i * stored);
    convert<T, float>(rows.values_of(p, 1), values.data() + i * stored);
  }
  decode_row paged, flat;
  paged.attend(windowed);
  flat.attend(std::span<const T>(keys), std::span<const T>(values));
  for (std::size_t i = 0; i < flat.out.size(); ++i)
    if (std::abs(paged.out[i] - flat.out[i]) > 1e-5f * (1 + std::abs(flat.out[i])))
      fail("attend_window", "the windowed layer's attention differs from its window's at output " + std::to_string(i) +
                                ": " + std::to_string(paged.out[i]) + " against " + std::to_string(flat.out[i]));
}

template <storage_element T>
void run_attend_window(const options& o, report& out) {
  const std::size_t n = window_context(o), window = window_of(o);
  const kv_cache_config config{.max_tokens_per_seq = n,
                               .num_heads = llama_shape.kv_heads,
                               .head_dim = llama_shape.head_dim,
                               .block_tokens = o.block_tokens};
  const token_rows rows(config.token_width(), chunk_tokens);
  asio::thread_pool threads(o.threads);
  // Layer 0 slides over the window, layer 1 keeps every token.
  const basic_sequence_kv_cache<T> seq(threads, kv_model_layout::interleaved(2, 2, window), config);
  grow(seq, rows, n);
  const auto snap = seq.snapshot();
  check_window(snap.layer(0), rows, window, o.block_tokens);
  out.run("attend_window", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "1 steps", "attention, " + std::to_string(n) + " tokens", "steps/s");
    metric& ratio = declare(m, "2 ratio", "windowed / full layer", "x");
    decode_row row;
    rate.values["ghostlink"] = ops_per_second(o.seconds, [&](std::size_t) { row.attend(snap.layer(0)); });
    rate.values["full_layer"] = ops_per_second(o.seconds, [&](std::size_t) { row.attend(snap.layer(1)); });
    ratio.values["ghostlink"] = rate.values["ghostlink"] / rate.values["full_layer"];
  });
  out.add_note("attend_window",
               "ghostlink: one decode row (32 query heads over 8 KV heads x 128, " + o.element + ") over a layer of " +
                   std::to_string(n) + " tokens with a " + std::to_string(window) +
                   "-token window; full_layer: the same row over a full layer of the same sequence; one thread; "
                   "the windowed result checked against attend over exactly its window's tokens");
}

// --- decode_hybrid ---

/// Decode steps [seq.size(), seq.size() + o.steps) through sequence steps:
/// each layer's token written, then attended with the step's snapshot.
template <storage_element T>
asio::awaitable<void> forward_passes(const options& o, const basic_sequence_kv_cache<T>& seq,
                                     const std::vector<token>& data) {
  attention a(o.heads, o.head_dim);
  for (std::size_t step = 0; step < o.steps; ++step) {
    const auto open = co_await seq.async_begin_step(1, asio::use_awaitable);
    for (std::size_t l = 0; l < seq.num_layers(); ++l) {
      if (const std::error_code ec = open.write(l, data[step].keys, data[step].values))
        throw std::system_error(ec, "write");
      a.over(open.snapshot(l));
      keep(a.checksum());
    }
    co_await open.async_commit(asio::use_awaitable);
  }
}

/// Laps of o.steps decode steps of a fork of each of `prompts` (forked
/// untimed), one coroutine per sequence; steps per second of decoding.
template <storage_element T>
double decode_steps_per_second(const options& o, asio::thread_pool& threads,
                               const std::vector<basic_sequence_kv_cache<T>>& prompts, const std::vector<token>& data) {
  return double(o.steps) * laps_per_second(o.seconds, [&] {
           std::vector<basic_sequence_kv_cache<T>> seqs;
           seqs.reserve(prompts.size());
           for (const auto& p : prompts) seqs.push_back(p.async_fork(asio::use_future).get());
           const auto t0 = clock_type::now();
           std::vector<std::future<void>> running;
           running.reserve(seqs.size());
           for (const auto& s : seqs)
             running.push_back(asio::co_spawn(threads, forward_passes(o, s, data), asio::use_future));
           for (auto& f : running) f.get();
           return seconds_since(t0);
         });
}

template <storage_element T>
void run_decode_hybrid(const options& o, report& out) {
  kv_cache_config config = o.config();
  config.max_tokens_per_seq = o.tokens + o.steps;
  const token_rows rows(config.token_width(), chunk_tokens);
  const std::vector<token> data = tokens_for(o, o.steps);
  asio::thread_pool threads(o.threads);
  const kv_block_pool pool = kv_block_pool::for_caches<T>(config);
  // Each lap decodes forks of these prompts: the same context every lap.
  std::vector<basic_sequence_kv_cache<T>> hybrid, full;
  for (std::size_t s = 0; s < o.threads; ++s) {
    grow(hybrid.emplace_back(threads, hybrid_layout(o), config, pool), rows, o.tokens);
    grow(full.emplace_back(threads, kv_model_layout::full(model_layers), config, pool), rows, o.tokens);
  }
  // A lap of each first, untimed: the pool then holds the blocks a lap takes.
  decode_steps_per_second(o, threads, hybrid, data);
  decode_steps_per_second(o, threads, full, data);
  std::size_t runs = 0;
  out.run("decode_hybrid", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "1 steps", "decode steps, " + std::to_string(o.tokens) + "-token contexts", "steps/s");
    metric& ratio = declare(m, "2 ratio", "interleaved / full layout", "x");
    const bool hybrid_first = runs++ % 2 == 0;  // neither always runs on what the other left
    if (hybrid_first) rate.values["ghostlink"] = decode_steps_per_second(o, threads, hybrid, data);
    rate.values["full_layout"] = decode_steps_per_second(o, threads, full, data);
    if (!hybrid_first) rate.values["ghostlink"] = decode_steps_per_second(o, threads, hybrid, data);
    ratio.values["ghostlink"] = rate.values["ghostlink"] / rate.values["full_layout"];
  });
  hybrid.clear();
  full.clear();
  threads.join();
  out.add_note("decode_hybrid", "ghostlink: interleaved(32, 6, " + std::to_string(window_of(o)) +
                                    "); full_layout: full(32); " + std::to_string(o.threads) + " sequences of " +
                                    std::to_string(o.tokens) + " tokens (" + std::to_string(o.heads) + " heads x " +
                                    std::to_string(o.head_dim) + ", " + o.element +
                                    ") on one pool, forked untimed each lap, then " + std::to_string(o.steps) +
                                    " steps each, one coroutine per sequence on " + std::to_string(o.threads) +
                                    " threads: begin, per layer write() then attend over snapshot(l), "
                                    "commit");
}

}  // namespace

void layout_memory(const options& o, report& out) {
  const std::size_t n = memory_context(o), b = o.block_tokens, window = window_of(o);
  const token_rows rows(memory_config(o).token_width(), chunk_tokens);
  const kv_model_layout hybrid = hybrid_layout(o);
  std::size_t windowed = 0;
  for (const kv_layer_layout& l : hybrid.layers) windowed += l.window != 0 ? 1 : 0;
  // The contract's bound: ceil(W / B) + 1 blocks per windowed layer (no
  // sinks, no rollback), every block of a full one.
  const std::size_t full_blocks = model_layers * blocks_of(n, b);
  const std::size_t bound = windowed * (blocks_of(window, b) + 1) + (model_layers - windowed) * blocks_of(n, b);
  out.run("layout_memory", o, [&](std::map<std::string, metric>& m) {
    metric& blocks = declare(m, "1 blocks", "blocks held at " + std::to_string(n) + " tokens", "blocks", false);
    metric& bytes = declare(m, "2 bytes", "their bytes", "bytes", false);
    metric& allocated = declare(m, "3 allocated", "memory the pool holds", "bytes", false);
    metric& peak = declare(m, "4 peak", "most blocks held while growing", "blocks", false);
    metric& ratio = declare(m, "5 ratio", "interleaved / full blocks held", "x", false);
    const kv_pool_stats mine = held_after_growing(o, hybrid, rows);
    const kv_pool_stats theirs = held_after_growing(o, kv_model_layout::full(model_layers), rows);
    if (mine.blocks_in_use > bound)
      fail("layout_memory", "the interleaved sequence holds " + std::to_string(mine.blocks_in_use) +
                                " blocks, above the contract's " + std::to_string(bound));
    if (theirs.blocks_in_use != full_blocks)
      fail("layout_memory", "the full sequence holds " + std::to_string(theirs.blocks_in_use) + " blocks, not " +
                                std::to_string(full_blocks));
    blocks.values["ghostlink"] = double(mine.blocks_in_use);
    blocks.values["full_layout"] = double(theirs.blocks_in_use);
    blocks.values["bound"] = double(bound);
    bytes.values["ghostlink"] = double(mine.bytes_in_use());
    bytes.values["full_layout"] = double(theirs.bytes_in_use());
    allocated.values["ghostlink"] = double(mine.bytes_allocated);
    allocated.values["full_layout"] = double(theirs.bytes_allocated);
    peak.values["ghostlink"] = double(mine.peak_blocks_in_use);
    peak.values["full_layout"] = double(theirs.peak_blocks_in_use);
    ratio.values["ghostlink"] = double(mine.blocks_in_use) / double(theirs.blocks_in_use);
    ratio.values["bound"] = double(bound) / double(full_blocks);
  });
  out.add_note("layout_memory",
               "ghostlink: interleaved(32, 6, " + std::to_string(window) + "), full_layout: full(32), each grown to " +
                   std::to_string(n) + " tokens on a pool of its own (half, 2 heads x 64, " + std::to_string(b) +
                   "-token blocks, 256-token appends); bound: the contract's most blocks, ceil(W/B) + 1 per "
                   "windowed layer");
}

void attend_window(const options& o, report& out) {
  with_element(o, [&]<storage_element T>() { run_attend_window<T>(o, out); });
}

void decode_hybrid(const options& o, report& out) {
  with_element(o, [&]<storage_element T>() { run_decode_hybrid<T>(o, out); });
}

}  // namespace ghostlink::bench
