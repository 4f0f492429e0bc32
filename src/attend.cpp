// ghostlink::attend: online softmax over runs of stored tokens.
//
// One pass, token by token, each token's keys and values read in order
// (a KV head's once per query head of its group, from L1). Per query head
// the running maximum rises only when a logit exceeds it, and only then is
// the output rescaled: one exp per token and head, where a textbook online
// softmax takes two and rescales at every token. Runs are taken in chunks
// of at most `chunk_tokens`, the size of the portable path's scratch.
//
// A snapshot's runs are the blocks its cache filled one after another,
// which lie next to each other (one extent: src/memory/block_pool.hpp), and the
// hardware's prefetchers start over at each run. Short runs (a block here,
// a block there: copies on write, blocks from a store) are attended a few
// behind the one added, and while one is attended the run that many ahead
// is prefetched into L2, a token per token (attention_pass::hold).
//
// Two instruction sets, chosen once per run: AVX2 + FMA + F16C when the
// processor has them and head_dim is a multiple of 8 (16-bit elements are
// widened in registers as they are loaded), else portable code the compiler
// vectorises (16-bit chunks widened to floats first).
//
// The quantized types are read in place on the AVX2 path: a q8_0 or q4_0
// group's 32 elements widened in registers and its scale `d` applied once
// to the group's partial dot product (d * sum(q * qs)) or to the weight of
// its values (w * d); an fp8 element widened through half (its bits moved
// into a half's, which F16C widens: the value / 256), the 256 and the
// cache's scales applied once per logit and once to each output.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/attend.hpp"
#include "ghostlink/detail/attention_pass.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GHOSTLINK_ATTEND_AVX2 1
#include <immintrin.h>
#endif

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

constexpr std::size_t chunk_tokens = 64;

/// One thread's scratch: kept between calls so a call does not allocate.
struct scratch {
  std::vector<float> max, sum;        // per row and query head
  std::vector<float> logits, factors;  // the AVX2 path's, per query head
  std::vector<float> wide_k, wide_v;  // the portable path's widened 16-bit chunk
  std::vector<std::uint16_t> pending_k, pending_v;  // pending tokens rounded to 16 bits
};
thread_local scratch tls;

/// What one chunk's loop needs, fixed for a call.
struct pass_args {
  std::size_t kv_heads, group, dim, width;
  float scale;              // of a logit: the shape's, times what stored keys are multiplied by
  std::size_t token_bytes;  // of one token's stored keys (or values)
  std::size_t vdim;         // a head's value (and output) elements: dim, or fewer keys only
};

/// What the AVX2 path's loads give of an fp8 element: its value / 256.
constexpr float fp8_load_factor = 256.0f;

/// One token's weight for a query head with logit `logit`, against the
/// head's running maximum and sum (the maximum raised to the logit if it is
/// higher). Returns the factor the head's output must be scaled by first:
/// 1 unless the maximum rose, which after the first tokens is rare. One exp
/// per token, and a rescale only when the maximum rises.
inline float weigh(float logit, float& max, float& sum, float& w) {
  if (logit <= max) {
    w = std::exp(logit - max);
    sum += w;
    return 1.0f;
  }
  const float factor = sum != 0.0f ? std::exp(max - logit) : 1.0f;
  max = logit;
  w = 1.0f;
  sum = sum * factor + 1.0f;
  return factor;
}

/// Asks for token `t` of the run ahead (if it has one) to be brought into
/// the processor's L2 cache, keys and values, a cache line at a time. One
/// token per token attended, so the run ahead is in cache when its turn
/// comes, where the hardware's prefetchers would only start on it then
/// (each block is elsewhere in memory), and the requests are spread out.
inline void prefetch_token(const stored_run& ahead, std::size_t t, std::size_t token_bytes) noexcept {
  if (t >= ahead.count) return;
  constexpr std::size_t cache_line = 64;
  const std::byte* k = ahead.keys + t * token_bytes;
  const std::byte* v = ahead.values + t * token_bytes;
  for (std::size_t at = 0; at < token_bytes; at += cache_line) {
    __builtin_prefetch(k + at, 0, 2);
    __builtin_prefetch(v + at, 0, 2);
    // GCC 12 deletes a loop of prefetches alone behind a condition as
    // having no effect (Clang keeps it); an empty asm statement keeps it.
    __asm__ volatile("");
  }
}

