// The quantized element types: q8_0 and q4_0 bit for bit against ggml's
// reference quantizers re-derived here from their formulas, fp8_e4m3 against
// the OCP E4M3 definition (every code, and a sweep of the floats), the error
// bounds their rounding guarantees, and the bulk conversions agreeing with
// the per-element ones.
#include "common/support.hpp"

#include <ghostlink/element.hpp>

#include "base/quantize.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

namespace quantized_tests {

using ghostlink::fp8_e4m3;
using ghostlink::half;
using ghostlink::q4_0;
using ghostlink::q8_0;

namespace {

constexpr std::size_t group_size = 32;
using group_floats = std::array<float, group_size>;
const float inf_f = std::numeric_limits<float>::infinity();
const float nan_f = std::numeric_limits<float>::quiet_NaN();

/// The first few failures of a long loop, and how many in all.
struct failures {
  std::size_t count = 0;
  std::string first;
  void add(const std::string& what) {
    if (++count <= 5) first += what + '\n';
  }
};

std::string hex(unsigned v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

std::string describe(std::span<const float> x) {
  std::ostringstream s;
  s << std::hexfloat << '{';
  for (const float v : x) s << v << ' ';
  s << '}';
  return s.str();
}

// ---- the reference: ggml's quantize_row_q8_0_ref / q4_0_ref from their formulas ----

/// float -> binary16 bits, nearest and ties to even, by scaling |f| to an
/// integer count of ulps in double (exact) and rounding that.
std::uint16_t ref_half_bits(float f) {
  const auto sign = static_cast<std::uint16_t>(std::signbit(f) ? 0x8000 : 0);
  if (std::isnan(f)) return sign | 0x7e00;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;  // from halfway past 65504: infinity
  if (a < 0x1p-14) return sign | static_cast<std::uint16_t>(std::nearbyint(std::ldexp(a, 24)));  // subnormal ulps
  int e = 0;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  // 1024..2048 ulps of 2^(e-11): the mantissa plus the implicit 1, which
  // (like a carry to 2048) adds to the exponent field e - 1 + 15.
  const double ulps = std::nearbyint(std::ldexp(a, 11 - e));
  return sign | static_cast<std::uint16_t>(((e + 13) << 10) + static_cast<int>(ulps));
}

/// x86's float -> int8 conversion: cvttss2si (truncation; 0x80000000 for NaN
/// or outside int32), then the low byte.
std::uint8_t ref_x86_byte(float v) {
  if (v < -0x1p31f || v >= 0x1p31f || std::isnan(v)) return 0x00;
  return static_cast<std::uint8_t>(static_cast<std::int64_t>(v) & 0xff);
}

struct ref_group {
  std::uint16_t d = 0;
  std::vector<std::uint8_t> qs;
};

ref_group ref_q8_0(std::span<const float, group_size> x) {
  float amax = 0.0f;
  for (const float v : x) {
    const float a = std::fabs(v);
    amax = amax > a ? amax : a;  // MAX(amax, fabsf(v))
  }
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  ref_group out{ref_half_bits(d), {}};
  for (const float v : x) {
    const float scaled = v * id;  // its own statement: never contracted
    out.qs.push_back(ref_x86_byte(std::round(scaled)));
  }
  return out;
}

/// The first element of largest magnitude (NaN never is).
float first_max(std::span<const float, group_size> x) {
  float amax = 0.0f, max = 0.0f;
  for (const float v : x) {
    if (amax < std::fabs(v)) {
      amax = std::fabs(v);
      max = v;
    }
  }
  return max;
}

/// (int8_t)(v * id + 8.5f), rounded twice as float arithmetic does, then x86's.
int q4_raw(float v, float id) {
  const float scaled = v * id;
  const float shifted = scaled + 8.5f;
  return static_cast<std::int8_t>(ref_x86_byte(shifted));
}

ref_group ref_q4_0(std::span<const float, group_size> x) {
  const float d = first_max(x) / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  ref_group out{ref_half_bits(d), {}};
  for (std::size_t j = 0; j < group_size / 2; ++j) {
    const auto lo = static_cast<std::uint8_t>(std::min(15, q4_raw(x[j], id)));  // MIN(15, ...) into uint8_t
    const auto hi = static_cast<std::uint8_t>(std::min(15, q4_raw(x[j + 16], id)));
    out.qs.push_back(static_cast<std::uint8_t>(lo | hi << 4));
  }
  return out;
}

/// "" if the library's q8_0 and q4_0 of `x` are the reference's bytes.
std::string compare_with_reference(std::span<const float, group_size> x) {
  std::ostringstream why;
  const q8_0 g8 = q8_0::quantize(x);
  const ref_group r8 = ref_q8_0(x);
  if (g8.d.bits != r8.d) why << " q8_0 d " << hex(g8.d.bits) << " expected " << hex(r8.d) << ';';
  for (std::size_t i = 0; i < group_size; ++i)
    if (std::bit_cast<std::uint8_t>(g8.qs[i]) != r8.qs[i])
      why << " q8_0 qs[" << i << "] " << hex(std::bit_cast<std::uint8_t>(g8.qs[i])) << " expected " << hex(r8.qs[i])
          << ';';
  const q4_0 g4 = q4_0::quantize(x);
  const ref_group r4 = ref_q4_0(x);
  if (g4.d.bits != r4.d) why << " q4_0 d " << hex(g4.d.bits) << " expected " << hex(r4.d) << ';';
  for (std::size_t i = 0; i < group_size / 2; ++i)
    if (g4.qs[i] != r4.qs[i]) why << " q4_0 qs[" << i << "] " << hex(g4.qs[i]) << " expected " << hex(r4.qs[i]) << ';';
  const std::string s = why.str();
  return s.empty() ? s : describe(x) + ':' + s;
}

/// Checks each of `groups` quantizes to the reference's bytes.
void check_against_reference(const std::vector<group_floats>& groups) {
  failures bad;
  for (const group_floats& g : groups)
    if (const std::string why = compare_with_reference(g); !why.empty()) bad.add(why);
  INFO(bad.count << " of " << groups.size() << " groups differ; first:\n" << bad.first);
  CHECK(bad.count == 0);
}

// ---- data ----

/// `groups` groups of one shape, times `scale`, from a fixed seed.
std::vector<float> random_floats(int shape, float scale, std::size_t groups, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f), exponent(-24.0f, 0.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> small_int(-20, 20), position(0, group_size - 1);
  std::vector<float> out(groups * group_size);
  for (std::size_t g = 0; g < groups; ++g) {
    float* x = out.data() + g * group_size;
    for (std::size_t i = 0; i < group_size; ++i) {
      switch (shape) {
        case 0: x[i] = uniform(rng); break;
        case 1: x[i] = normal(rng); break;
        case 2: x[i] = std::fabs(uniform(rng)); break;                           // one sign
        case 3: x[i] = uniform(rng) < 0.0f ? 0.0f : normal(rng); break;          // half zeros
        case 4: x[i] = std::copysign(std::exp2(exponent(rng)), uniform(rng)); break;  // magnitudes 2^-24..1
        default: x[i] = static_cast<float>(small_int(rng)) / 8.0f; break;        // many equal magnitudes
      }
      x[i] *= scale;
    }
    if (shape == 1) x[position(rng)] *= 40.0f;  // an outlier
  }
  return out;
}
constexpr int shapes = 6;

std::span<const float, group_size> group_at(const std::vector<float>& v, std::size_t g) {
  return std::span<const float, group_size>(v.data() + g * group_size, group_size);
}

/// Groups of `leader` then 31 of the floats `t / id` lands on and both its
/// neighbours, for `t` each of `targets` (the last group padded with 0).
std::vector<group_floats> boundary_groups(float leader, const std::vector<float>& targets, float id) {
  std::vector<float> values;
  for (const float t : targets)
    values.insert(values.end(), {std::nextafter(t / id, -inf_f), t / id, std::nextafter(t / id, inf_f)});
  std::vector<group_floats> out;
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (i % (group_size - 1) == 0) out.emplace_back()[0] = leader;
    out.back()[1 + i % (group_size - 1)] = values[i];
  }
  return out;
}

/// The non-negative finite E4M3 values by the OCP definition, code b = index b.
double e4m3_value(unsigned b) {
  const unsigned e = (b >> 3) & 15, m = b & 7;
  return e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, static_cast<int>(e) - 7);
}

/// The nearest E4M3 code of `f` by search in the table of values, ties to the
/// even code; saturated at 448; NaN the NaN code of f's sign.
std::uint8_t ref_fp8_bits(float f, const std::array<double, 127>& values) {
  const auto sign = static_cast<std::uint8_t>(std::signbit(f) ? 0x80 : 0);
  if (std::isnan(f)) return sign | 0x7f;
  const double a = std::fabs(static_cast<double>(f));
  if (a <= 0x1p-10) return sign;       // at most half the smallest subnormal: 0 (a tie goes to even 0)
  if (a >= 448.0) return sign | 0x7e;  // saturation
  const auto hi = std::upper_bound(values.begin(), values.end(), a), lo = hi - 1;
  const double below = a - *lo, above = *hi - a;
  const auto* const pick = below < above ? lo : above < below ? hi : ((lo - values.begin()) % 2 == 0 ? lo : hi);
  return sign | static_cast<std::uint8_t>(pick - values.begin());
}

std::array<double, 127> e4m3_values() {
  std::array<double, 127> v{};
  for (unsigned b = 0; b < v.size(); ++b) v[b] = e4m3_value(b);
  return v;
}

bool normal_half(float d) { return std::fabs(d) >= 0x1p-14f && std::fabs(d) <= 65504.0f; }

/// The same float bits, or both NaN.
bool same(float a, float b) {
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b) || (std::isnan(a) && std::isnan(b));
}

}  // namespace

