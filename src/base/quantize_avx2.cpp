// AVX2 quantizers giving the bits of the portable ones (quantize.cpp): the
// reference's float operations, each correctly rounded, done eight lanes at
// a time; the scale, its reciprocal and `d` as half computed as there, per
// group. A group the vector code cannot follow exactly (a NaN or infinity
// in it, or a quotient out of int8_t's range, where the reference's
// conversion is x86's scalar one) is quantized by the portable code.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include "ghostlink/detail/flavour.hpp"

#include "base/quantize.hpp"
#include "ghostlink/element.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GHOSTLINK_QUANTIZE_AVX2 1
#include <immintrin.h>
#endif

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

#if GHOSTLINK_QUANTIZE_AVX2
namespace {

#define GHOSTLINK_AVX2 __attribute__((target("avx2,fma,f16c")))

/// A group's 32 floats.
struct lanes {
  __m256 v[4];
};

GHOSTLINK_AVX2 inline lanes load_group(const float* p) {
  return {{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), _mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)}};
}

GHOSTLINK_AVX2 inline __m256 abs8(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

/// The largest of eight lanes.
GHOSTLINK_AVX2 inline float hmax(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

/// True when every lane of every vector is finite (no NaN, no infinity).
GHOSTLINK_AVX2 inline bool all_finite(const lanes& x) {
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 bad = _mm256_setzero_ps();
  for (const __m256 v : x.v) bad = _mm256_or_ps(bad, _mm256_cmp_ps(abs8(v), inf, _CMP_NLT_UQ));  // NaN or inf
  return _mm256_testz_ps(bad, bad);
}

/// roundf (half away from zero) of lanes below 2^23 in magnitude: the
/// truncation, plus the sign where the (exact) remainder is half or more.
GHOSTLINK_AVX2 inline __m256 round_away(__m256 y) {
  const __m256 t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 half_or_more = _mm256_cmp_ps(abs8(_mm256_sub_ps(y, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(y, _mm256_set1_ps(-0.0f)));  // +-1 as y
  return _mm256_add_ps(t, _mm256_and_ps(half_or_more, one));
}

/// Whether every lane lies in [lo, hi] (false for NaN).
GHOSTLINK_AVX2 inline bool within(const __m256 (&y)[4], float lo, float hi) {
  __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (const __m256 v : y)
    ok = _mm256_and_ps(ok, _mm256_and_ps(_mm256_cmp_ps(v, _mm256_set1_ps(lo), _CMP_GE_OQ),
                                         _mm256_cmp_ps(v, _mm256_set1_ps(hi), _CMP_LE_OQ)));
  return _mm256_movemask_ps(ok) == 0xff;
}

/// 32 int32 lanes as 32 bytes, in order: each in int8_t's range, or
/// (Unsigned) in uint8_t's.
template <bool Unsigned = false>
GHOSTLINK_AVX2 inline __m256i pack_bytes(__m256i a, __m256i b, __m256i c, __m256i d) {
  // Per 128-bit lane, a's and b's halves, then c's and d's: a0 b0 c0 d0 | a1 b1 c1 d1.
  __m256i bytes;
  if constexpr (Unsigned)
    bytes = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
  else
    bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

GHOSTLINK_AVX2 bool quantize_group(const float* src, q8_0& out) {
  const lanes x = load_group(src);
  if (!all_finite(x)) return false;
  const __m256 m = _mm256_max_ps(_mm256_max_ps(abs8(x.v[0]), abs8(x.v[1])), _mm256_max_ps(abs8(x.v[2]), abs8(x.v[3])));
  const float amax = hmax(m);
  const float d = amax / 127;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 ids = _mm256_set1_ps(id);
  __m256 r[4];
  for (std::size_t j = 0; j < 4; ++j) r[j] = _mm256_mul_ps(x.v[j], ids);
  if (!within(r, -127.49f, 127.49f)) return false;  // (x86's conversion of what is beyond)
  for (__m256& v : r) v = round_away(v);
  const __m256i bytes = pack_bytes(_mm256_cvttps_epi32(r[0]), _mm256_cvttps_epi32(r[1]), _mm256_cvttps_epi32(r[2]),
                                   _mm256_cvttps_epi32(r[3]));
  out.d = half(d);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.qs.data()), bytes);
  return true;
}

GHOSTLINK_AVX2 bool quantize_group(const float* src, q4_0& out) {
  const lanes x = load_group(src);
  if (!all_finite(x)) return false;
  const __m256 a[4] = {abs8(x.v[0]), abs8(x.v[1]), abs8(x.v[2]), abs8(x.v[3])};
  const float amax = hmax(_mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3])));
  // The first element of largest magnitude, with its sign (0 if all are 0).
  float max = 0.0f;
  if (amax != 0.0f) {
    const __m256 top = _mm256_set1_ps(amax);
    std::uint32_t at = 0;
    for (std::size_t j = 0; j < 4; ++j)
      at |= static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a[j], top, _CMP_EQ_OQ))) << (8 * j);
    max = src[std::countr_zero(at)];
  }
  const float d = max / -8;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 ids = _mm256_set1_ps(id), bias = _mm256_set1_ps(8.5f);
  __m256 y[4];
  for (std::size_t j = 0; j < 4; ++j) y[j] = _mm256_add_ps(_mm256_mul_ps(x.v[j], ids), bias);  // two roundings
  if (!within(y, 0.0f, 127.0f)) return false;  // (an int8_t conversion of what is beyond)
  const __m256i fifteen = _mm256_set1_epi32(15);
  __m256i n[4];
  for (std::size_t j = 0; j < 4; ++j) n[j] = _mm256_min_epi32(_mm256_cvttps_epi32(y[j]), fifteen);
  // Element i < 16 in the low nibble of byte i, element 16 + i in its high.
  const __m256i lo = _mm256_or_si256(n[0], _mm256_slli_epi32(n[2], 4));
  const __m256i hi = _mm256_or_si256(n[1], _mm256_slli_epi32(n[3], 4));
  const __m256i bytes = pack_bytes<true>(lo, hi, _mm256_setzero_si256(), _mm256_setzero_si256());
  out.d = half(d);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out.qs.data()), _mm256_castsi256_si128(bytes));
  return true;
}

