// The quantized elements: q8_0 and q4_0 quantized exactly as ggml's
// reference functions (quantize_row_q8_0_ref, quantize_row_q4_0_ref) do,
// fp8_e4m3 rounded to nearest even, and the bulk conversions a cache's
// writes and reads make. The library is compiled with -ffp-contract=off
// (meson.build, CMakeLists.txt): `x * id + 8.5f` must round twice, as the
// reference's does.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include "ghostlink/detail/flavour.hpp"

#include "base/quantize.hpp"
#include "ghostlink/element.hpp"

GHOSTLINK_NAMESPACE_BEGIN

namespace {

/// What x86's cvttss2si makes of `f` (as the reference's float-to-int8
/// conversions compile there): truncation toward zero, and 0x80000000 (the
/// "integer indefinite") for NaN or a value outside int32's range. Then the
/// low byte, as storing it into an int8_t keeps.
std::int8_t x86_int8(float f) noexcept {
  constexpr float two31 = 2147483648.0f;
  const std::uint32_t i =
      f >= -two31 && f < two31 ? static_cast<std::uint32_t>(static_cast<std::int32_t>(f)) : 0x8000'0000u;
  return static_cast<std::int8_t>(static_cast<std::uint8_t>(i & 0xffu));
}

}  // namespace

q8_0 q8_0::quantize(std::span<const float, elements> x) noexcept {
  float amax = 0.0f;
  for (const float v : x) {
    const float a = std::fabs(v);
    amax = amax > a ? amax : a;  // ggml's MAX(amax, fabsf(v))
  }
  const float d = amax / 127;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  q8_0 out;
  out.d = half(d);
  for (std::size_t j = 0; j < elements; ++j) out.qs[j] = x86_int8(std::round(x[j] * id));
  return out;
}

q4_0 q4_0::quantize(std::span<const float, elements> x) noexcept {
  float amax = 0.0f, max = 0.0f;
  for (const float v : x) {
    if (amax < std::fabs(v)) {
      amax = std::fabs(v);
      max = v;
    }
  }
  const float d = max / -8;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  q4_0 out;
  out.d = half(d);
  constexpr std::size_t h = elements / 2;
  for (std::size_t j = 0; j < h; ++j) {
    const float x0 = x[j] * id, x1 = x[h + j] * id;
    // MIN(15, (int8_t)(x + 8.5f)) as int, then uint8_t.
    const auto xi0 = static_cast<std::uint8_t>(std::min(15, int{x86_int8(x0 + 8.5f)}));
    const auto xi1 = static_cast<std::uint8_t>(std::min(15, int{x86_int8(x1 + 8.5f)}));
    out.qs[j] = static_cast<std::uint8_t>(xi0 | static_cast<std::uint8_t>(xi1 << 4));
  }
  return out;
}

namespace detail {

void widen(const q8_0* src, std::size_t n, float* dst) noexcept {
  for (std::size_t g = 0; g < n; ++g) {
    const float d = static_cast<float>(src[g].d);
    for (std::size_t i = 0; i < q8_0::elements; ++i) dst[g * q8_0::elements + i] = d * static_cast<float>(src[g].qs[i]);
  }
}

void widen(const q4_0* src, std::size_t n, float* dst) noexcept {
  constexpr std::size_t h = q4_0::elements / 2;
  for (std::size_t g = 0; g < n; ++g) {
    const float d = static_cast<float>(src[g].d);
    float* out = dst + g * q4_0::elements;
    for (std::size_t i = 0; i < h; ++i) {
      out[i] = d * static_cast<float>((src[g].qs[i] & 15) - 8);
      out[h + i] = d * static_cast<float>((src[g].qs[i] >> 4) - 8);
    }
  }
}

void widen(const fp8_e4m3* src, std::size_t n, float* dst, float scale) noexcept {
  // Every code's value, once.
  static const auto table = [] {
    std::array<float, 256> t{};
    for (std::size_t b = 0; b < t.size(); ++b)
      t[b] = static_cast<float>(fp8_e4m3::from_bits(static_cast<std::uint8_t>(b)));
    return t;
  }();
  if (scale == 1.0f) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = table[src[i].bits];
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = scale * table[src[i].bits];
  }
}

void narrow_portable(const float* src, std::size_t n, q8_0* dst) noexcept {
  for (std::size_t g = 0; g < n / q8_0::elements; ++g)
    dst[g] = q8_0::quantize(std::span<const float, q8_0::elements>(src + g * q8_0::elements, q8_0::elements));
}

void narrow_portable(const float* src, std::size_t n, q4_0* dst) noexcept {
  for (std::size_t g = 0; g < n / q4_0::elements; ++g)
    dst[g] = q4_0::quantize(std::span<const float, q4_0::elements>(src + g * q4_0::elements, q4_0::elements));
}

void narrow_portable(const float* src, std::size_t n, fp8_e4m3* dst, float scale) noexcept {
  if (scale == 1.0f) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = fp8_e4m3(src[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = fp8_e4m3(src[i] / scale);
  }
}

void narrow(const float* src, std::size_t n, q8_0* dst) noexcept {
  if (!narrow_avx2(src, n, dst)) narrow_portable(src, n, dst);
}
void narrow(const float* src, std::size_t n, q4_0* dst) noexcept {
  if (!narrow_avx2(src, n, dst)) narrow_portable(src, n, dst);
}
void narrow(const float* src, std::size_t n, fp8_e4m3* dst, float scale) noexcept {
  if (!narrow_avx2(src, n, dst, scale)) narrow_portable(src, n, dst, scale);
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