// 1. Bit for bit: random groups of several shapes and scales quantize to the
// reference's bytes.
TEST_CASE("q8_0 and q4_0 quantize random groups to ggml's reference bytes", "[quantized]") {
  std::vector<group_floats> groups;
  const float scales[] = {1e-3f, 1.0f, 37.5f, 1e4f};
  for (int shape = 0; shape < shapes; ++shape)
    for (std::uint32_t s = 0; s < 4; ++s) {
      const std::vector<float> data = random_floats(shape, scales[s], 128, 1000 + 10 * shape + s);
      for (std::size_t g = 0; g < 128; ++g)
        std::copy_n(group_at(data, g).begin(), group_size, groups.emplace_back().begin());
    }
  CHECK(groups.size() == 3072);
  check_against_reference(groups);
}

// 1. Bit for bit at the edges: zeros, ties in magnitude, rounding boundaries
// (x * id at k + 0.5 and one ulp either side), half-subnormal and zero
// scales, scales overflowing half.
TEST_CASE("q8_0 and q4_0 match ggml's reference at zeros, ties, rounding boundaries and extreme scales",
          "[quantized]") {
  std::vector<group_floats> cases{group_floats{}};
  // Ties in magnitude: q4_0's max is the first, with its sign.
  group_floats tie{};
  tie[3] = -3.0f, tie[7] = 3.0f, tie[9] = 1.0f;
  cases.push_back(tie);
  std::swap(tie[3], tie[7]);
  cases.push_back(tie);
  {
    const q4_0 neg_first = q4_0::quantize(cases[1]), pos_first = q4_0::quantize(cases[2]);
    CHECK(neg_first.d.bits == 0x3600);  // d = -3 / -8 = 0.375
    CHECK(pos_first.d.bits == 0xb600);
    CHECK((neg_first.nibble(3) == 0 && neg_first.nibble(7) == 15));
    CHECK((pos_first.nibble(3) == 0 && pos_first.nibble(7) == 15));  // the first max is the -8 end
  }
  // q8_0 rounding boundaries x * id = k + 0.5 for leaders giving d = 1, 1/8
  // (exact ties) and 100/127 (inexact id).
  std::vector<float> halves8, halves4;
  for (int k = -127; k < 127; ++k) halves8.push_back(static_cast<float>(k) + 0.5f);
  for (int k = -7; k <= 8; ++k) halves4.push_back(static_cast<float>(k) - 0.5f);  // x * id + 8.5 = k + 8
  for (const float leader : {127.0f, -15.875f, 100.0f}) {
    const float d = std::fabs(leader) / 127.0f;
    for (const group_floats& g : boundary_groups(leader, halves8, 1.0f / d)) cases.push_back(g);
  }
  // q4_0 boundaries: leaders giving d = 1, -1, 0.25 and -0.625 (inexact id).
  for (const float leader : {-8.0f, 8.0f, -2.0f, 5.0f}) {
    const float d = leader / -8.0f;
    for (const group_floats& g : boundary_groups(leader, halves4, 1.0f / d)) cases.push_back(g);
  }
  {
    group_floats g{};
    g[0] = 127.0f, g[1] = 2.5f, g[2] = -2.5f, g[3] = std::nextafter(2.5f, 0.0f);
    const q8_0 q = q8_0::quantize(g);  // roundf: ties away from zero
    CHECK((q.d.bits == 0x3c00 && q.qs[1] == 3 && q.qs[2] == -3 && q.qs[3] == 2));
    g = {};
    // x * id + 8.5f rounds to float before truncating (no FMA): -0.5 - 2^-24
    // + 8.5 is 8.0f, nibble 8; 0.5 - 2^-21 + 8.5 ties to 9.0f, nibble 9.
    g[0] = -8.0f, g[1] = -0.5f, g[2] = std::nextafter(-0.5f, -1.0f), g[3] = 0.5f - 0x1p-21f;
    const q4_0 r = q4_0::quantize(g);
    CHECK((r.d.bits == 0x3c00 && r.nibble(1) == 8 && r.nibble(2) == 8 && r.nibble(3) == 9));
    cases.push_back(g);
  }
  // Scales: half subnormal, rounding to 0 in half (qs still nonzero), float
  // subnormal; and overflowing half, at and below the tie to infinity.
  bool zero_d_nonzero_qs = false, subnormal_d = false;
  const float amaxes[] = {7e-3f,  1e-3f,  4e-4f,  1e-4f, 1e-5f, 3e-6f, 2e-7f, 1e-8f, 1e-20f,
                          1e-36f, 8.3e6f, 8.4e6f, 1e7f,  1e20f, 3e38f, 6e5f,  5.3e5f};
  for (std::size_t i = 0; i < std::size(amaxes); ++i) {
    const std::vector<float> data = random_floats(static_cast<int>(i % 2), 1.0f, 8, 77 + static_cast<std::uint32_t>(i));
    for (std::size_t g = 0; g < 8; ++g) {
      group_floats x;
      float m = 0.0f;
      for (std::size_t j = 0; j < group_size; ++j) m = std::max(m, std::fabs(x[j] = data[g * group_size + j]));
      for (float& v : x) v = v / m * amaxes[i];  // the largest exactly +-amax
      cases.push_back(x);
      const q8_0 q = q8_0::quantize(x);
      zero_d_nonzero_qs |= q.d.bits == 0 && std::any_of(q.qs.begin(), q.qs.end(), [](std::int8_t v) { return v != 0; });
      subnormal_d |= q.d.bits > 0 && q.d.bits < 0x400;
    }
  }
  CHECK(zero_d_nonzero_qs);
  CHECK(subnormal_d);
  {
    group_floats g{};
    g[0] = 8321040.0f, g[1] = 1.0f;  // d = 65520: the tie rounds to even, infinity
    CHECK(q8_0::quantize(g).d.bits == 0x7c00);
    CHECK(std::isinf(q8_0::quantize(g)[0]));
    CHECK(std::isnan(q8_0::quantize(g)[1]));  // qs 0 times infinity
    g[0] = 8321039.0f;
    CHECK(q8_0::quantize(g).d.bits == 0x7bff);
    g[0] = 524160.0f;  // q4_0: d = -65520
    CHECK(q4_0::quantize(g).d.bits == 0xfc00);
    cases.push_back(g);
  }
  CHECK(cases.size() > 200);
  check_against_reference(cases);
}