// --- portable ---------------------------------------------------------------

/// q . k with eight partial sums, so the compiler vectorises it without
/// reassociating floating point.
float dot_portable(const float* q, const float* k, std::size_t dim) {
  float part[8] = {};
  std::size_t i = 0;
  for (; i + 8 <= dim; i += 8)
    for (std::size_t j = 0; j < 8; ++j) part[j] += q[i + j] * k[i + j];
  float s = 0;
  for (; i < dim; ++i) s += q[i] * k[i];
  for (float p : part) s += p;
  return s;
}

void chunk_portable(const pass_args& a, const float* keys, const float* values, std::size_t n, const float* q, float* o,
                    float* max, float* sum, const stored_run& ahead, std::size_t at) {
  const std::size_t heads = a.kv_heads * a.group;
  for (std::size_t t = 0; t < n; ++t) {
    prefetch_token(ahead, at + t, a.token_bytes);
    for (std::size_t h = 0; h < heads; ++h) {
      const std::size_t kv = t * a.width + h / a.group * a.dim;
      float* oh = o + h * a.vdim;
      float w;
      if (const float f = weigh(dot_portable(q + h * a.dim, keys + kv, a.dim) * a.scale, max[h], sum[h], w); f != 1.0f)
        for (std::size_t i = 0; i < a.vdim; ++i) oh[i] *= f;
      for (std::size_t i = 0; i < a.vdim; ++i) oh[i] += w * values[kv + i];
    }
  }
}

// --- AVX2 + FMA + F16C -------------------------------------------------------

#if GHOSTLINK_ATTEND_AVX2
#define GHOSTLINK_AVX2 __attribute__((target("avx2,fma,f16c")))

GHOSTLINK_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
GHOSTLINK_AVX2 inline __m256 load8(const half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
GHOSTLINK_AVX2 inline __m256 load8(const bfloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
/// Eight fp8 codes as their values / 256: S.EEEE.MMM sign-extended to 16
/// bits and shifted left 7 is S.S.EEEE.MMM0000000; clearing bit 14 leaves
/// the half S.0EEEE.MMM0000000. A NaN code becomes 1.875 * 2^-8 * sign:
/// runs that hold one take load8_exact (add_run checks).
GHOSTLINK_AVX2 inline __m256 load8(const fp8_e4m3* p) {
  const __m128i w = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7);
  return _mm256_cvtph_ps(_mm_and_si128(w, _mm_set1_epi16(static_cast<short>(0xbfff))));
}
/// As load8, a NaN code kept NaN (the half's exponent set to all ones).
GHOSTLINK_AVX2 inline __m256 load8_exact(const fp8_e4m3* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i magnitude = _mm_and_si128(w, _mm_set1_epi16(0x7f));
  __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(magnitude, 7));
  const __m128i nan = _mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7f));
  h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7c00)));
  return _mm256_cvtph_ps(h);
}

/// load8, or (Exact, fp8) load8_exact.
template <bool Exact, class T>
GHOSTLINK_AVX2 inline __m256 load8_as(const T* p) {
  if constexpr (Exact && std::is_same_v<T, fp8_e4m3>)
    return load8_exact(p);
  else
    return load8(p);
}

/// Whether any of `n` fp8 codes is a NaN (S.1111.111).
GHOSTLINK_AVX2 inline bool has_nan(const fp8_e4m3* p, std::size_t n) {
  const __m256i high = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi8(-1);
  __m256i any = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi8(_mm256_or_si256(x, high), ones));
  }
  if (!_mm256_testz_si256(any, any)) return true;
  for (; i < n; ++i)
    if ((p[i].bits & 0x7fu) == 0x7fu) return true;
  return false;
}

/// Four vectors: a group's 32 elements.
struct group8x4 {
  __m256 a, b, c, d;
};
GHOSTLINK_AVX2 inline __m256 widen8(const std::int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
/// A q8_0 or q4_0 group's 32 elements as integers in floats (d not applied).
GHOSTLINK_AVX2 inline group8x4 widen_group(const q8_0& g) {
  const std::int8_t* p = g.qs.data();
  return {widen8(p), widen8(p + 8), widen8(p + 16), widen8(p + 24)};
}
GHOSTLINK_AVX2 inline group8x4 widen_group(const q4_0& g) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g.qs.data()));
  const __m128i low = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, low), eight);                     // elements 0-15
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), low), eight);  // elements 16-31
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)))};
}

