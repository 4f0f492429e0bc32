#pragma once
// The attention every implementation's reads feed, identically: `attention`
// runs ghostlink::attend (one query row, softmax(q . k / sqrt(d)) . v per
// head) over a snapshot's blocks (ghostlink) or over a contiguous range (a
// baseline's buffer or copy).
//
// `per_token_kernel` is the benchmark's kernel before ghostlink::attend: an
// online softmax that rescales every head's output at every token, AVX2 +
// FMA + F16C where the processor has them, else portable code the compiler
// vectorises. The attend scenario measures ghostlink::attend against it.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include <ghostlink/attend.hpp>
#include <ghostlink/element.hpp>
#include <ghostlink/snapshot.hpp>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GHOSTLINK_BENCH_AVX2 1
#include <immintrin.h>
#endif

namespace ghostlink::bench {

/// Lane `i` of every benchmark's query.
inline float query_value(std::size_t i) { return float(i % 11) / 11.0f - 0.5f; }

/// One decode step's attention over what an implementation reads.
class attention {
 public:
  attention(std::size_t heads, std::size_t head_dim)
      : shape_{.query_heads = heads, .kv_heads = heads, .head_dim = head_dim},
        query_(heads * head_dim),
        out_(heads * head_dim) {
    for (std::size_t i = 0; i < query_.size(); ++i) query_[i] = query_value(i);
  }

  /// Over every token of `snap`, from its blocks.
  template <storage_element T>
  void over(const basic_kv_snapshot<T>& snap) {
    if (!snap.empty()) check(ghostlink::attend(snap, query_, out_, shape_));
  }
  /// Over every token of `snap`, then the `pending` ones.
  template <storage_element T>
  void over(const basic_kv_snapshot<T>& snap, pending_tokens pending) {
    check(ghostlink::attend(snap, query_, out_, shape_, pending));
  }
  /// Over the first `n` tokens of `snap`.
  template <storage_element T>
  void over(basic_kv_snapshot<T>&& snap, std::size_t n) {
    over(std::move(snap).prefix(n));
  }
  /// Over contiguous tokens, token-major.
  template <storage_element T>
  void over(std::span<const T> keys, std::span<const T> values) {
    if (!keys.empty()) check(ghostlink::attend(keys, values, query_, out_, shape_));
  }
  void over(const std::vector<float>& keys, const std::vector<float>& values) {
    over(std::span<const float>(keys), std::span<const float>(values));
  }

  /// A value that depends on every output, so no work is optimised away.
  float checksum() const {
    float s = 0;
    for (float x : out_) s += x;
    return s;
  }

 private:
  static void check(std::error_code ec) {
    if (ec) throw std::system_error(ec, "ghostlink::attend");
  }
  attention_shape shape_;
  std::vector<float> query_, out_;
};

class per_token_kernel {
 public:
  per_token_kernel(std::size_t heads, std::size_t head_dim)
      : heads_(heads),
        dim_(head_dim),
        query_(heads * head_dim),
        max_(heads, -INFINITY),
        sum_(heads, 0.0f),
        out_(heads * head_dim, 0.0f) {
    for (std::size_t i = 0; i < query_.size(); ++i) query_[i] = query_value(i);
  }

  /// Feeds `count` tokens, token-major, `heads * head_dim` elements each.
  template <storage_element T>
  void add(std::size_t count, std::span<const T> keys, std::span<const T> values) {
#if GHOSTLINK_BENCH_AVX2
    if (dim_ % 8 == 0 && avx2()) return add_avx2(count, keys.data(), values.data());
#endif
    if constexpr (std::is_same_v<T, float>) {
      add_portable(count, keys.data(), values.data());
    } else {
      const std::size_t width = heads_ * dim_;
      wide_keys_.resize(width);
      wide_values_.resize(width);
      for (std::size_t t = 0; t < count; ++t) {
        convert<float, T>(keys.subspan(t * width, width), wide_keys_.data());
        convert<float, T>(values.subspan(t * width, width), wide_values_.data());
        add_portable(1, wide_keys_.data(), wide_values_.data());
      }
    }
  }

  /// Feeds `count` float tokens (a baseline's copied range, for one).
  void add(std::size_t count, std::span<const float> keys, std::span<const float> values) {
    add<float>(count, keys, values);
  }

  /// A value that depends on every output, so no work is optimised away.
  float checksum() const {
    float s = 0;
    for (std::size_t h = 0; h < heads_; ++h)
      for (std::size_t i = 0; i < dim_; ++i) s += out_[h * dim_ + i] / sum_[h];
    return s;
  }

 private:
  /// The online-softmax update of head `h` with one token's logit; returns
  /// (old output scale, this token's weight).
  std::pair<float, float> rescale(std::size_t h, float logit) {
    const float m = std::max(max_[h], logit);
    const float old_scale = std::exp(max_[h] - m), w = std::exp(logit - m);
    sum_[h] = sum_[h] * old_scale + w;
    max_[h] = m;
    return {old_scale, w};
  }

  void add_portable(std::size_t count, const float* keys, const float* values) {
    const std::size_t width = heads_ * dim_;
    const float scale = 1.0f / std::sqrt(float(dim_));
    for (std::size_t t = 0; t < count; ++t)
      for (std::size_t h = 0; h < heads_; ++h) {
        const float* k = keys + t * width + h * dim_;
        const float* v = values + t * width + h * dim_;
        const auto [old_scale, w] = rescale(h, dot(query_.data() + h * dim_, k) * scale);
        float* o = out_.data() + h * dim_;
        for (std::size_t i = 0; i < dim_; ++i) o[i] = o[i] * old_scale + w * v[i];
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

#if GHOSTLINK_BENCH_AVX2
  static bool avx2() {
    static const bool yes = detail::has_avx2_fma_f16c();
    return yes;
  }

  __attribute__((target("avx2,fma,f16c"))) static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  __attribute__((target("avx2,fma,f16c"))) static __m256 load8(const half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  __attribute__((target("avx2,fma,f16c"))) static __m256 load8(const bfloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }

  template <class T>
  __attribute__((target("avx2,fma,f16c"))) void add_avx2(std::size_t count, const T* keys, const T* values) {
    const std::size_t width = heads_ * dim_;
    const float scale = 1.0f / std::sqrt(float(dim_));
    for (std::size_t t = 0; t < count; ++t)
      for (std::size_t h = 0; h < heads_; ++h) {
        const float* q = query_.data() + h * dim_;
        const T* k = keys + t * width + h * dim_;
        const T* v = values + t * width + h * dim_;
        __m256 acc = _mm256_setzero_ps();
        for (std::size_t i = 0; i < dim_; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        const auto [old_scale, w] = rescale(h, _mm_cvtss_f32(s) * scale);
        const __m256 os = _mm256_set1_ps(old_scale), ws = _mm256_set1_ps(w);
        float* o = out_.data() + h * dim_;
        for (std::size_t i = 0; i < dim_; i += 8)
          _mm256_storeu_ps(o + i, _mm256_fmadd_ps(_mm256_loadu_ps(o + i), os, _mm256_mul_ps(ws, load8(v + i))));
      }
  }
#endif

  std::size_t heads_, dim_;
  std::vector<float> query_, max_, sum_, out_;
  std::vector<float> wide_keys_, wide_values_;  // portable path's scratch for 16-bit tokens
};

}  // namespace ghostlink::bench
