#pragma once
// A tiny decoder with multi-head latent attention as DeepSeek V2/V3 run it
// with absorbed projections: per token and layer it stores one vector, a
// latent of `latent` elements and a RoPE key of `rope` elements, and no
// values. Each query head scores [its absorbed latent query; its RoPE
// query] against those vectors and reads their latent part as the value;
// an output projection brings the heads back to the hidden size. Weights
// come from a seed; nothing is trained. `decode_step` runs a token through
// a keys-only sequence (one step: each layer's vector written, then
// attended with `attend`); `recompute` runs the same model over a whole
// token list without any cache, as the reference.

#include <ghostlink/attend.hpp>
#include <ghostlink/sequence_kv_cache.hpp>
#include <ghostlink/sequence_step.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <future>
#include <span>
#include <system_error>
#include <vector>

namespace ghostlink::test {

class tiny_mla {
 public:
  static constexpr std::size_t hidden = 16, latent = 8, rope = 8, heads = 4, vocab = 32;
  static constexpr std::size_t stored = latent + rope;  // the one stored head: num_heads 1, head_dim 16

  tiny_mla(std::size_t layers, std::uint64_t seed) : layers_(layers) {
    std::uint64_t s = seed;
    const auto next = [&s] {
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      return static_cast<float>(static_cast<std::int64_t>(s >> 33) % 2001 - 1000) / 4000.0f;
    };
    embed_.resize(vocab * hidden);
    for (float& w : embed_) w = next() * 4.0f;
    for (std::size_t l = 0; l < layers; ++l) {
      layer w;
      for (auto* m : {&w.down, &w.key_rope, &w.query_latent, &w.query_rope, &w.out}) {
        const std::size_t n = m == &w.down           ? latent * hidden
                              : m == &w.key_rope     ? rope * hidden
                              : m == &w.query_latent ? heads * latent * hidden
                              : m == &w.query_rope   ? heads * rope * hidden
                                                     : hidden * heads * latent;
        m->resize(n);
        for (float& x : *m) x = next();
      }
      layers_w_.push_back(std::move(w));
    }
  }

  /// The attention's shape: `heads` query heads over one stored head of
  /// `stored` elements, whose first `latent` are the value.
  static attention_shape shape() {
    return {.query_heads = heads, .kv_heads = 1, .head_dim = stored, .value_dim = latent};
  }
  /// The cache's geometry.
  static kv_cache_config config(std::size_t max_tokens, std::size_t block_tokens = 4) {
    return {.max_tokens_per_seq = max_tokens, .num_heads = 1, .head_dim = stored, .block_tokens = block_tokens};
  }
  std::size_t num_layers() const { return layers_; }

  /// Token `token` at position `position` through every layer of `seq` (a
  /// keys-only sequence of this model's layers holding the tokens before
  /// it), in one step; its logits into `logits`. The first error, if any.
  template <class T>
  std::error_code decode_step(basic_sequence_kv_cache<T>& seq, token_id token, std::vector<float>& logits) const {
    const std::size_t position = seq.size();
    std::error_code ec;
    basic_sequence_step<T> step;
    std::promise<void> begun;
    seq.async_begin_step(std::size_t{1}, [&](std::error_code e, basic_sequence_step<T> s) {
      ec = e;
      step = std::move(s);
      begun.set_value();
    });
    begun.get_future().wait();
    if (ec) return ec;
    std::vector<float> x(embed_.begin() + static_cast<std::ptrdiff_t>(token * hidden),
                         embed_.begin() + static_cast<std::ptrdiff_t>((token + 1) * hidden));
    std::vector<float> vec(stored), queries(heads * stored), out(heads * latent);
    for (std::size_t l = 0; l < layers_; ++l) {
      stored_vector(l, x, position, vec);
      ec = step.write(l, vec, std::span<const float>());
      if (ec) return ec;
      query_rows(l, x, position, queries);
      ec = attend(step.snapshot(l), queries, out, shape());
      if (ec) return ec;
      add_output(l, out, x);
    }
    std::promise<std::error_code> committed;
    step.async_commit([&](std::error_code e) { committed.set_value(e); });
    ec = committed.get_future().get();
    if (ec) return ec;
    project(x, logits);
    return {};
  }