// 1. NaN and infinities (and float-subnormal groups whose 1/d overflows):
// the documented x86 conversions, matching the reference, without crashing.
TEST_CASE("q8_0 and q4_0 of groups with NaN or infinities match the reference's x86 conversions", "[quantized]") {
  std::vector<group_floats> cases;
  for (const float special : {nan_f, -nan_f, inf_f, -inf_f})
    for (const std::size_t at : {std::size_t{0}, std::size_t{13}, std::size_t{16}, group_size - 1}) {
      group_floats g;
      for (std::size_t i = 0; i < group_size; ++i) g[i] = static_cast<float>(i % 7) - 3.0f;
      g[at] = special;
      cases.push_back(g);
    }
  group_floats mixed{};
  mixed[2] = nan_f, mixed[5] = -inf_f, mixed[9] = 2.0f, mixed[20] = inf_f;
  cases.push_back(mixed);
  for (const float tiny : {1e-38f, 1e-40f, std::numeric_limits<float>::denorm_min()}) {
    group_floats g{};
    g[1] = tiny, g[4] = -tiny, g[6] = tiny / 2;
    cases.push_back(g);
  }
  {
    const q8_0 last_nan = q8_0::quantize(cases[3]);  // MAX keeps a NaN only from the last element
    CHECK(last_nan.d.bits == 0x7e00);
    CHECK(std::all_of(last_nan.qs.begin(), last_nan.qs.end(), [](std::int8_t v) { return v == 0; }));
    CHECK(q8_0::quantize(cases[0]).d.bits == half(3.0f / 127.0f).bits);  // forgotten by the next element
  }
  check_against_reference(cases);
}