GHOSTLINK_AVX2 inline float hsum(__m256 acc) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// q . k over a head.
template <class T, bool Exact = false>
GHOSTLINK_AVX2 inline float dot_avx2(const float* q, const T* k, std::size_t dim) {
  if constexpr (elements_per<T> != 1) {  // per group d * (q . qs)
    __m256 acc = _mm256_setzero_ps();
    for (std::size_t g = 0; g < dim / T::elements; ++g, q += T::elements) {
      const group8x4 x = widen_group(k[g]);
      __m256 s = _mm256_mul_ps(_mm256_loadu_ps(q), x.a);
      s = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8), x.b, s);
      s = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16), x.c, s);
      s = _mm256_fmadd_ps(_mm256_loadu_ps(q + 24), x.d, s);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(k[g].d.bits)), s, acc);
    }
    return hsum(acc);
  } else {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    std::size_t i = 0;
    for (; i + 16 <= dim; i += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8_as<Exact>(k + i), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8_as<Exact>(k + i + 8), acc1);
    }
    if (i < dim) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8_as<Exact>(k + i), acc0);
    return hsum(_mm256_add_ps(acc0, acc1));
  }
}

/// o += w * v over a head's first vdim elements.
template <class T, bool Exact = false>
GHOSTLINK_AVX2 inline void axpy_avx2(float w, const T* v, float* o, std::size_t vdim) {
  if constexpr (elements_per<T> != 1) {
    for (std::size_t g = 0; g < vdim / T::elements; ++g, o += T::elements) {
      const group8x4 x = widen_group(v[g]);
      const __m256 wd = _mm256_set1_ps(w * _cvtsh_ss(v[g].d.bits));
      _mm256_storeu_ps(o, _mm256_fmadd_ps(wd, x.a, _mm256_loadu_ps(o)));
      _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(wd, x.b, _mm256_loadu_ps(o + 8)));
      _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(wd, x.c, _mm256_loadu_ps(o + 16)));
      _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(wd, x.d, _mm256_loadu_ps(o + 24)));
    }
  } else {
    const __m256 ws = _mm256_set1_ps(w);
    for (std::size_t i = 0; i < vdim; i += 8)
      _mm256_storeu_ps(o + i, _mm256_fmadd_ps(ws, load8_as<Exact>(v + i), _mm256_loadu_ps(o + i)));
  }
}

