#pragma once
// A small Llama-style decoder with random weights from a fixed seed:
// token embedding, then per layer RMSNorm, grouped-query attention with
// rotary position embeddings (RoPE), a residual, RMSNorm, a SwiGLU
// feed-forward block and a residual; a final RMSNorm and the output
// projection to logits. Plain C++ the compiler vectorises. The attention
// is forward()'s (ghostlink::attend over a sequence's KV cache, one step
// per forward pass, each layer masked as the sequence's layout says) or
// recompute()'s (no cache at all, each layer masked as the kv_model_layout
// it is given says: every earlier token, or a window and sinks), which
// checks it.
// Shared by serving_loop and prefix_reuse.

#include <ghostlink/kv_cache.hpp>

#include <asio/awaitable.hpp>
#include <asio/use_awaitable.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <stdexcept>
#include <system_error>
#include <vector>

namespace tiny_llama {

struct dims {
  std::size_t vocab = 512, model = 256, layers = 8;
  std::size_t query_heads = 8, kv_heads = 2, head_dim = 32, ffn = 512;
  float norm_eps = 1e-5f, rope_theta = 10000.0f;

  std::size_t q_width() const { return query_heads * head_dim; }
  std::size_t kv_width() const { return kv_heads * head_dim; }
};

/// A row-major `rows x cols` matrix.
struct matrix {
  std::size_t rows = 0, cols = 0;
  std::vector<float> w;

  /// y = W x.
  void apply(const float* x, float* y) const {
    for (std::size_t r = 0; r < rows; ++r) {
      const float* row = w.data() + r * cols;
      float part[8] = {};
      std::size_t i = 0;
      for (; i + 8 <= cols; i += 8)
        for (std::size_t j = 0; j < 8; ++j) part[j] += row[i + j] * x[i + j];
      float s = 0;
      for (; i < cols; ++i) s += row[i] * x[i];
      for (float p : part) s += p;
      y[r] = s;
    }
  }
};

struct layer_weights {
  std::vector<float> attn_norm, ffn_norm;
  matrix wq, wk, wv, wo, gate, up, down;
};

/// The scratch of one token's pass through one layer.
struct token_scratch {
  std::vector<float> h, attn_proj, gate, up;
  explicit token_scratch(const dims& d) : h(d.model), attn_proj(d.model), gate(d.ffn), up(d.ffn) {}
};

class model {
 public:
  explicit model(const dims& d, std::uint64_t seed = 2026) : d_(d) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    const auto fill = [&](std::size_t rows, std::size_t cols) {
      matrix m{rows, cols, std::vector<float>(rows * cols)};
      const float scale = std::sqrt(3.0f / static_cast<float>(cols));  // unit variance out of unit variance in
      for (float& x : m.w) x = unit(rng) * scale;
      return m;
    };
    const auto norm = [&] {
      std::vector<float> g(d.model);
      for (float& x : g) x = 1.0f + 0.1f * unit(rng);
      return g;
    };
    embed_.resize(d.vocab * d.model);
    for (float& x : embed_) x = unit(rng);
    for (std::size_t l = 0; l < d.layers; ++l)
      layers_.push_back({norm(), norm(), fill(d.q_width(), d.model), fill(d.kv_width(), d.model),
                         fill(d.kv_width(), d.model), fill(d.model, d.q_width()), fill(d.ffn, d.model),
                         fill(d.ffn, d.model), fill(d.model, d.ffn)});
    final_norm_ = norm();
    output_ = fill(d.vocab, d.model);
    for (std::size_t i = 0; i < d.head_dim / 2; ++i)
      rope_freq_.push_back(std::pow(double(d.rope_theta), -2.0 * double(i) / double(d.head_dim)));
  }

  const dims& shape() const { return d_; }

  /// The residual stream of `token` before the first layer.
  void embed(std::int32_t token, float* x) const {
    std::copy_n(embed_.data() + static_cast<std::size_t>(token) * d_.model, d_.model, x);
  }

  /// Layer `l`'s attention inputs for the token at `pos` with residual `x`:
  /// the query (`q_width()` floats) and the key and value (`kv_width()`
  /// each), RoPE applied to the query and the key.
  void qkv(std::size_t l, const float* x, std::size_t pos, float* q, float* k, float* v, token_scratch& s) const {
    const layer_weights& w = layers_[l];
    rms_norm(x, w.attn_norm.data(), s.h.data());
    w.wq.apply(s.h.data(), q);
    w.wk.apply(s.h.data(), k);
    w.wv.apply(s.h.data(), v);
    rope(q, d_.query_heads, pos);
    rope(k, d_.kv_heads, pos);
  }

