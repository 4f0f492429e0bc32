#pragma once
/// @file
/// The element types a cache can store: `float`; the 16-bit
/// `ghostlink::half` (IEEE 754 binary16) and `ghostlink::bfloat16`; and the
/// quantized `ghostlink::q8_0`, `ghostlink::q4_0` (groups of 32 elements in
/// the layout of llama.cpp's `block_q8_0` and `block_q4_0`) and
/// `ghostlink::fp8_e4m3` (OCP 8-bit E4M3).
///
/// Writes always take `float`s; a 16-bit cache converts them with
/// round-to-nearest-even, as IEEE 754 (and F16C) rounds: overflow becomes
/// infinity, tiny values subnormals or zero, and NaN a quiet NaN (for
/// `half`, the canonical 0x7e00 with the input's sign). Converting back to
/// `float` is exact (a signalling NaN, which a cache never stores, may come
/// back quiet). The quantized types round as each one's documentation says;
/// reading them back gives the floats they stand for.

#include <array>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/config.hpp"

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

/// OCP 8-bit floating point E4M3 ("OFP8", the FP8 of vLLM, SGLang and
/// TensorRT-LLM): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no
/// infinities, largest magnitude 448, NaN `S.1111.111`. A cache stores
/// `x / scale` in it (`kv_cache_config::key_scale`, `value_scale`).
struct fp8_e4m3 {
  /// The raw encoding.
  std::uint8_t bits = 0;

  /// Positive zero.
  constexpr fp8_e4m3() noexcept = default;
  /// `f` rounded to nearest, ties to even, saturated to +-448 (infinities
  /// too); NaN becomes the NaN `S.1111.111` with `f`'s sign.
  constexpr explicit fp8_e4m3(float f) noexcept : bits(from_float(f)) {}
  /// The exact value (a NaN for the two NaN codes).
  constexpr explicit operator float() const noexcept { return to_float(bits); }
  /// The fp8_e4m3 with these bits.
  static constexpr fp8_e4m3 from_bits(std::uint8_t b) noexcept {
    fp8_e4m3 v;
    v.bits = b;
    return v;
  }
  /// Bitwise equality: +0 and -0 differ, a NaN equals a NaN of the same bits.
  friend constexpr bool operator==(fp8_e4m3, fp8_e4m3) noexcept = default;