/// e^x for each lane, within 2 ulp of expf (Cephes' expf: x = n ln2 + r,
/// a degree-6 polynomial in r, times 2^n); exactly 1 at 0, NaN for NaN,
/// about 5.9e-39 instead of 0 for x below -88.37.
GHOSTLINK_AVX2 inline __m256 exp8(__m256 x) {
  // NaN passes: max/min return their second operand when either is NaN.
  x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), _mm256_max_ps(_mm256_set1_ps(-88.3762626647949f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

/// One chunk's tokens, each read once: per token every head's logit, then
/// every eight heads' weights at once (the running maxima, sums and the
/// factors their outputs are rescaled by, with two vector exps), then every
/// head's values. `logits` and `factors` hold the query heads' (scratch).
template <class T, bool Exact = false>
GHOSTLINK_AVX2 void chunk_avx2(const pass_args& a, const T* keys, const T* values, std::size_t n, const float* q,
                               float* o, float* max, float* sum, const stored_run& ahead, std::size_t at, float* logits,
                               float* factors) {
  // Fixed for the call: locals, so the loops' bounds stay in registers.
  const std::size_t heads = a.kv_heads * a.group, dim = a.dim, vdim = a.vdim, group = a.group, width = a.width;
  const std::size_t vectors = heads / 8 * 8;  // heads weighed eight at a time; the rest one by one
  const float scale = a.scale;
  for (std::size_t t = 0; t < n; ++t) {
    prefetch_token(ahead, at + t, a.token_bytes);
    const std::size_t token = t * width;
    for (std::size_t h = 0; h < heads; ++h)
      logits[h] = dot_avx2<T, Exact>(q + h * dim, keys + (token + h / group * dim) / elements_per<T>, dim) * scale;
    for (std::size_t h = 0; h < vectors; h += 8) {
      const __m256 l = _mm256_loadu_ps(logits + h), m = _mm256_loadu_ps(max + h);
      const __m256 top = _mm256_max_ps(m, l);  // l where either is NaN
      const __m256 f = exp8(_mm256_sub_ps(m, top)), w = exp8(_mm256_sub_ps(l, top));
      _mm256_storeu_ps(max + h, top);
      _mm256_storeu_ps(sum + h, _mm256_fmadd_ps(_mm256_loadu_ps(sum + h), f, w));
      _mm256_storeu_ps(logits + h, w);
      _mm256_storeu_ps(factors + h, f);
    }
    for (std::size_t h = vectors; h < heads; ++h) {
      float w;
      factors[h] = weigh(logits[h], max[h], sum[h], w);
      logits[h] = w;
    }
    for (std::size_t h = 0; h < heads; ++h) {
      float* oh = o + h * vdim;
      if (const float f = factors[h]; f != 1.0f) {
        const __m256 fs = _mm256_set1_ps(f);
        for (std::size_t i = 0; i < vdim; i += 8) _mm256_storeu_ps(oh + i, _mm256_mul_ps(fs, _mm256_loadu_ps(oh + i)));
      }
      axpy_avx2<T, Exact>(logits[h], values + (token + h / group * dim) / elements_per<T>, oh, vdim);
    }
  }
}

bool use_avx2(std::size_t dim, std::size_t vdim) {
  static const bool cpu = has_avx2_fma_f16c();
  return cpu && dim % 8 == 0 && vdim % 8 == 0;
}
#endif

/// The positions row `r` of `rows` (of `total` tokens) attends, as at most
/// two ranges `[begin, end)`: everything up to its own position, or with a
/// window its sinks and its window. Returns how many ranges.
std::size_t attended(const window_view& w, std::size_t rows, std::size_t total, std::size_t r,
                     std::pair<std::size_t, std::size_t> (&out)[2]) noexcept {
  const std::size_t end = total - rows + r + 1;  // row r sees positions below it
  const std::size_t from = w.window != 0 && end > w.window ? end - w.window : 0;
  if (from <= w.sinks) {
    out[0] = {0, end};
    return 1;
  }
  if (w.sinks == 0) {
    out[0] = {from, end};
    return 1;
  }
  out[0] = {0, w.sinks};
  out[1] = {from, end};
  return 2;
}

/// Whether this call's runs take the AVX2 path.
bool simd_path(const attention_shape& shape) noexcept {
#if GHOSTLINK_ATTEND_AVX2
  return use_avx2(shape.head_dim, shape.value_dim);
#else
  (void)shape;
  return false;
#endif
}

/// What the path's loads of a stored T give, times this, are the stored
/// values (before the cache's scale): 256 for fp8 on the AVX2 path, else 1.
template <class T>
float load_factor(bool simd) noexcept {
  return std::is_same_v<T, fp8_e4m3> && simd ? fp8_load_factor : 1.0f;
}

/// Every chunk of `count` tokens from position `first` that each row sees;
/// stored keys are multiplied by `key_scale` (fp8's).
template <class T>
void add_run(const attention_shape& shape, const window_view& window, std::size_t rows, std::size_t total,
             const float* queries, float* out, std::size_t first, std::size_t count, const T* keys, const T* values,
             const stored_run& ahead, float key_scale) {
  constexpr std::size_t per = elements_per<T>;  // elements per stored T
  const std::size_t width = shape.kv_heads * shape.head_dim;
  const bool simd = simd_path(shape);
  const pass_args a{shape.kv_heads,
                    shape.query_heads / shape.kv_heads,
                    shape.head_dim,
                    width,
                    shape.scale * key_scale * load_factor<T>(simd),
                    width / per * sizeof(T),
                    shape.value_dim};
  const std::size_t row_width = shape.query_heads * shape.head_dim, out_width = shape.query_heads * shape.value_dim;
  scratch& s = tls;
  // An fp8 run holding a NaN code takes the exact loads (see load8).
  bool nan_codes = false;
#if GHOSTLINK_ATTEND_AVX2
  if constexpr (std::is_same_v<T, fp8_e4m3>)
    nan_codes = simd && (has_nan(keys, count * width) || (values != keys && has_nan(values, count * width)));
#endif
  stored_run fetch = ahead;  // by the first row that reads the run
  for (std::size_t r = 0; r < rows; ++r) {
    const float* q = queries + r * row_width;
    float* o = out + r * out_width;
    float* max = s.max.data() + r * shape.query_heads;
    float* sum = s.sum.data() + r * shape.query_heads;
    std::pair<std::size_t, std::size_t> ranges[2];
    const std::size_t n_ranges = attended(window, rows, total, r, ranges);
    for (std::size_t i = 0; i < n_ranges; ++i) {
      const std::size_t begin = std::max(first, ranges[i].first), end = std::min(first + count, ranges[i].second);
      if (begin >= end) continue;
      const std::size_t n = end - begin, skip = begin - first;
      // While prefetching, chunks of about 1 KiB of keys: measured faster
      // over scattered blocks than whole chunks (bench: attend, float).
      const std::size_t step = fetch.count != 0 ? std::max<std::size_t>(1, 1024 / a.token_bytes) : chunk_tokens;
      for (std::size_t c = 0; c < n; c += step) {
        const std::size_t cn = std::min(step, n - c);
        const T* k = keys + (skip + c) * a.width / per;
        const T* v = values + (skip + c) * a.width / per;
#if GHOSTLINK_ATTEND_AVX2
        if (simd) {
          if (nan_codes)
            chunk_avx2<T, true>(a, k, v, cn, q, o, max, sum, fetch, c, s.logits.data(), s.factors.data());
          else
            chunk_avx2<T>(a, k, v, cn, q, o, max, sum, fetch, c, s.logits.data(), s.factors.data());
          continue;
        }
#endif
        if constexpr (std::is_same_v<T, float>) {
          chunk_portable(a, k, v, cn, q, o, max, sum, fetch, c);
        } else {
          to_floats(k, cn * a.width / per, s.wide_k.data(), 1.0f);
          to_floats(v, cn * a.width / per, s.wide_v.data(), 1.0f);
          chunk_portable(a, s.wide_k.data(), s.wide_v.data(), cn, q, o, max, sum, fetch, c);
        }
      }
      fetch = {};
    }
  }
}

}  // namespace

std::error_code attention_pass::begin(const attention_shape& shape, std::size_t width, std::size_t stored,
                                      pending_tokens pending, std::span<const float> queries, std::span<float> out,
                                      const window_view& window, bool keys_only, element_scales scales,
                                      std::size_t group) noexcept {
  if (shape.query_heads == 0 || shape.kv_heads == 0 || shape.head_dim == 0 || shape.query_heads % shape.kv_heads != 0)
    return kv_errc::invalid_shape;
  // A head's value: the stored one (value_dim 0 or head_dim), or a key's
  // first value_dim elements (keys only); whole groups of a group type.
  const std::size_t vdim = shape.value_dim == 0 ? shape.head_dim : shape.value_dim;
  if (vdim > shape.head_dim || (!keys_only && vdim != shape.head_dim) || shape.head_dim % group != 0 ||
      vdim % group != 0)
    return kv_errc::invalid_shape;
  const std::size_t kv_width = shape.kv_heads * shape.head_dim, row_width = shape.query_heads * shape.head_dim;
  if (width != 0 && width != kv_width) return kv_errc::width_mismatch;
  if (pending.values.size() != (keys_only ? 0 : pending.keys.size())) return kv_errc::length_mismatch;
  if (pending.keys.size() % kv_width != 0) return kv_errc::width_mismatch;
  if (queries.empty() || queries.size() % row_width != 0) return kv_errc::width_mismatch;
  const std::size_t rows = queries.size() / row_width, total = stored + pending.keys.size() / kv_width;
  if (rows > total) return kv_errc::index_out_of_range;
  const std::size_t out_floats = rows * shape.query_heads * vdim;
  if (out.size() < out_floats) return kv_errc::buffer_too_small;
  // The stored positions past the sinks that the first row attends (later
  // rows attend later ones): none of them dropped.
  const std::size_t first_row_end = total - rows + 1;
  const std::size_t from = window.window != 0 && first_row_end > window.window ? first_row_end - window.window : 0;
  first_attended_ = window.window != 0 ? std::max(from, window.sinks) : 0;
  if (window.sinks < window.kept_from && first_attended_ < std::min(window.kept_from, stored))
    return kv_errc::outside_window;
  try {
    scratch& s = tls;
    const std::size_t heads = rows * shape.query_heads;
    s.max.assign(heads, -INFINITY);
    s.sum.assign(heads, 0.0f);
    s.logits.resize(std::max(s.logits.size(), shape.query_heads));
    s.factors.resize(s.logits.size());
    s.wide_k.resize(std::max(s.wide_k.size(), chunk_tokens * kv_width));
    s.wide_v.resize(s.wide_k.size());
    s.pending_k.resize(std::max(s.pending_k.size(), pending.keys.size()));
    s.pending_v.resize(s.pending_k.size());
  } catch (const std::bad_alloc&) {
    return kv_errc::capacity_exhausted;
  }
  shape_ = shape;
  shape_.value_dim = vdim;
  window_ = window;
  scales_ = scales;
  keys_only_ = keys_only;
  if (shape_.scale == 0.0f) shape_.scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  held_ = 0;
  rows_ = rows;
  stored_ = stored;
  total_ = total;
  pending_ = pending;
  queries_ = queries.data();
  out_ = out.data();
  std::fill_n(out_, out_floats, 0.0f);
  return {};
}

template <class T>
void attention_pass::hold(std::size_t first, std::size_t count, const T* keys, const T* values) noexcept {
  if (keys_only_) values = keys;  // a key's first value_dim elements are its value
  const stored_run run{first, count, reinterpret_cast<const std::byte*>(keys),
                       reinterpret_cast<const std::byte*>(values)};
  const std::size_t run_bytes = count * shape_.kv_heads * shape_.head_dim / elements_per<T> * sizeof(T);
  if (held_ == runs_behind) attend_held<T>(run_bytes <= max_prefetched_run ? run : stored_run{});
  held_runs_[held_++] = run;
}

template <class T>
void attention_pass::attend_held(const stored_run& ahead) noexcept {
  const stored_run r = held_runs_[0];
  std::copy(held_runs_ + 1, held_runs_ + held_, held_runs_);
  --held_;
  add_run(shape_, window_, rows_, total_, queries_, out_, r.first, r.count, reinterpret_cast<const T*>(r.keys),
          reinterpret_cast<const T*>(r.values), ahead, scales_.key);
}

void attention_pass::add(std::size_t first, std::size_t count, const float* keys, const float* values) noexcept {
  hold(first, count, keys, values);
}
void attention_pass::add(std::size_t first, std::size_t count, const half* keys, const half* values) noexcept {
  hold(first, count, keys, values);
}
void attention_pass::add(std::size_t first, std::size_t count, const bfloat16* keys, const bfloat16* values) noexcept {
  hold(first, count, keys, values);
}
void attention_pass::add(std::size_t first, std::size_t count, const q8_0* keys, const q8_0* values) noexcept {
  hold(first, count, keys, values);
}
void attention_pass::add(std::size_t first, std::size_t count, const q4_0* keys, const q4_0* values) noexcept {
  hold(first, count, keys, values);
}
void attention_pass::add(std::size_t first, std::size_t count, const fp8_e4m3* keys, const fp8_e4m3* values) noexcept {
  hold(first, count, keys, values);
}

template <storage_element T>
void attention_pass::finish() noexcept {
  while (held_ != 0) attend_held<T>({});
  const std::size_t kv_width = shape_.kv_heads * shape_.head_dim, pending = pending_.keys.size() / kv_width;
  if (pending != 0) {
    if constexpr (std::is_same_v<T, float>) {
      add_run(shape_, window_, rows_, total_, queries_, out_, stored_, pending, pending_.keys.data(),
              keys_only_ ? pending_.keys.data() : pending_.values.data(), {}, 1.0f);
    } else {
      // Stored as a write to a T cache stores them (quantized, an fp8
      // divided by its scale): a T takes at most 2 bytes an element, held
      // in the scratch's 16-bit words, one per pending element.
      static_assert(sizeof(T) <= 2 * elements_per<T> && alignof(T) <= alignof(std::uint16_t) &&
                    std::is_trivially_copyable_v<T>);
      scratch& s = tls;
      T* k = reinterpret_cast<T*>(s.pending_k.data());
      T* v = reinterpret_cast<T*>(s.pending_v.data());
      from_floats(pending_.keys.data(), pending_.keys.size(), k, scales_.key);
      from_floats(pending_.values.data(), pending_.values.size(), v, scales_.value);
      add_run(shape_, window_, rows_, total_, queries_, out_, stored_, pending, k, keys_only_ ? k : v, {}, scales_.key);
    }
  }
  // A keys-only layer's values are its keys: their scale.
  const float value_scale = (keys_only_ ? scales_.key : scales_.value) * load_factor<T>(simd_path(shape_));
  const scratch& s = tls;
  for (std::size_t h = 0; h < rows_ * shape_.query_heads; ++h) {
    const float inv = value_scale / s.sum[h];
    for (std::size_t i = 0; i < shape_.value_dim; ++i) out_[h * shape_.value_dim + i] *= inv;
  }
}

template void attention_pass::finish<float>() noexcept;
template void attention_pass::finish<half>() noexcept;
template void attention_pass::finish<bfloat16>() noexcept;
template void attention_pass::finish<q8_0>() noexcept;
template void attention_pass::finish<q4_0>() noexcept;
template void attention_pass::finish<fp8_e4m3>() noexcept;

}  // namespace detail
GHOSTLINK_NAMESPACE_END

