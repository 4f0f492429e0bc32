// KV in 8 and 4 bits (issue 45): q8_0, q4_0 and fp8_e4m3 against half, the
// same tokens, in the same run. The shape is a Llama-3-8B layer: 8 KV heads
// of 128.
// - quantized_memory: the pool bytes a layer cache holds for --tokens
//   (8,192) tokens, per token, and the ratio to half (the contract: q8_0 at
//   most 0.54x, q4_0 at most 0.29x, fp8 0.5x).
// - attend_quantized_{1k,32k}: one decode row's attention (ghostlink::attend)
//   over a layer of 1,024 and 32,768 tokens, one thread, tokens attended
//   per second: 8 query heads (one per KV head: memory-bound at 32k, whose
//   half layer is 128 MiB, far past the caches) and, _gqa, Llama's 32 (more
//   compute per byte). Ratios to half (the contract at 32k, 8 query heads:
//   q8_0 and fp8 at least 1.3x, q4_0 at least 1.5x).
// - write_quantized: the tokens per second a prefill of 4,096 tokens in
//   appends of 512 writes into a fresh sequence of one layer (quantizing
//   on the writer's thread), and single-token decode writes; ratios to half
//   (the contract: prefill at least 1/1.5 of half's).
// --quick: 256 and 1,024 tokens, short phases.
#include <ghostlink/kv_cache.hpp>

#include <asio/io_context.hpp>
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

constexpr std::size_t llama_kv_heads = 8, llama_head_dim = 128, llama_query_heads = 32;
constexpr std::size_t prefill_chunk = 512;

kv_cache_config llama_layer(std::size_t tokens, std::size_t block_tokens) {
  return {.max_tokens_per_seq = tokens,
          .num_heads = llama_kv_heads,
          .head_dim = llama_head_dim,
          .block_tokens = block_tokens};
}

/// A one-layer sequence of `T` holding `rows`' first `tokens` tokens.
template <storage_element T>
basic_sequence_kv_cache<T> filled(asio::thread_pool& threads, const kv_cache_config& config, const token_rows& rows,
                                  std::size_t tokens) {
  basic_sequence_kv_cache<T> seq(threads, kv_model_layout::full(1), config);
  for (std::size_t first = 0; first < tokens; first += prefill_chunk) {
    const std::size_t n = std::min(prefill_chunk, tokens - first);
    const std::span<const float> keys[] = {rows.keys_of(0, n)};
    const std::span<const float> values[] = {rows.values_of(0, n)};
    seq.async_append(keys, values, asio::use_future).get();
  }
  return seq;
}

/// Calls `f.template operator()<T>(name)` for half and each quantized type.
template <class F>
void for_each_type(F&& f) {
  f.template operator()<half>("half");
  f.template operator()<q8_0>("q8_0");
  f.template operator()<fp8_e4m3>("fp8_e4m3");
  f.template operator()<q4_0>("q4_0");
}

/// Every value of `m` divided by its "half" value, into `ratio`.
void ratios_to_half(const metric& m, metric& ratio) {
  for (const auto& [name, value] : m.values)
    if (name != "half") ratio.values[name] = value / m.values.at("half");
}

}  // namespace

void quantized_memory(const options& o, report& out) {
  const std::size_t n = o.quick ? 1024 : o.tokens;
  const kv_cache_config config = llama_layer(n, o.block_tokens);
  const token_rows rows(config.token_width(), prefill_chunk);
  out.run("quantized_memory", o, [&](std::map<std::string, metric>& m) {
    metric& bytes = declare(m, "1 bytes", "pool bytes per token held", "bytes", false);
    metric& ratio = declare(m, "2 ratio", "per token, to half", "x", false);
    asio::thread_pool threads(o.threads);
    for_each_type([&]<storage_element T>(const char* name) {
      const basic_sequence_kv_cache<T> seq = filled<T>(threads, config, rows, n);
      bytes.values[name] = double(seq.pool().stats().bytes_in_use()) / double(n);
    });
    threads.join();
    ratios_to_half(bytes, ratio);
  });
  out.add_note("quantized_memory", "one layer of 8 KV heads x 128, " + std::to_string(n) + " tokens, " +
                                       std::to_string(o.block_tokens) + "-token blocks, each type on its own pool");
}