 private:
  static constexpr std::uint8_t from_float(float f) noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f) & 0x7fff'ffffu;
    const auto sign = static_cast<std::uint8_t>((std::bit_cast<std::uint32_t>(f) >> 24) & 0x80u);
    if (u > 0x7f80'0000u) return static_cast<std::uint8_t>(sign | 0x7fu);  // NaN
    const std::uint32_t e = u >> 23;
    std::uint32_t code = 0;
    if (e < 121) {  // below 2^-6: a subnormal code, q * 2^-9 with q = round(|f| * 2^9)
      const std::uint32_t m = e == 0 ? 0 : (u & 0x7f'ffffu) | 0x80'0000u;
      const std::uint32_t shift = 121 - e + 20;
      if (shift < 25) {
        const std::uint32_t half_ulp = 1u << (shift - 1), rest = m & ((half_ulp << 1) - 1);
        code = m >> shift;
        if (rest > half_ulp || (rest == half_ulp && (code & 1u) != 0)) ++code;
      }
    } else {  // round the mantissa to 3 bits (ties to even), rebias 127 -> 7, saturate
      code = ((u + 0x7'ffffu + ((u >> 20) & 1u)) >> 20) - (120u << 3);
      if (code > 0x7eu) code = 0x7eu;
    }
    return static_cast<std::uint8_t>(sign | code);
  }

  static constexpr float to_float(std::uint8_t b) noexcept {
    const std::uint32_t sign = std::uint32_t{b & 0x80u} << 24, e = (b >> 3) & 15u, m = b & 7u;
    if (e == 15 && m == 7) return std::bit_cast<float>(sign | 0x7fc0'0000u);
    if (e == 0) {
      const float v = static_cast<float>(m) / 512.0f;  // exact
      return sign != 0 ? -v : v;
    }
    return std::bit_cast<float>(sign | (e + 120) << 23 | m << 20);
  }
};

/// llama.cpp's `block_q8_0`, bit for bit: 32 elements `d * qs[i]` (34 bytes).
struct q8_0 {
  /// Elements per group.
  static constexpr std::size_t elements = 32;
  /// The group's scale.
  half d;
  /// The quantized elements.
  std::array<std::int8_t, elements> qs{};

  /// `x` quantized exactly as ggml's `quantize_row_q8_0_ref` does (not as
  /// ggml-cpu's AVX2 path, which takes `127/amax` and rounds ties to even),
  /// in float arithmetic without contraction into FMA: `amax` the largest
  /// `|x[i]|` (as ggml's `MAX`, so a NaN is forgotten by the next element),
  /// `d = amax / 127`, `id = d ? 1/d : 0`, `qs[i] = roundf(x[i] * id)`, `d`
  /// stored as half (round to nearest even). A group whose `d` overflows
  /// half (`amax` from about 8.3e6 on) stores `d` infinite, so its elements
  /// read back as infinities, or NaN where `qs` is 0; a `roundf` result
  /// outside `int8_t` (inputs with NaN or infinity) becomes what x86's
  /// conversion makes of it: the low byte of `int32` (0x80000000 when out of
  /// `int32`'s range or NaN).
  static q8_0 quantize(std::span<const float, elements> x) noexcept;
  /// Element `i`: `d * qs[i]`.
  float operator[](std::size_t i) const noexcept { return static_cast<float>(d) * static_cast<float>(qs[i]); }
  /// Bytewise equality.
  friend bool operator==(const q8_0&, const q8_0&) noexcept = default;
};

/// llama.cpp's `block_q4_0`, bit for bit: 32 elements `d * (nibble - 8)`
/// (18 bytes); element `i < 16` is the low nibble of `qs[i]`, `i >= 16` the
/// high nibble of `qs[i - 16]`.
struct q4_0 {
  /// Elements per group.
  static constexpr std::size_t elements = 32;
  /// The group's scale.
  half d;
  /// The quantized elements, two to a byte.
  std::array<std::uint8_t, elements / 2> qs{};

  /// `x` quantized exactly as ggml's `quantize_row_q4_0_ref` does, in float
  /// arithmetic without contraction into FMA: `max` the first element of
  /// largest magnitude (with its sign; NaN never is), `d = max / -8`,
  /// `id = d ? 1/d : 0`, `nibble = min(15, (int8_t)(x[i] * id + 8.5f))`, `d`
  /// stored as half (round to nearest even). A group whose `d` overflows
  /// half (`|max|` from about 5.2e5 on) stores `d` infinite; a conversion to
  /// `int8_t` out of its range (NaN, infinity) is x86's, as for `q8_0`.
  static q4_0 quantize(std::span<const float, elements> x) noexcept;
  /// Element `i`'s nibble (0-15).
  unsigned nibble(std::size_t i) const noexcept {
    return i < elements / 2 ? qs[i] & 15u : static_cast<unsigned>(qs[i - elements / 2] >> 4);
  }
  /// Element `i`: `d * (nibble(i) - 8)`.
  float operator[](std::size_t i) const noexcept {
    return static_cast<float>(d) * static_cast<float>(static_cast<int>(nibble(i)) - 8);
  }
  /// Bytewise equality.
  friend bool operator==(const q4_0&, const q4_0&) noexcept = default;
};

static_assert(sizeof(q8_0) == 34 && sizeof(q4_0) == 18 && sizeof(fp8_e4m3) == 1);

/// The types a `basic_layer_kv_cache` can store.
template <class T>
concept storage_element = std::same_as<T, float> || std::same_as<T, half> || std::same_as<T, bfloat16> ||
                          std::same_as<T, q8_0> || std::same_as<T, q4_0> || std::same_as<T, fp8_e4m3>;

/// The elements one stored `T` holds: 32 for `q8_0` and `q4_0` (a group),
/// 1 for the others. A token of `token_width()` elements is
/// `token_width() / elements_per<T>` stored `T`s.
template <storage_element T>
inline constexpr std::size_t elements_per = std::is_same_v<T, q8_0> || std::is_same_v<T, q4_0> ? 32 : 1;

namespace detail {
/// Exact bulk widening (vectorised where the processor allows; element.cpp):
/// `n` stored `T`s into `n * elements_per<T>` floats; an fp8 times `scale`.
void widen(const half* src, std::size_t n, float* dst) noexcept;
void widen(const bfloat16* src, std::size_t n, float* dst) noexcept;
void widen(const q8_0* src, std::size_t n, float* dst) noexcept;
void widen(const q4_0* src, std::size_t n, float* dst) noexcept;
void widen(const fp8_e4m3* src, std::size_t n, float* dst, float scale = 1.0f) noexcept;
/// Bulk quantizing (quantize.cpp): `n` floats (a multiple of 32) into
/// `n / 32` groups; `n` floats divided by `scale` into fp8.
void narrow(const float* src, std::size_t n, q8_0* dst) noexcept;
void narrow(const float* src, std::size_t n, q4_0* dst) noexcept;
void narrow(const float* src, std::size_t n, fp8_e4m3* dst, float scale = 1.0f) noexcept;
/// Whether this x86-64 processor (and OS) offers AVX2, FMA and F16C.
bool has_avx2_fma_f16c() noexcept;

/// `n` stored `T`s into floats; fp8 times `scale` (others ignore it).
template <storage_element T>
void to_floats(const T* src, std::size_t n, float* dst, float scale) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    if (n != 0) std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, fp8_e4m3>) {
    widen(src, n, dst, scale);
  } else {
    widen(src, n, dst);
  }
}

/// `n` floats (a multiple of `elements_per<T>`) stored as `T`s; fp8 divided
/// by `scale` first (others ignore it).
template <storage_element T>
void from_floats(const float* src, std::size_t n, T* dst, float scale) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    if (n != 0) std::memcpy(dst, src, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, fp8_e4m3>) {
    narrow(src, n, dst, scale);
  } else if constexpr (elements_per<T> != 1) {
    narrow(src, n, dst);
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = T(src[i]);
  }
}
}  // namespace detail