GHOSTLINK_NAMESPACE_BEGIN
namespace {

template <storage_element T>
std::error_code attend_span(std::span<const T> keys, std::span<const T> values, std::span<const float> queries,
                            std::span<float> out, const attention_shape& shape,
                            detail::element_scales scales = {}) noexcept {
  // Keys alone: no values, and a value_dim to read of each key.
  const bool keys_only = values.empty() && !keys.empty() && shape.value_dim != 0;
  if (!keys_only && keys.size() != values.size()) return kv_errc::length_mismatch;
  const std::size_t width = shape.kv_heads * shape.head_dim, elements = keys.size() * elements_per<T>;
  if (width != 0 && elements % width != 0) return kv_errc::width_mismatch;
  const std::size_t tokens = width != 0 ? elements / width : 0;
  detail::attention_pass pass;
  if (auto ec = pass.begin(shape, width, tokens, {}, queries, out, {}, keys_only, scales, elements_per<T>)) return ec;
  pass.add(0, tokens, keys.data(), values.data());
  pass.finish<T>();
  return {};
}

}  // namespace

std::error_code attend(std::span<const float> keys, std::span<const float> values, std::span<const float> queries,
                       std::span<float> out, const attention_shape& shape) noexcept {
  return attend_span(keys, values, queries, out, shape);
}
std::error_code attend(std::span<const half> keys, std::span<const half> values, std::span<const float> queries,
                       std::span<float> out, const attention_shape& shape) noexcept {
  return attend_span(keys, values, queries, out, shape);
}
std::error_code attend(std::span<const bfloat16> keys, std::span<const bfloat16> values, std::span<const float> queries,
                       std::span<float> out, const attention_shape& shape) noexcept {
  return attend_span(keys, values, queries, out, shape);
}
std::error_code attend(std::span<const q8_0> keys, std::span<const q8_0> values, std::span<const float> queries,
                       std::span<float> out, const attention_shape& shape) noexcept {
  return attend_span(keys, values, queries, out, shape);
}
std::error_code attend(std::span<const q4_0> keys, std::span<const q4_0> values, std::span<const float> queries,
                       std::span<float> out, const attention_shape& shape) noexcept {
  return attend_span(keys, values, queries, out, shape);
}
std::error_code attend(std::span<const fp8_e4m3> keys, std::span<const fp8_e4m3> values, std::span<const float> queries,
                       std::span<float> out, const attention_shape& shape, float key_scale,
                       float value_scale) noexcept {
  return attend_span(keys, values, queries, out, shape, {key_scale, value_scale});
}

GHOSTLINK_NAMESPACE_END
