// Keys-only latent layers (issue 44): DeepSeek V3's shape, one stored head of
// 576 (a 512-element latent and a 64-element RoPE key) per token and layer,
// no values.
// - latent_memory: a 4-layer keys-only sequence grown to --tokens (8,192)
//   tokens against the same vectors stored as keys and values (a layout
//   without keys_only, the values a copy), each on a pool of its own, half
//   storage: the bytes the pool's blocks hold, and the ratio (the contract:
//   at most 0.51).
// - attend_latent: one decode row's attention (ghostlink::attend, 128
//   query heads over the one stored head, value_dim 512) over a keys-only
//   layer of 4,096 and 32,768 tokens, in tokens attended per second on one
//   thread; kv_same_bytes: the same bytes a token stored as keys and values
//   (one head of 288 each, 128 query heads of 288), the kernel's speed over
//   that many bytes: an upper bound to report, not a target.
// --quick: 512 and 1,024 tokens.
#include <ghostlink/kv_cache.hpp>

#include <asio/thread_pool.hpp>
#include <asio/use_future.hpp>

#include <algorithm>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

constexpr std::size_t latent_width = 576, latent_value = 512, latent_query_heads = 128;
constexpr std::size_t chunk_tokens = 256;  // tokens per append while a sequence grows

kv_cache_config latent_config(std::size_t tokens, std::size_t head_dim, std::size_t block_tokens) {
  return {.max_tokens_per_seq = tokens, .num_heads = 1, .head_dim = head_dim, .block_tokens = block_tokens};
}

/// Appends `rows`' keys (and, unless keys only, the same as values) to
/// `seq` until it holds `tokens`.
template <storage_element T>
void grow(const basic_sequence_kv_cache<T>& seq, const token_rows& rows, std::size_t tokens, bool keys_only) {
  std::vector<std::span<const float>> keys(seq.num_layers()), values(seq.num_layers());
  while (seq.size() < tokens) {
    const std::size_t n = std::min(chunk_tokens, tokens - seq.size());
    std::fill(keys.begin(), keys.end(), rows.keys_of(0, n));
    std::fill(values.begin(), values.end(), keys_only ? std::span<const float>() : rows.keys_of(0, n));
    seq.async_append(keys, values, asio::use_future).get();
  }
}

/// One decode row's attention of `shape` over `layer`, summed into keep().
template <storage_element T>
void attend_row(const basic_kv_snapshot<T>& layer, const attention_shape& shape, const std::vector<float>& query,
                std::vector<float>& out) {
  if (const std::error_code ec = ghostlink::attend(layer, query, out, shape))
    throw std::system_error(ec, "ghostlink::attend");
  float s = 0;
  for (float x : out) s += x;
  keep(s);
}

}  // namespace

void latent_memory(const options& o, report& out) {
  const std::size_t n = o.quick ? 512 : o.tokens, layers = 4;
  const kv_cache_config config = latent_config(n, latent_width, o.block_tokens);
  const token_rows rows(latent_width, chunk_tokens);
  const auto held = [&](bool keys_only) {
    asio::thread_pool threads(o.threads);
    const kv_block_kind kind = keys_only ? kv_block_kind::keys_only : kv_block_kind::keys_and_values;
    const kv_block_pool pool = kv_block_pool::for_caches<half>(config, kind);
    kv_model_layout layout = kv_model_layout::full(layers);
    layout.keys_only = keys_only;
    kv_pool_stats s;
    {
      const basic_sequence_kv_cache<half> seq(threads, layout, config, pool);
      grow(seq, rows, n, keys_only);
      s = pool.stats();
    }
    threads.join();
    return s;
  };
  out.run("latent_memory", o, [&](std::map<std::string, metric>& m) {
    metric& bytes = declare(m, "1 bytes", "bytes of blocks held at " + std::to_string(n) + " tokens", "bytes", false);
    metric& ratio = declare(m, "2 ratio", "keys only / keys and values", "x", false);
    const kv_pool_stats mine = held(true), theirs = held(false);
    if (mine.blocks_in_use != theirs.blocks_in_use)
      fail("latent_memory", "the keys-only sequence holds " + std::to_string(mine.blocks_in_use) + " blocks, not " +
                                std::to_string(theirs.blocks_in_use));
    bytes.values["ghostlink"] = double(mine.bytes_in_use());
    bytes.values["keys_and_values"] = double(theirs.bytes_in_use());
    ratio.values["ghostlink"] = double(mine.bytes_in_use()) / double(theirs.bytes_in_use());
  });
  out.add_note("latent_memory", "ghostlink: 4 layers of keys_only, one head of 576 (half), " + std::to_string(n) +
                                    " tokens, " + std::to_string(o.block_tokens) +
                                    "-token blocks; keys_and_values: the same vectors as keys and values (full(4))");
}

void attend_latent(const options& o, report& out) {
  const std::vector<std::size_t> lengths =
      o.quick ? std::vector<std::size_t>{1024} : std::vector<std::size_t>{4096, 32768};
  const attention_shape mla{
      .query_heads = latent_query_heads, .kv_heads = 1, .head_dim = latent_width, .value_dim = latent_value};
  const attention_shape same_bytes{.query_heads = latent_query_heads, .kv_heads = 1, .head_dim = latent_width / 2};
  asio::thread_pool threads(o.threads);
  for (const std::size_t n : lengths) {
    const token_rows rows(latent_width, chunk_tokens), half_rows(latent_width / 2, chunk_tokens);
    kv_model_layout keys_only = kv_model_layout::full(1);
    keys_only.keys_only = true;
    const basic_sequence_kv_cache<half> latent(threads, keys_only, latent_config(n, latent_width, o.block_tokens));
    const basic_sequence_kv_cache<half> kv(threads, kv_model_layout::full(1),
                                           latent_config(n, latent_width / 2, o.block_tokens));
    grow(latent, rows, n, true);
    grow(kv, half_rows, n, false);
    const auto latent_snap = latent.snapshot(), kv_snap = kv.snapshot();
    std::vector<float> q(latent_query_heads * latent_width), q_half(latent_query_heads * latent_width / 2);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = query_value(i);
    for (std::size_t i = 0; i < q_half.size(); ++i) q_half[i] = query_value(i);
    std::vector<float> o_latent(latent_query_heads * latent_value), o_half(q_half.size());
    const std::string name = "attend_latent_" + std::to_string(n / 1024) + "k";
    out.run(name, o, [&](std::map<std::string, metric>& m) {
      metric& rate = declare(m, "1 tokens", "tokens attended, " + std::to_string(n) + "-token layer", "tokens/s");
      metric& ratio = declare(m, "2 ratio", "keys only / the same bytes as keys and values", "x");
      rate.values["ghostlink"] = double(n) * ops_per_second(o.seconds, [&](std::size_t) {
                                   attend_row(latent_snap.layer(0), mla, q, o_latent);
                                 });
      rate.values["kv_same_bytes"] = double(n) * ops_per_second(o.seconds, [&](std::size_t) {
                                       attend_row(kv_snap.layer(0), same_bytes, q_half, o_half);
                                     });
      ratio.values["ghostlink"] = rate.values["ghostlink"] / rate.values["kv_same_bytes"];
    });
    out.add_note(name, "ghostlink: one decode row, 128 query heads over one keys-only head of 576 (half), value_dim "
                       "512, " +
                           std::to_string(n) +
                           " tokens; kv_same_bytes: 128 query heads over one head of 288 keys and 288 values (the "
                           "same bytes a token); one thread");
  }
  threads.join();
}

}  // namespace ghostlink::bench