  /// The rest of layer `l` once its attention output `attn` (`q_width()`
  /// floats) is known: the output projection and the feed-forward block,
  /// each added to the residual `x`.
  void finish_layer(std::size_t l, const float* attn, float* x, token_scratch& s) const {
    const layer_weights& w = layers_[l];
    w.wo.apply(attn, s.attn_proj.data());
    for (std::size_t i = 0; i < d_.model; ++i) x[i] += s.attn_proj[i];
    rms_norm(x, w.ffn_norm.data(), s.h.data());
    w.gate.apply(s.h.data(), s.gate.data());
    w.up.apply(s.h.data(), s.up.data());
    for (std::size_t i = 0; i < d_.ffn; ++i) s.gate[i] = s.gate[i] / (1.0f + std::exp(-s.gate[i])) * s.up[i];
    w.down.apply(s.gate.data(), s.attn_proj.data());
    for (std::size_t i = 0; i < d_.model; ++i) x[i] += s.attn_proj[i];
  }

  /// The logits (`vocab` floats) of the residual `x` after the last layer.
  void logits(const float* x, float* out, token_scratch& s) const {
    rms_norm(x, final_norm_.data(), s.h.data());
    output_.apply(s.h.data(), out);
  }

 private:
  void rms_norm(const float* x, const float* gain, float* y) const {
    float ss = 0;
    for (std::size_t i = 0; i < d_.model; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d_.model) + d_.norm_eps);
    for (std::size_t i = 0; i < d_.model; ++i) y[i] = x[i] * inv * gain[i];
  }

  /// Rotates each head's pairs (2i, 2i + 1) by pos * theta^(-2i / head_dim).
  void rope(float* v, std::size_t heads, std::size_t pos) const {
    for (std::size_t h = 0; h < heads; ++h)
      for (std::size_t i = 0; i < d_.head_dim / 2; ++i) {
        const double angle = double(pos) * rope_freq_[i];
        const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
        float* p = v + h * d_.head_dim + 2 * i;
        const float a = p[0], b = p[1];
        p[0] = a * c - b * s;
        p[1] = a * s + b * c;
      }
  }

  dims d_;
  std::vector<float> embed_;
  std::vector<layer_weights> layers_;
  std::vector<float> final_norm_;
  matrix output_;
  std::vector<double> rope_freq_;  // theta^(-2i / head_dim)
};

/// Whether a query at position `p` attends position `j` in a layer of
/// `layer`'s layout: `j <= p`, and with a window, `j` is a sink
/// (`j < sink_tokens`) or within it (`j > p - window`).
inline bool attends(const ghostlink::kv_layer_layout& layer, std::size_t p, std::size_t j) {
  return j <= p && (layer.window == 0 || j < layer.sink_tokens || j + layer.window > p);
}

/// The logits of every position of `tokens` from `from` on, computed with
/// no cache: every layer's keys and values for the whole prefix, then a
/// plain two-pass softmax in double precision per position and head over
/// the positions the layer's mask in `layout` lets it attend (`attends`).
/// @throws std::invalid_argument if `layout` has not one layer per model layer.
inline std::vector<std::vector<float>> recompute(const model& m, std::span<const std::int32_t> tokens, std::size_t from,
                                                 const ghostlink::kv_model_layout& layout) {
  const dims& d = m.shape();
  if (layout.num_layers() != d.layers) throw std::invalid_argument("tiny_llama::recompute: a layout of other layers");
  const std::size_t n = tokens.size(), group = d.query_heads / d.kv_heads;
  token_scratch s(d);
  std::vector<std::vector<float>> x(n, std::vector<float>(d.model));
  for (std::size_t p = 0; p < n; ++p) m.embed(tokens[p], x[p].data());
  std::vector<float> q(n * d.q_width()), k(n * d.kv_width()), v(n * d.kv_width()), attn(d.q_width());
  std::vector<std::size_t> seen;  // the positions one row attends
  for (std::size_t l = 0; l < d.layers; ++l) {
    for (std::size_t p = 0; p < n; ++p)
      m.qkv(l, x[p].data(), p, &q[p * d.q_width()], &k[p * d.kv_width()], &v[p * d.kv_width()], s);
    for (std::size_t p = 0; p < n; ++p) {
      seen.clear();
      for (std::size_t j = 0; j <= p; ++j)
        if (attends(layout.layers[l], p, j)) seen.push_back(j);
      for (std::size_t h = 0; h < d.query_heads; ++h) {
        const float* qh = &q[p * d.q_width() + h * d.head_dim];
        const std::size_t kv = (h / group) * d.head_dim;
        std::vector<double> w(seen.size());
        for (std::size_t a = 0; a < seen.size(); ++a) {
          double dot = 0;
          for (std::size_t i = 0; i < d.head_dim; ++i) dot += double(qh[i]) * k[seen[a] * d.kv_width() + kv + i];
          w[a] = dot / std::sqrt(double(d.head_dim));
        }
        const double top = *std::max_element(w.begin(), w.end());
        double sum = 0;
        for (double& e : w) sum += (e = std::exp(e - top));
        for (std::size_t i = 0; i < d.head_dim; ++i) {
          double o = 0;
          for (std::size_t a = 0; a < seen.size(); ++a) o += w[a] * v[seen[a] * d.kv_width() + kv + i];
          attn[h * d.head_dim + i] = static_cast<float>(o / sum);
        }
      }
      m.finish_layer(l, attn.data(), x[p].data(), s);
    }
  }
  std::vector<std::vector<float>> out;
  for (std::size_t p = from; p < n; ++p) {
    out.emplace_back(d.vocab);
    m.logits(x[p].data(), out.back().data(), s);
  }
  return out;
}

