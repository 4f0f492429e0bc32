// attend: one decode step's attention (one query row, --heads heads of
// --head-dim) over N tokens, N = 1024 and --tokens (8192), for float, half
// and bfloat16 storage; tokens attended per second, on one thread:
// - ghostlink: ghostlink::attend over a snapshot's blocks (--block-tokens);
// - contiguous: ghostlink::attend over one contiguous buffer;
// - per_token_kernel: the benchmark's kernel before ghostlink::attend
//   (bench/attention.hpp: AVX2 where the processor has it, rescaling every
//   head's output at every token) over one contiguous buffer;
// - scalar: a plain scalar two-pass loop over one contiguous buffer.
#include <ghostlink/kv_cache.hpp>

#include <asio/io_context.hpp>

#include <string>

#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

/// softmax(q . k / sqrt(d)) . v per head, scalar: logits, max, weights, sum.
template <class T>
float scalar_attention(const options& o, std::size_t n, const std::vector<T>& keys, const std::vector<T>& values,
                       std::vector<float>& logits) {
  const std::size_t width = o.heads * o.head_dim;
  const float scale = 1.0f / std::sqrt(float(o.head_dim));
  float check = 0;
  logits.resize(n);
  for (std::size_t h = 0; h < o.heads; ++h) {
    float top = -INFINITY;
    for (std::size_t t = 0; t < n; ++t) {
      float dot = 0;
      for (std::size_t i = 0; i < o.head_dim; ++i)
        dot += query_value(h * o.head_dim + i) * static_cast<float>(keys[t * width + h * o.head_dim + i]);
      top = std::max(top, logits[t] = dot * scale);
    }
    float sum = 0;
    for (std::size_t t = 0; t < n; ++t) sum += (logits[t] = std::exp(logits[t] - top));
    for (std::size_t i = 0; i < o.head_dim; ++i) {
      float out = 0;
      for (std::size_t t = 0; t < n; ++t) out += logits[t] * static_cast<float>(values[t * width + h * o.head_dim + i]);
      check += out / sum;
    }
  }
  return check;
}

template <storage_element T>
void measure(const options& o, std::size_t n, metric& rate) {
  const std::size_t width = o.config().token_width();
  const std::vector<token> data = tokens_for(o, n);
  const std::vector<kv_write> batch = writes_of(data, 0, n);
  std::vector<T> keys(n * width), values(n * width);  // the same tokens, contiguous, stored as T
  for (std::size_t i = 0; i < n; ++i) {
    convert<T, float>(data[i].keys, keys.data() + i * width);
    convert<T, float>(data[i].values, values.data() + i * width);
  }
  const auto tokens_per_second = [&](auto step) { return double(n) * ops_per_second(o.seconds, step); };

  if (o.wants("ghostlink")) {
    asio::io_context io;
    kv_cache_config config = o.config();
    config.max_tokens_per_seq = n;
    basic_layer_kv_cache<T> cache(io, config);
    cache.async_initialize(1, [](std::error_code) {});
    cache.async_write_batch(batch, [](std::error_code) {});
    io.run();
    const auto snap = cache.snapshot();
    attention a(o.heads, o.head_dim);
    rate.values["ghostlink"] = tokens_per_second([&](std::size_t) {
      a.over(snap);
      keep(a.checksum());
    });
    rate.values["contiguous"] = tokens_per_second([&](std::size_t) {
      a.over(std::span<const T>(keys), std::span<const T>(values));
      keep(a.checksum());
    });
  }
  rate.values["per_token_kernel"] = tokens_per_second([&](std::size_t) {
    per_token_kernel a(o.heads, o.head_dim);
    a.add(n, std::span<const T>(keys), std::span<const T>(values));
    keep(a.checksum());
  });
  std::vector<float> logits;
  rate.values["scalar"] = tokens_per_second([&](std::size_t) { keep(scalar_attention(o, n, keys, values, logits)); });
}

}  // namespace

void attend_kernel(const options& o, report& out) {
  std::vector<std::size_t> lengths{std::min<std::size_t>(1024, o.tokens)};
  if (o.tokens != lengths[0]) lengths.push_back(o.tokens);
  out.run("attend", o, [&](std::map<std::string, metric>& m) {
    for (const std::size_t n : lengths) {
      const auto add = [&](const std::string& element, auto tag) {
        metric& rate =
            declare(m, element + " " + std::to_string(n), element + ", " + std::to_string(n) + " tokens", "tokens/s");
        measure<decltype(tag)>(o, n, rate);
      };
      add("float", float{});
      add("half", half{});
      add("bfloat16", bfloat16{});
    }
  });
  out.add_note("attend",
               "one thread; ghostlink: ghostlink::attend over a snapshot's blocks; contiguous: the same over one "
               "buffer; per_token_kernel: the benchmark's previous AVX2 kernel over one buffer; scalar: a plain loop");
}

}  // namespace ghostlink::bench