  /// The logits at every position of `tokens`, computed without a cache:
  /// each layer's vectors of every position, then each position's
  /// attention over the positions up to it, as plain loops.
  std::vector<std::vector<float>> recompute(std::span<const token_id> tokens) const {
    const std::size_t n = tokens.size();
    std::vector<std::vector<float>> xs(n);
    for (std::size_t p = 0; p < n; ++p)
      xs[p].assign(embed_.begin() + static_cast<std::ptrdiff_t>(tokens[p] * hidden),
                   embed_.begin() + static_cast<std::ptrdiff_t>((tokens[p] + 1) * hidden));
    std::vector<float> queries(heads * stored), out(heads * latent);
    for (std::size_t l = 0; l < layers_; ++l) {
      std::vector<std::vector<float>> vecs(n, std::vector<float>(stored));
      for (std::size_t p = 0; p < n; ++p) stored_vector(l, xs[p], p, vecs[p]);
      for (std::size_t p = 0; p < n; ++p) {
        query_rows(l, xs[p], p, queries);
        const float scale = 1.0f / std::sqrt(static_cast<float>(stored));
        for (std::size_t h = 0; h < heads; ++h) {
          std::vector<double> logit(p + 1);
          double top = -1e300, sum = 0;
          for (std::size_t j = 0; j <= p; ++j) {
            double d = 0;
            for (std::size_t i = 0; i < stored; ++i) d += double(queries[h * stored + i]) * vecs[j][i];
            logit[j] = d * scale;
            top = std::max(top, logit[j]);
          }
          for (double& v : logit) sum += v = std::exp(v - top);
          for (std::size_t i = 0; i < latent; ++i) {
            double acc = 0;
            for (std::size_t j = 0; j <= p; ++j) acc += logit[j] * vecs[j][i];
            out[h * latent + i] = static_cast<float>(acc / sum);
          }
        }
        add_output(l, out, xs[p]);
      }
    }
    std::vector<std::vector<float>> logits(n);
    for (std::size_t p = 0; p < n; ++p) project(xs[p], logits[p]);
    return logits;
  }

 private:
  struct layer {
    std::vector<float> down, key_rope, query_latent, query_rope, out;
  };

  static void matvec(const std::vector<float>& m, std::size_t rows, std::span<const float> x, float* y,
                     std::size_t offset = 0) {
    for (std::size_t r = 0; r < rows; ++r) {
      float acc = 0;
      for (std::size_t c = 0; c < x.size(); ++c) acc += m[offset + r * x.size() + c] * x[c];
      y[r] = acc;
    }
  }
  /// Rotates pairs of `v` by angles that grow with `position` (RoPE).
  static void rotate(float* v, std::size_t n, std::size_t position) {
    for (std::size_t i = 0; i + 1 < n; i += 2) {
      const double angle = static_cast<double>(position) * std::pow(100.0, -static_cast<double>(i) / double(n));
      const auto c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
      const float a = v[i], b = v[i + 1];
      v[i] = a * c - b * s;
      v[i + 1] = a * s + b * c;
    }
  }
  /// What layer `l` stores for hidden state `x` at `position`: its latent,
  /// then its RoPE key.
  void stored_vector(std::size_t l, std::span<const float> x, std::size_t position, std::vector<float>& out) const {
    matvec(layers_w_[l].down, latent, x, out.data());
    matvec(layers_w_[l].key_rope, rope, x, out.data() + latent);
    rotate(out.data() + latent, rope, position);
  }
  /// Each head's query: the latent query (W_uk absorbed), then the RoPE one.
  void query_rows(std::size_t l, std::span<const float> x, std::size_t position, std::vector<float>& q) const {
    for (std::size_t h = 0; h < heads; ++h) {
      matvec(layers_w_[l].query_latent, latent, x, q.data() + h * stored, h * latent * hidden);
      matvec(layers_w_[l].query_rope, rope, x, q.data() + h * stored + latent, h * rope * hidden);
      rotate(q.data() + h * stored + latent, rope, position);
    }
  }
  /// x += W_o (W_uv absorbed) times the heads' latent outputs.
  void add_output(std::size_t l, std::span<const float> heads_out, std::vector<float>& x) const {
    std::vector<float> o(hidden);
    matvec(layers_w_[l].out, hidden, heads_out, o.data());
    for (std::size_t i = 0; i < hidden; ++i) x[i] += o[i];
  }
  void project(std::span<const float> x, std::vector<float>& logits) const {
    logits.assign(vocab, 0.0f);
    for (std::size_t v = 0; v < vocab; ++v)
      for (std::size_t i = 0; i < hidden; ++i) logits[v] += embed_[v * hidden + i] * x[i];
  }

  std::size_t layers_;
  std::vector<float> embed_;
  std::vector<layer> layers_w_;
};

}  // namespace ghostlink::test
