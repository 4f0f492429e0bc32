#pragma once
/// @file
/// The element types a cache can store: `float`, and the 16-bit
/// `ghostlink::half` (IEEE 754 binary16) and `ghostlink::bfloat16`.
///
/// Writes always take `float`s; a 16-bit cache converts them with
/// round-to-nearest-even, as IEEE 754 (and F16C) rounds: overflow becomes
/// infinity, tiny values subnormals or zero, and NaN a quiet NaN (for
/// `half`, the canonical 0x7e00 with the input's sign). Converting back to
/// `float` is exact (a signalling NaN, which a cache never stores, may come
/// back quiet).

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// IEEE 754 binary16: 1 sign bit, 5 exponent bits, 10 mantissa bits.
struct half {
  /// The raw binary16 encoding.
  std::uint16_t bits = 0;

  /// Positive zero.
  constexpr half() noexcept = default;
  /// `f` rounded to nearest, ties to even (NaN becomes the quiet NaN 0x7e00
  /// with `f`'s sign).
  constexpr explicit half(float f) noexcept : bits(from_float(f)) {}
  /// The exact value.
  constexpr explicit operator float() const noexcept { return to_float(bits); }
  /// The half with these bits.
  static constexpr half from_bits(std::uint16_t b) noexcept {
    half h;
    h.bits = b;
    return h;
  }
  /// Bitwise equality: +0 and -0 differ, a NaN equals a NaN of the same bits.
  friend constexpr bool operator==(half, half) noexcept = default;

 private:
  // After Fabian Giesen's float_to_half_fast3_rtne and half_to_float
  // (public domain): the float adder does the subnormal rounding, so the
  // default floating-point rounding mode (to nearest) is assumed.
  static constexpr std::uint16_t from_float(float f) noexcept {
    constexpr std::uint32_t f32_infinity = 255u << 23;
    constexpr std::uint32_t f16_overflow = (127u + 16) << 23;  // 65536: becomes infinity
    constexpr std::uint32_t denorm_magic = ((127u - 15) + (23 - 10) + 1) << 23;
    std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    const std::uint32_t sign = u & 0x8000'0000u;
    u ^= sign;
    std::uint32_t out;
    if (u >= f16_overflow) {
      out = u > f32_infinity ? 0x7e00u : 0x7c00u;
    } else if (u < (113u << 23)) {
      // Subnormal or zero: adding 0.5 * 2^-13 * 2^... aligns the 10
      // mantissa bits at the bottom, rounded by the adder.
      const float aligned = std::bit_cast<float>(u) + std::bit_cast<float>(denorm_magic);
      out = std::bit_cast<std::uint32_t>(aligned) - denorm_magic;
    } else {
      const std::uint32_t odd = (u >> 13) & 1u;
      u += ((15u - 127u) << 23) + 0xfffu + odd;  // rebias; round half to even
      out = u >> 13;
    }
    return static_cast<std::uint16_t>(out | (sign >> 16));
  }

  static constexpr float to_float(std::uint16_t h) noexcept {
    constexpr std::uint32_t shifted_exponent = 0x7c00u << 13;
    constexpr float magic = std::bit_cast<float>(113u << 23);
    std::uint32_t u = (h & 0x7fffu) << 13;
    const std::uint32_t exponent = shifted_exponent & u;
    u += (127u - 15u) << 23;
    if (exponent == shifted_exponent) {
      u += (128u - 16u) << 23;  // infinity or NaN
    } else if (exponent == 0) {
      u += 1u << 23;  // zero or subnormal: renormalise
      u = std::bit_cast<std::uint32_t>(std::bit_cast<float>(u) - magic);
    }
    return std::bit_cast<float>(u | (std::uint32_t{h} & 0x8000u) << 16);
  }
};

/// bfloat16: the top 16 bits of a float (8 exponent bits, 7 mantissa bits).
struct bfloat16 {
  /// The raw encoding: the top 16 bits of the float it stands for.
  std::uint16_t bits = 0;

  /// Positive zero.
  constexpr bfloat16() noexcept = default;
  /// `f` rounded to nearest, ties to even (a NaN stays a quiet NaN with its
  /// sign and top payload bits).
  constexpr explicit bfloat16(float f) noexcept : bits(from_float(f)) {}
  /// The exact value.
  constexpr explicit operator float() const noexcept { return std::bit_cast<float>(std::uint32_t{bits} << 16); }
  /// The bfloat16 with these bits.
  static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 v;
    v.bits = b;
    return v;
  }
  /// Bitwise equality: +0 and -0 differ, a NaN equals a NaN of the same bits.
  friend constexpr bool operator==(bfloat16, bfloat16) noexcept = default;

 private:
  static constexpr std::uint16_t from_float(float f) noexcept {
    std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fff'ffffu) > 0x7f80'0000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<std::uint16_t>(u >> 16);
  }
};

/// The types a `basic_layer_kv_cache` can store.
template <class T>
concept storage_element = std::same_as<T, float> || std::same_as<T, half> || std::same_as<T, bfloat16>;

namespace detail {
/// Exact bulk widening (vectorised where the processor allows; element.cpp).
void widen(const half* src, std::size_t n, float* dst) noexcept;
void widen(const bfloat16* src, std::size_t n, float* dst) noexcept;
/// Whether this x86-64 processor (and OS) offers AVX2, FMA and F16C.
bool has_avx2_fma_f16c() noexcept;
}  // namespace detail

/// Converts `src` into `dst` (which must hold `src.size()` elements), element
/// by element: rounding to nearest-even into a 16-bit type, exactly into
/// float. 16-bit to float is vectorised on processors with F16C / AVX2.
template <storage_element To, storage_element From>
void convert(std::span<const From> src, To* dst) noexcept {
  if constexpr (std::is_same_v<To, From>) {
    if (!src.empty()) std::memcpy(dst, src.data(), src.size_bytes());
  } else if constexpr (std::is_same_v<To, float>) {
    detail::widen(src.data(), src.size(), dst);
  } else {
    for (std::size_t i = 0; i < src.size(); ++i) dst[i] = To(static_cast<float>(src[i]));
  }
}

namespace detail {

/// How the type-erased storage code writes floats as a cache's element type.
struct element_codec {
  std::size_t size;  // bytes per element
  void (*store)(std::span<const float> src, std::byte* dst) noexcept;
};

template <storage_element T>
void store_as(std::span<const float> src, std::byte* dst) noexcept {
  convert<T, float>(src, reinterpret_cast<T*>(dst));
}

template <storage_element T>
inline constexpr element_codec codec_of{sizeof(T), &store_as<T>};

/// The number that names an element type wherever one is written down:
/// the prefix cache's root hash (one byte) and a saved sequence's header
/// (docs/FORMAT.md). 0 float, 1 half, 2 bfloat16.
template <storage_element T>
inline constexpr std::uint8_t element_code = std::is_same_v<T, float>  ? 0
                                             : std::is_same_v<T, half> ? 1
                                                                       : 2;

}  // namespace detail
GHOSTLINK_NAMESPACE_END