// 2. Every fp8 code decodes to its OCP E4M3 value, and encodes back to itself.
TEST_CASE("every fp8_e4m3 code decodes to its OCP E4M3 value", "[quantized]") {
  failures bad;
  for (unsigned b = 0; b < 256; ++b) {
    const auto bits = static_cast<std::uint8_t>(b);
    const float got = static_cast<float>(fp8_e4m3::from_bits(bits));
    const bool negative = (b & 0x80) != 0, is_nan = (b & 0x7f) == 0x7f;
    const double want = is_nan ? 0.0 : (negative ? -1 : 1) * e4m3_value(b & 0x7f);
    const bool ok = is_nan ? std::isnan(got) && std::signbit(got) == negative
                           : static_cast<double>(got) == want && std::signbit(got) == negative;
    if (!ok || fp8_e4m3(got).bits != bits) bad.add(hex(b) + " decodes to " + std::to_string(got));
  }
  INFO(bad.first);
  CHECK(bad.count == 0);
  CHECK(static_cast<float>(fp8_e4m3::from_bits(0x7e)) == 448.0f);
  CHECK(static_cast<float>(fp8_e4m3::from_bits(0x01)) == 0x1p-9f);
  CHECK(static_cast<float>(fp8_e4m3::from_bits(0x08)) == 0x1p-6f);
}