/// Converts `src` into `dst`, element by element: rounding to nearest-even
/// into a 16-bit type or fp8 (unscaled: scale 1), quantizing into a group
/// type as its `quantize` does, exactly into float. `dst` must hold
/// `src.size() * elements_per<From> / elements_per<To>` of them, and that
/// must be whole (a float span into a group type: a multiple of 32 floats).
/// 16-bit to float is vectorised on processors with F16C / AVX2.
template <storage_element To, storage_element From>
void convert(std::span<const From> src, To* dst) noexcept {
  if constexpr (std::is_same_v<To, From>) {
    if (!src.empty()) std::memcpy(dst, src.data(), src.size_bytes());
  } else if constexpr (std::is_same_v<To, float>) {
    detail::to_floats(src.data(), src.size(), dst, 1.0f);
  } else if constexpr (std::is_same_v<From, float>) {
    detail::from_floats(src.data(), src.size(), dst, 1.0f);
  } else {
    // Through floats, a group (or 32 elements) at a time.
    constexpr std::size_t from_n = 32 / elements_per<From>, to_n = 32 / elements_per<To>;
    float floats[32];
    std::size_t i = 0, o = 0;
    for (; i + from_n <= src.size(); i += from_n, o += to_n) {
      detail::to_floats(src.data() + i, from_n, floats, 1.0f);
      detail::from_floats(floats, 32, dst + o, 1.0f);
    }
    if constexpr (elements_per<From> == 1 && elements_per<To> == 1) {
      for (; i < src.size(); ++i) dst[i] = To(static_cast<float>(src[i]));
    }
  }
}

namespace detail {

/// The number that names an element type wherever one is written down:
/// the prefix cache's root hash (one byte), a saved sequence's header and a
/// store entry (docs/FORMAT.md). 0 float, 1 half, 2 bfloat16, 3 q8_0,
/// 4 q4_0, 5 fp8_e4m3.
template <storage_element T>
inline constexpr std::uint8_t element_code = std::is_same_v<T, float>      ? 0
                                             : std::is_same_v<T, half>     ? 1
                                             : std::is_same_v<T, bfloat16> ? 2
                                             : std::is_same_v<T, q8_0>     ? 3
                                             : std::is_same_v<T, q4_0>     ? 4
                                                                           : 5;

/// How the type-erased storage code writes floats as a cache's element type,
/// and reads them back.
struct element_codec {
  std::size_t size;   // bytes per group
  std::size_t group;  // elements per group: 32 for q8_0 and q4_0, else 1
  bool scaled;        // fp8_e4m3: stores x / scale
  std::uint8_t code;  // element_code<T>
  void (*store)(std::span<const float> src, std::byte* dst, float scale) noexcept;
  /// `elements` stored elements (a multiple of `group`) into floats, an fp8 times `scale`.
  void (*load)(const std::byte* src, std::size_t elements, float* dst, float scale) noexcept;

  /// Bytes of `elements` elements (a multiple of `group`).
  constexpr std::size_t bytes(std::size_t elements) const noexcept { return elements / group * size; }
};

template <storage_element T>
void store_as(std::span<const float> src, std::byte* dst, float scale) noexcept {
  from_floats<T>(src.data(), src.size(), reinterpret_cast<T*>(dst), scale);
}

template <storage_element T>
void load_as(const std::byte* src, std::size_t elements, float* dst, float scale) noexcept {
  to_floats<T>(reinterpret_cast<const T*>(src), elements / elements_per<T>, dst, scale);
}

/// validate(config, ...) for elements stored as `codec` says.
inline void validate(const kv_cache_config& config, const element_codec& codec) {
  validate(config, codec.size, codec.group, codec.scaled);
}

template <storage_element T>
inline constexpr element_codec codec_of{sizeof(T),       elements_per<T>, std::is_same_v<T, fp8_e4m3>,
                                        element_code<T>, &store_as<T>,    &load_as<T>};

/// The codec of the element type `code` names (as a file or an entry
/// records it), or null for a code that names none.
inline const element_codec* codec_for(std::uint32_t code) noexcept {
  static constexpr const element_codec* codecs[] = {&codec_of<float>, &codec_of<half>, &codec_of<bfloat16>,
                                                    &codec_of<q8_0>,  &codec_of<q4_0>, &codec_of<fp8_e4m3>};
  return code < std::size(codecs) ? codecs[code] : nullptr;
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
