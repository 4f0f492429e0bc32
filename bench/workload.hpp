#pragma once
// What every implementation is fed and computes, identically: token data,
// and the attention kernel run over whatever spans an implementation hands
// out (ghostlink's blocks, a baseline's copy).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "harness.hpp"

namespace ghostlink::bench {

/// Keys and values for one token; distinct per (index, salt).
struct token {
  std::vector<float> keys, values;
  token(std::size_t width, std::size_t index, std::size_t salt = 0) : keys(width), values(width) {
    for (std::size_t i = 0; i < width; ++i) {
      keys[i] = float((index * 31 + i * 7 + salt) % 97) / 97.0f - 0.5f;
      values[i] = float((index * 17 + i * 13 + salt) % 89) / 89.0f - 0.5f;
    }
  }
};

/// softmax(q . k / sqrt(d)) . v per head over the tokens fed to it, in one
/// pass (online softmax): what a decode step's attention does with the cache.
class attention {
 public:
  attention(std::size_t heads, std::size_t head_dim)
      : heads_(heads), dim_(head_dim), query_(heads * head_dim), max_(heads, -INFINITY), sum_(heads, 0.0f),
        out_(heads * head_dim, 0.0f) {
    for (std::size_t i = 0; i < query_.size(); ++i) query_[i] = float(i % 11) / 11.0f - 0.5f;
  }

  /// Feeds `count` tokens, token-major, `heads * head_dim` floats each.
  void add(std::size_t count, std::span<const float> keys, std::span<const float> values) {
    const std::size_t width = heads_ * dim_;
    const float scale = 1.0f / std::sqrt(float(dim_));
    for (std::size_t t = 0; t < count; ++t)
      for (std::size_t h = 0; h < heads_; ++h) {
        const float* q = query_.data() + h * dim_;
        const float* k = keys.data() + t * width + h * dim_;
        const float* v = values.data() + t * width + h * dim_;
        const float logit = dot(q, k) * scale, m = std::max(max_[h], logit);
        const float old_scale = std::exp(max_[h] - m), w = std::exp(logit - m);
        float* o = out_.data() + h * dim_;
        for (std::size_t i = 0; i < dim_; ++i) o[i] = o[i] * old_scale + w * v[i];
        sum_[h] = sum_[h] * old_scale + w;
        max_[h] = m;
      }
  }

  /// q . k over one head, with eight independent partial sums so the
  /// compiler can vectorise it without reassociating floating point.
  float dot(const float* q, const float* k) const {
    float part[8] = {};
    std::size_t i = 0;
    for (; i + 8 <= dim_; i += 8)
      for (std::size_t j = 0; j < 8; ++j) part[j] += q[i + j] * k[i + j];
    float sum = 0;
    for (; i < dim_; ++i) sum += q[i] * k[i];
    for (float p : part) sum += p;
    return sum;
  }

  /// A value that depends on every output, so no work is optimised away.
  float checksum() const {
    float s = 0;
    for (std::size_t h = 0; h < heads_; ++h)
      for (std::size_t i = 0; i < dim_; ++i) s += out_[h * dim_ + i] / sum_[h];
    return s;
  }

 private:
  std::size_t heads_, dim_;
  std::vector<float> query_, max_, sum_, out_;
};

/// Keeps a value alive for the optimiser.
inline std::atomic<float> sink{0};
inline void keep(float v) { sink.store(v, std::memory_order_relaxed); }

}  // namespace ghostlink::bench