// 2. Float -> fp8 is the nearest code, ties to even, saturating: named
// cases, every midpoint between codes and its neighbours, and a sweep of
// float bit patterns.
TEST_CASE("float to fp8_e4m3 rounds to the nearest code, ties to even, saturating at 448", "[quantized]") {
  const struct {
    float in;
    std::uint8_t out;
  } named[] = {{0.0f, 0x00},  {-0.0f, 0x80},   {448.0f, 0x7e},  {464.0f, 0x7e},
               {1e30f, 0x7e}, {inf_f, 0x7e},   {-inf_f, 0xfe},  {-500.0f, 0xfe},
               {nan_f, 0x7f}, {-nan_f, 0xff},  {0x1p-10f, 0},   {0x1.8p-9f, 0x02},
               {1.0f, 0x38},  {1.0625f, 0x38}, {1.1875f, 0x3a}, {std::bit_cast<float>(0x7f800001u), 0x7f}};
  for (const auto& c : named) {
    INFO("float " << std::hexfloat << c.in << " became " << hex(fp8_e4m3(c.in).bits) << ", expected " << hex(c.out));
    CHECK(fp8_e4m3(c.in).bits == c.out);
  }
  const std::array<double, 127> values = e4m3_values();
  failures bad;
  auto check = [&](float f) {
    const std::uint8_t got = fp8_e4m3(f).bits, want = ref_fp8_bits(f, values);
    if (got != want) {
      std::ostringstream s;
      s << "float " << hex(std::bit_cast<std::uint32_t>(f)) << " (" << std::hexfloat << f << ") became " << hex(got)
        << ", expected " << hex(want);
      bad.add(s.str());
    }
  };
  for (std::size_t b = 0; b + 1 < values.size(); ++b) {
    const auto mid = static_cast<float>((values[b] + values[b + 1]) / 2);  // exact: 5 significant bits
    for (const float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, inf_f)}) {
      check(f);
      check(-f);
    }
  }
  // Every 61st float bit pattern (NaNs, overflow, underflow), then every 5th
  // of either sign where codes are: magnitudes 2^-11 to 512.
  std::uint64_t swept = 0;
  for (std::uint64_t u = 0; u <= 0xffff'ffffu; u += 61, ++swept)
    check(std::bit_cast<float>(static_cast<std::uint32_t>(u)));
  for (std::uint32_t u = std::bit_cast<std::uint32_t>(0x1p-11f); u < std::bit_cast<std::uint32_t>(512.0f);
       u += 5, ++swept) {
    check(std::bit_cast<float>(u));
    check(-std::bit_cast<float>(u));
  }
  INFO(bad.count << " floats converted wrongly; first:\n" << bad.first);
  CHECK(swept > 100'000'000);
  CHECK(bad.count == 0);
}