/// fp8_e4m3(x) of eight lanes (as fp8_e4m3's constructor: round to nearest
/// even, saturate at 448, NaN to S.1111.111) into eight bytes.
GHOSTLINK_AVX2 inline std::uint64_t fp8_of(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i u = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  // Normal codes: the mantissa rounded to 3 bits (ties to even), rebiased.
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7ffff), odd));
  const __m256i normal = _mm256_min_epi32(_mm256_sub_epi32(_mm256_srli_epi32(rounded, 20), _mm256_set1_epi32(120 << 3)),
                                          _mm256_set1_epi32(0x7e));
  // Below 2^-6: q * 2^-9, q = |x| * 2^9 rounded to nearest even (exact scaling).
  const __m256 scaled = _mm256_mul_ps(_mm256_castsi256_ps(u), _mm256_set1_ps(512.0f));
  const __m256i sub = _mm256_cvtps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), u);
  const __m256i is_nan = _mm256_cmpgt_epi32(u, _mm256_set1_epi32(0x7f800000));
  __m256i code = _mm256_blendv_epi8(normal, sub, is_sub);
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), is_nan);
  code = _mm256_or_si256(code, sign);
  // The low byte of each lane, in order.
  const __m256i picked =
      _mm256_shuffle_epi8(code, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                                                 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const auto low = static_cast<std::uint32_t>(_mm256_cvtsi256_si32(picked));
  const auto high = static_cast<std::uint32_t>(_mm256_extract_epi32(picked, 4));
  return std::uint64_t{low} | std::uint64_t{high} << 32;
}

GHOSTLINK_AVX2 void narrow_fp8(const float* src, std::size_t n, fp8_e4m3* dst, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_loadu_ps(src + i);
    if (scale != 1.0f) x = _mm256_div_ps(x, s);  // as x / scale
    const std::uint64_t codes = fp8_of(x);
    static_assert(sizeof(fp8_e4m3) == 1);
    std::memcpy(static_cast<void*>(dst + i), &codes, 8);
  }
  narrow_portable(src + i, n - i, dst + i, scale);
}

template <class Group>
GHOSTLINK_AVX2 void narrow_groups(const float* src, std::size_t n, Group* dst) {
  for (std::size_t g = 0; g < n / Group::elements; ++g) {
    const float* x = src + g * Group::elements;
    if (!quantize_group(x, dst[g]))
      dst[g] = Group::quantize(std::span<const float, Group::elements>(x, Group::elements));
  }
}

}  // namespace

bool narrow_avx2(const float* src, std::size_t n, q8_0* dst) noexcept {
  if (!has_avx2_fma_f16c()) return false;
  narrow_groups(src, n, dst);
  return true;
}
bool narrow_avx2(const float* src, std::size_t n, q4_0* dst) noexcept {
  if (!has_avx2_fma_f16c()) return false;
  narrow_groups(src, n, dst);
  return true;
}
bool narrow_avx2(const float* src, std::size_t n, fp8_e4m3* dst, float scale) noexcept {
  if (!has_avx2_fma_f16c()) return false;
  narrow_fp8(src, n, dst, scale);
  return true;
}

#else

bool narrow_avx2(const float*, std::size_t, q8_0*) noexcept { return false; }
bool narrow_avx2(const float*, std::size_t, q4_0*) noexcept { return false; }
bool narrow_avx2(const float*, std::size_t, fp8_e4m3*, float) noexcept { return false; }

#endif

}  // namespace detail
GHOSTLINK_NAMESPACE_END
