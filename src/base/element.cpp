// Bulk widening of 16-bit elements to floats: what reads from a 16-bit
// cache spend their time on. Exact either way; on x86-64 processors with
// F16C (half) or AVX2 (bfloat16) eight elements per instruction, chosen
// once at run time so the library needs no special compiler flags.
#include "ghostlink/element.hpp"
#include "ghostlink/detail/flavour.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GHOSTLINK_X86_DISPATCH 1
#include <cpuid.h>
#include <immintrin.h>
#endif

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

template <class T>
void widen_scalar(const T* src, std::size_t n, float* dst) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#if GHOSTLINK_X86_DISPATCH
__attribute__((target("avx,f16c"))) void widen_f16c(const half* src, std::size_t n, float* dst) noexcept {
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    _mm_storeu_ps(dst + i, _mm_cvtph_ps(h));
  }
  widen_scalar(src + i, n - i, dst + i);
}

__attribute__((target("avx2"))) void widen_avx2(const bfloat16* src, std::size_t n, float* dst) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  }
  widen_scalar(src + i, n - i, dst + i);
}

/// What the processor and the OS allow, from CPUID (Clang 16's
/// __builtin_cpu_supports knows no "f16c").
struct x86_features {
  bool avx2_fma_f16c = false;
  bool avx2 = false;
  bool f16c = false;

  x86_features() noexcept {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12), f16c_bit = c & (1u << 29);
    if (!osxsave || !avx) return;
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 6u) != 6u) return;  // the OS saves the YMM registers
    f16c = f16c_bit;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) avx2 = b & (1u << 5);
    avx2_fma_f16c = avx2 && fma && f16c;
  }
};

const x86_features& features() noexcept {
  static const x86_features f;
  return f;
}
#endif

}  // namespace

bool has_avx2_fma_f16c() noexcept {
#if GHOSTLINK_X86_DISPATCH
  return features().avx2_fma_f16c;
#else
  return false;
#endif
}

void widen(const half* src, std::size_t n, float* dst) noexcept {
#if GHOSTLINK_X86_DISPATCH
  if (features().f16c) return widen_f16c(src, n, dst);
#endif
  widen_scalar(src, n, dst);
}

void widen(const bfloat16* src, std::size_t n, float* dst) noexcept {
#if GHOSTLINK_X86_DISPATCH
  if (features().avx2) return widen_avx2(src, n, dst);
#endif
  widen_scalar(src, n, dst);
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