// 3. What the reference's arithmetic guarantees: each element read back
// within half a step of d plus the error of rounding d to half (and float
// rounding); q4_0's clamped elements within a whole step. fp8 within half an
// E4M3 ulp of x / scale.
TEST_CASE("q8_0, q4_0 and fp8_e4m3 read back within the error their rounding allows", "[quantized]") {
  failures bad;
  std::size_t checked8 = 0, checked4 = 0, clamped = 0;
  const auto fail = [&](const char* type, std::span<const float> x, std::size_t i, double err, double bound) {
    std::ostringstream s;
    s << type << " element " << i << " error " << err << " > " << bound << " in " << describe(x);
    bad.add(s.str());
  };
  const float scales[] = {1e-2f, 1.0f, 300.0f, 3e4f};
  for (int shape = 0; shape < shapes; ++shape)
    for (std::uint32_t s = 0; s < 4; ++s) {
      const std::vector<float> data = random_floats(shape, scales[s], 64, 2000 + 10 * shape + s);
      for (std::size_t g = 0; g < 64; ++g) {
        const std::span<const float, group_size> x = group_at(data, g);
        float amax = 0.0f;
        for (const float v : x) amax = std::max(amax, std::fabs(v));
        const double d8 = amax / 127.0f, d4 = first_max(x) / -8.0f;
        std::size_t max_at = 0;  // the first element of largest magnitude: -8 * d, nibble 0
        for (std::size_t i = 0; i < group_size; ++i) max_at = std::fabs(x[i]) > std::fabs(x[max_at]) ? i : max_at;
        const float id4 = d4 != 0 ? 1.0f / static_cast<float>(d4) : 0.0f;
        const q8_0 q8 = q8_0::quantize(x);
        const q4_0 q4 = q4_0::quantize(x);
        const double D8 = static_cast<float>(q8.d), D4 = static_cast<float>(q4.d);
        for (std::size_t i = 0; i < group_size; ++i) {
          const double xi = x[i], slack8 = 0x1p-22 * (std::fabs(xi) + std::fabs(d8));
          if (normal_half(static_cast<float>(D8))) {
            const double err = std::fabs(xi - q8[i]), bound = std::fabs(d8) / 2 + 127 * std::fabs(d8 - D8) + slack8;
            if (err > bound) fail("q8_0", x, i, err, bound);
            ++checked8;
          }
          if (normal_half(static_cast<float>(D4))) {
            // + 2^-21 |d|: x * id + 8.5f rounds in [8, 16), half an ulp there
            // (0.5 - 2^-21 reads back as 1 when d = 1, above).
            const bool clamp = q4_raw(x[i], id4) > 15;
            const double err = std::fabs(xi - q4[i]),
                         bound = std::fabs(d4) * (clamp ? 1.0 : 0.5) + 8 * std::fabs(d4 - D4) +
                                 0x1p-22 * (std::fabs(xi) + std::fabs(d4)) + 0x1p-21 * std::fabs(d4);
            if (err > bound) fail("q4_0", x, i, err, bound);
            if (i == max_at && q4.nibble(i) != 0) fail("q4_0 nibble of the max element", x, i, q4.nibble(i), 0);
            ++checked4, clamped += clamp ? 1 : 0;
          }
        }
      }
    }
  // fp8 with a scale: magnitudes 2^-14..2^10 times the scale, subnormal codes to saturated.
  std::size_t checked_fp8 = 0;
  for (const float scale : {1.0f, 0.5f, 3.7f, 1e-3f}) {
    std::mt19937 rng(3000);
    std::uniform_real_distribution<float> exponent(-14.0f, 10.0f), sign(-1.0f, 1.0f);
    std::vector<float> x(4096);
    for (float& v : x) v = std::copysign(std::exp2(exponent(rng)), sign(rng)) * scale;
    std::vector<fp8_e4m3> codes(x.size());
    ghostlink::detail::narrow(x.data(), x.size(), codes.data(), scale);
    for (std::size_t i = 0; i < x.size(); ++i, ++checked_fp8) {
      const double target = std::clamp(static_cast<double>(x[i] / scale), -448.0, 448.0);
      const double v = static_cast<float>(codes[i]);
      const double ulp = std::fabs(v) < 0x1p-6 ? 0x1p-9 : std::ldexp(1.0, std::ilogb(v) - 3);
      if (std::fabs(target - v) > ulp / 2)
        fail("fp8_e4m3", std::span<const float>(&x[i], 1), i, std::fabs(target - v), ulp / 2);
    }
  }
  INFO(bad.count << " elements out of bounds; first:\n" << bad.first);
  CHECK(bad.count == 0);
  CHECK(checked8 > 40'000);
  CHECK(checked4 > 40'000);
  CHECK(clamped > 100);
  CHECK(checked_fp8 == std::size_t{4} * 4096);
}

// 4. convert<> and the bulk widen/narrow equal the per-group functions, and
// quantizing a dequantized group gives it back.
TEST_CASE("convert and the bulk widen and narrow agree with quantize and operator[]; quantizing is idempotent",
          "[quantized]") {
  const std::vector<float> data = random_floats(1, 2.0f, 256, 4000);
  const std::size_t groups = data.size() / group_size;
  std::vector<q8_0> n8(groups), c8(groups);
  std::vector<q4_0> n4(groups), c4(groups);
  ghostlink::detail::narrow(data.data(), data.size(), n8.data());
  ghostlink::detail::narrow(data.data(), data.size(), n4.data());
  ghostlink::convert<q8_0, float>(data, c8.data());
  ghostlink::convert<q4_0, float>(data, c4.data());
  std::vector<float> w8(data.size()), w4(data.size()), v8(data.size()), v4(data.size());
  ghostlink::detail::widen(n8.data(), groups, w8.data());
  ghostlink::detail::widen(n4.data(), groups, w4.data());
  ghostlink::convert<float, q8_0>(c8, v8.data());
  ghostlink::convert<float, q4_0>(c4, v4.data());
  std::size_t mismatched = 0, idempotent = 0;
  for (std::size_t g = 0; g < groups; ++g) {
    const q8_0 q8 = q8_0::quantize(group_at(data, g));
    const q4_0 q4 = q4_0::quantize(group_at(data, g));
    mismatched += !(n8[g] == q8 && c8[g] == q8 && n4[g] == q4 && c4[g] == q4);
    group_floats back8, back4;
    for (std::size_t i = 0; i < group_size; ++i) {
      const std::size_t at = g * group_size + i;
      back8[i] = q8[i], back4[i] = q4[i];
      mismatched +=
          !(same(back8[i], w8[at]) && same(back8[i], v8[at]) && same(back4[i], w4[at]) && same(back4[i], v4[at]));
    }
    if (normal_half(static_cast<float>(q8.d)) && normal_half(static_cast<float>(q4.d))) {
      mismatched += !(q8_0::quantize(back8) == q8 && q4_0::quantize(back4) == q4);
      ++idempotent;
    }
  }
  CHECK(mismatched == 0);
  CHECK(idempotent > 200);
  // Between group types: through floats.
  std::vector<q4_0> q4_of_q8(groups);
  ghostlink::convert<q4_0, q8_0>(n8, q4_of_q8.data());
  for (std::size_t g = 0; g < groups; ++g)
    mismatched +=
        !(q4_of_q8[g] == q4_0::quantize(std::span<const float, group_size>(w8.data() + g * group_size, group_size)));
  CHECK(mismatched == 0);
  // fp8: narrow divides by the scale (probed where x / s is at or next to a
  // midpoint between codes), widen multiplies; convert is scale 1.
  std::vector<fp8_e4m3> all(256), c(data.size());
  for (unsigned b = 0; b < 256; ++b) all[b] = fp8_e4m3::from_bits(static_cast<std::uint8_t>(b));
  ghostlink::convert<fp8_e4m3, float>(data, c.data());
  std::vector<float> wide(256), conv(256);
  ghostlink::convert<float, fp8_e4m3>(all, conv.data());
  for (std::size_t i = 0; i < data.size(); ++i) mismatched += c[i].bits != fp8_e4m3(data[i]).bits;
  const std::array<double, 127> values = e4m3_values();
  for (const float scale : {1.0f, 0.5f, 3.7f, 1e-3f}) {
    std::vector<float> x = data;
    for (std::size_t b = 0; b + 1 < values.size(); ++b) {
      const float mid = static_cast<float>((values[b] + values[b + 1]) / 2) * scale;
      for (int k = -4; k <= 4; ++k) x.push_back(std::bit_cast<float>(std::bit_cast<std::uint32_t>(mid) + k));
    }
    std::vector<fp8_e4m3> n(x.size());
    ghostlink::detail::narrow(x.data(), x.size(), n.data(), scale);
    for (std::size_t i = 0; i < x.size(); ++i) mismatched += n[i].bits != fp8_e4m3(x[i] / scale).bits;
    ghostlink::detail::widen(all.data(), all.size(), wide.data(), scale);
    for (std::size_t b = 0; b < 256; ++b) mismatched += !same(wide[b], scale * static_cast<float>(all[b]));
  }
  for (std::size_t b = 0; b < 256; ++b) mismatched += !same(conv[b], static_cast<float>(all[b]));
  CHECK(mismatched == 0);
}

// The vectorised quantizers (AVX2, what narrow() runs on a processor that
// has it) give the portable ones' bits, group for group and code for code;
// the portable path runs here on every machine. Groups the vector code
// hands back to the portable one (NaN, infinities, scales whose reciprocal
// overflows) are among them.
TEST_CASE("the vectorised quantizers give the portable quantizers' bits", "[quantized]") {
  std::vector<float> data;
  for (int shape = 0; shape < shapes; ++shape)
    for (const float scale : {1.0f, 1e-3f, 3e4f, 1e7f, 1e-30f, 1e-40f}) {
      const std::vector<float> r = random_floats(shape, scale, 64, 97u + static_cast<std::uint32_t>(shape));
      data.insert(data.end(), r.begin(), r.end());
    }
  for (const float t : {0.5f, 1.5f, 2.5f, 7.5f, 126.5f, -0.5f, -7.5f, -126.5f})
    for (const group_floats& g : boundary_groups(127.0f, {t}, 1.0f)) data.insert(data.end(), g.begin(), g.end());
  const float special[] = {0.0f, -0.0f, inf_f, -inf_f, std::numeric_limits<float>::quiet_NaN(), 1e38f, -3.0f, 3.0f};
  for (std::size_t g = 0; g < 16; ++g)
    for (std::size_t i = 0; i < group_size; ++i)
      data.push_back(i % 7 == g % 7 ? special[(g + i) % std::size(special)] : static_cast<float>(i) - 16.0f);
  const std::size_t groups = data.size() / group_size;
  const bool vectorised = ghostlink::detail::has_avx2_fma_f16c();
  INFO("AVX2: " << vectorised << ", " << groups << " groups");

  std::vector<q8_0> p8(groups), v8(groups);
  std::vector<q4_0> p4(groups), v4(groups);
  ghostlink::detail::narrow_portable(data.data(), data.size(), p8.data());
  ghostlink::detail::narrow_portable(data.data(), data.size(), p4.data());
  CHECK(ghostlink::detail::narrow_avx2(data.data(), data.size(), v8.data()) == vectorised);
  CHECK(ghostlink::detail::narrow_avx2(data.data(), data.size(), v4.data()) == vectorised);
  std::size_t differ8 = 0, differ4 = 0;
  for (std::size_t g = 0; g < groups; ++g) {
    // The portable path is the reference's, group by group.
    CHECK(p8[g] == q8_0::quantize(group_at(data, g)));
    if (vectorised) {
      differ8 += v8[g] == p8[g] ? 0 : 1;
      differ4 += v4[g] == p4[g] ? 0 : 1;
    }
  }
  CHECK(differ8 == 0);
  CHECK(differ4 == 0);

  for (const float scale : {1.0f, 0.5f, 3.7f, 1e-3f}) {
    INFO("fp8 scale " << scale);
    std::vector<fp8_e4m3> pf(data.size()), vf(data.size());
    ghostlink::detail::narrow_portable(data.data(), data.size() - 3, pf.data(),
                                       scale);  // a tail the vector loop leaves
    CHECK(ghostlink::detail::narrow_avx2(data.data(), data.size() - 3, vf.data(), scale) == vectorised);
    std::size_t differ = 0;
    for (std::size_t i = 0; vectorised && i + 3 < data.size(); ++i) differ += pf[i] == vf[i] ? 0 : 1;
    CHECK(differ == 0);
  }
}

}  // namespace quantized_tests