void attend_quantized(const options& o, report& out) {
  const std::vector<std::size_t> lengths =
      o.quick ? std::vector<std::size_t>{256} : std::vector<std::size_t>{1024, 32768};
  const token_rows rows(llama_kv_heads * llama_head_dim, prefill_chunk);
  asio::thread_pool threads(o.threads);
  for (const std::size_t n : lengths) {
    const kv_cache_config config = llama_layer(n, o.block_tokens);
    for (const std::size_t query_heads : {llama_kv_heads, llama_query_heads}) {
      const attention_shape shape{.query_heads = query_heads, .kv_heads = llama_kv_heads, .head_dim = llama_head_dim};
      std::vector<float> q(query_heads * llama_head_dim), result(q.size());
      for (std::size_t i = 0; i < q.size(); ++i) q[i] = query_value(i);
      const std::string name = "attend_quantized_" + (n >= 1024 ? std::to_string(n / 1024) + "k" : std::to_string(n)) +
                               (query_heads == llama_kv_heads ? "" : "_gqa");
      out.run(name, o, [&](std::map<std::string, metric>& m) {
        metric& rate = declare(m, "1 tokens", "tokens attended", "tokens/s");
        metric& ratio = declare(m, "2 ratio", "to half", "x");
        for_each_type([&]<storage_element T>(const char* type) {
          const basic_sequence_kv_cache<T> seq = filled<T>(threads, config, rows, n);
          const auto snap = seq.snapshot();
          rate.values[type] = double(n) * ops_per_second(o.seconds, [&](std::size_t) {
                                if (const std::error_code ec = ghostlink::attend(snap.layer(0), q, result, shape))
                                  throw std::system_error(ec, "ghostlink::attend");
                                keep(result[0] + result[result.size() - 1]);
                              });
        });
        ratios_to_half(rate, ratio);
      });
      out.add_note(name, "one decode row, " + std::to_string(query_heads) + " query heads over 8 KV heads x 128, " +
                             std::to_string(n) + " tokens, one thread; half: the same tokens in half");
    }
  }
  threads.join();
}

void write_quantized(const options& o, report& out) {
  const std::size_t n = o.quick ? 1024 : 4096;
  const kv_cache_config config = llama_layer(n, o.block_tokens);
  const token_rows rows(config.token_width(), prefill_chunk);
  out.run("write_quantized", o, [&](std::map<std::string, metric>& m) {
    metric& prefill = declare(m, "1 prefill", "tokens written, appends of 512", "tokens/s");
    metric& decode = declare(m, "2 decode", "single-token writes", "tokens/s");
    metric& prefill_ratio = declare(m, "3 prefill ratio", "prefill, to half", "x");
    metric& decode_ratio = declare(m, "4 decode ratio", "decode, to half", "x");
    asio::thread_pool threads(1);
    for_each_type([&]<storage_element T>(const char* type) {
      prefill.values[type] = double(n) * laps_per_second(o.seconds, [&] {
                               basic_sequence_kv_cache<T> seq(threads, kv_model_layout::full(1), config);
                               const auto t0 = clock_type::now();
                               for (std::size_t first = 0; first < n; first += prefill_chunk) {
                                 const std::span<const float> keys[] = {rows.keys_of(0, prefill_chunk)};
                                 const std::span<const float> values[] = {rows.values_of(0, prefill_chunk)};
                                 seq.async_append(keys, values, asio::use_future).get();
                               }
                               return seconds_since(t0);
                             });
      asio::io_context io;
      basic_layer_kv_cache<T> cache(io, config);
      cache.async_initialize(1, [](std::error_code) {});
      io.run();
      decode.values[type] = ops_per_second(o.seconds, [&](std::size_t i) {
        io.restart();
        cache.async_write(i % n, rows.keys_of(i % prefill_chunk, 1), rows.values_of(i % prefill_chunk, 1),
                          [](std::error_code ec) {
                            if (ec) throw std::system_error(ec, "async_write");
                          });
        io.run();
      });
    });
    threads.join();
    ratios_to_half(prefill, prefill_ratio);
    ratios_to_half(decode, decode_ratio);
  });
  out.add_note("write_quantized", "one layer of 8 KV heads x 128: a fresh sequence prefilled with " +
                                      std::to_string(n) +
                                      " tokens in appends of 512 (one thread), and single-token writes to a "
                                      "layer cache run inline; each type quantizes on the writer's thread");
}

}  // namespace ghostlink::bench