/// As above with every layer attending every earlier token (a causal
/// softmax over the whole prefix: `kv_model_layout::full`).
inline std::vector<std::vector<float>> recompute(const model& m, std::span<const std::int32_t> tokens,
                                                 std::size_t from) {
  return recompute(m, tokens, from, ghostlink::kv_model_layout::full(m.shape().layers));
}

/// The logits of each of `ids`, fed to `seq` at positions `seq.size()` on
/// (0 for a new sequence, the attached length for one a prefix cache
/// attached), which become part of the sequence: one step
/// (`async_begin_step`) of `ids.size()` causal rows, a prefill chunk or a
/// decode step. Layer by layer it computes the new tokens' queries, keys
/// and values, starts the layer's write without awaiting it, and attends
/// (ghostlink::attend) over the layer's tokens before the step with its own
/// tokens pending, within the layer's window and sinks if it has them; the
/// commit awaits the writes once. `m` and `seq` must outlive the returned
/// awaitable. Any element type: a quantized cache stores the keys and
/// values as it quantizes them, and attend reads them in place.
template <ghostlink::storage_element T>
asio::awaitable<std::vector<std::vector<float>>> forward(const model& m,
                                                         const ghostlink::basic_sequence_kv_cache<T>& seq,
                                                         std::vector<std::int32_t> ids) {
  const dims& d = m.shape();
  const std::size_t n = ids.size(), qw = d.q_width(), kvw = d.kv_width();
  auto step = co_await seq.async_begin_step(std::span<const std::int32_t>(ids), asio::use_awaitable);

  std::vector<std::vector<float>> x(n, std::vector<float>(d.model));
  for (std::size_t t = 0; t < n; ++t) m.embed(ids[t], x[t].data());
  std::vector<std::vector<float>> keys(d.layers, std::vector<float>(n * kvw)), values = keys;
  std::vector<float> q(n * qw), attn(n * qw);
  token_scratch s(d);
  const ghostlink::attention_shape shape{.query_heads = d.query_heads, .kv_heads = d.kv_heads, .head_dim = d.head_dim};
  for (std::size_t l = 0; l < d.layers; ++l) {
    for (std::size_t t = 0; t < n; ++t)
      m.qkv(l, x[t].data(), step.index() + t, &q[t * qw], &keys[l][t * kvw], &values[l][t * kvw], s);
    if (auto ec = step.write(l, keys[l], values[l])) throw std::system_error(ec);  // on this thread
    if (auto ec = ghostlink::attend(step.snapshot_before(l), q, attn, shape, {keys[l], values[l]}))
      throw std::system_error(ec);
    for (std::size_t t = 0; t < n; ++t) m.finish_layer(l, &attn[t * qw], x[t].data(), s);
  }
  co_await step.async_commit(asio::use_awaitable);  // one request: every layer's tokens at once

  std::vector<std::vector<float>> logits(n, std::vector<float>(d.vocab));
  for (std::size_t t = 0; t < n; ++t) m.logits(x[t].data(), logits[t].data(), s);
  co_return logits;
}

/// The most likely token.
inline std::int32_t greedy(const std::vector<float>& logits) {
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

/// A draw from softmax(logits / 0.8).
inline std::int32_t sample(const std::vector<float>& logits, std::mt19937_64& rng) {
  const float top = *std::max_element(logits.begin(), logits.end());
  std::vector<double> w(logits.size());
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = std::exp((logits[i] - top) / 0.8);
  return static_cast<std::int32_t>(std::discrete_distribution<std::size_t>(w.begin(), w.end())(rng));
}

/// True when a row of logits differs from the recompute's (`expected`)
/// beyond float accumulation error: by more than 1e-3 (1 + |expected|) in
/// any entry, or in length. `worst` grows to the largest difference seen.
inline bool logits_differ(const std::vector<float>& expected, const std::vector<float>& got, double& worst) {
  bool differs = expected.size() != got.size();
  for (std::size_t v = 0; v < std::min(expected.size(), got.size()); ++v) {
    const double diff = std::abs(double(expected[v]) - got[v]);
    worst = std::max(worst, diff);
    differs |= diff > 1e-3 * (1.0 + std::abs(double(expected[v])));
  }
  return differs;
}

}  // namespace tiny_llama
