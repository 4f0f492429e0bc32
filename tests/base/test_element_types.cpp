// 16-bit storage: half and bfloat16 conversions against bit patterns derived
// by hand and against an independent reference (nearest value by double
// arithmetic), then half and bfloat16 caches end to end.
#include "common/sequence_support.hpp"

#ifdef GHOSTLINK_CATCH2_V3
#include <catch2/catch_template_test_macros.hpp>
#endif

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace element_types_tests {

using namespace ghostlink;
using namespace ghostlink::test::seq;

namespace {

float float_of(std::uint32_t u) { return std::bit_cast<float>(u); }

// ---- the format of each 16-bit type, for the independent reference ----

/// half: 5 exponent bits (bias 15), 10 mantissa bits.
struct half_format {
  using type = half;
  static constexpr std::uint16_t inf = 0x7c00, mantissa_mask = 0x03ff;
  /// The value of the non-negative pattern `b` by the formula, in double;
  /// for `inf` it is 2^16, the next binade's first value: rounding up to it
  /// is overflow.
  static double value(std::uint16_t b) {
    const int e = b >> 10, m = b & 0x3ff;
    return e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  }
};

/// bfloat16: 8 exponent bits (bias 127), 7 mantissa bits.
struct bfloat16_format {
  using type = bfloat16;
  static constexpr std::uint16_t inf = 0x7f80, mantissa_mask = 0x007f;
  static double value(std::uint16_t b) {
    const int e = b >> 7, m = b & 0x7f;
    return e == 0 ? std::ldexp(m, -133) : std::ldexp(128 + m, e - 134);
  }
};

template <class Format>
bool is_nan_bits(std::uint16_t b) {
  return (b & Format::inf) == Format::inf && (b & Format::mantissa_mask) != 0;
}

/// Float -> 16 bits without the library: the nearest of the sorted
/// non-negative finite values (plus the overflow point, whose pattern is
/// infinity) by double arithmetic, ties to the even pattern.
template <class Format>
class reference {
 public:
  reference() {
    for (std::uint32_t b = 0; b <= Format::inf; ++b) values_.push_back(Format::value(static_cast<std::uint16_t>(b)));
  }
  /// The pattern `f` should round to (never called with NaN).
  std::uint16_t operator()(float f) const {
    const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
    const double a = std::fabs(static_cast<double>(f));
    if (a >= values_.back()) return sign | Format::inf;
    const auto hi = std::upper_bound(values_.begin(), values_.end(), a);
    const auto lo = hi - 1;
    const double below = a - *lo, above = *hi - a;  // exact: neighbours in double
    auto pick = below < above ? lo : above < below ? hi : ((lo - values_.begin()) % 2 == 0 ? lo : hi);
    return sign | static_cast<std::uint16_t>(pick - values_.begin());
  }
  const std::vector<double>& values() const { return values_; }

 private:
  std::vector<double> values_;  // values_[b] for b in [0, inf]
};

/// Checks `f` converts to `reference(f)` (or to a NaN of f's sign).
template <class Format>
void check_against_reference(const reference<Format>& ref, float f, mismatches& bad) {
  const typename Format::type converted(f);
  const std::uint16_t got = converted.bits;
  if (std::isnan(f)) {
    if (!is_nan_bits<Format>(got) || (got >> 15) != (bits32(f) >> 31))
      bad.add("float " + hex(bits32(f)) + " (NaN) became " + hex(got));
    return;
  }
  if (const std::uint16_t want = ref(f); got != want)
    bad.add("float " + hex(bits32(f)) + " (" + std::to_string(f) + ") became " + hex(got) + ", expected " + hex(want));
}

struct conversion {
  const char* what;
  float in;
  std::uint16_t out;
};

constexpr float two_pow(int e) { return e >= 0 ? float(1ull << e) : 1.0f / float(1ull << -e); }

}  // namespace

TEST_CASE("float to half rounds to the hand-derived IEEE binary16 bit patterns; NaN stays a quiet NaN", "[element]") {
  // half = sign | 5-bit exponent (bias 15) | 10-bit mantissa.
  const conversion table[] = {
      {"1.0: exponent 15 = 01111, mantissa 0", 1.0f, 0x3c00},
      {"-2.0: sign, exponent 16 = 10000", -2.0f, 0xc000},
      {"0.1 = 1.6 * 2^-4: exponent 11, mantissa 0.6*1024 = 614.4 -> 614", 0.1f, 0x2e66},
      {"65504 = (2 - 2^-10) * 2^15: largest finite", 65504.0f, 0x7bff},
      {"-65504", -65504.0f, 0xfbff},
      {"65520: halfway to 2^16, ties to the even pattern 0x7c00 = inf", 65520.0f, 0x7c00},
      {"largest float below 65520: rounds down to 65504", std::nextafter(65520.0f, 0.0f), 0x7bff},
      {"65536 and above overflow", 65536.0f, 0x7c00},
      {"largest float overflows", std::numeric_limits<float>::max(), 0x7c00},
      {"2^-24: smallest subnormal, mantissa 1", two_pow(-24), 0x0001},
      {"2^-25: halfway between 0 and 2^-24, ties to even 0", two_pow(-25), 0x0000},
      {"just above 2^-25 rounds up to 2^-24", std::nextafter(two_pow(-25), 1.0f), 0x0001},
      {"-2^-25: ties to even -0", -two_pow(-25), 0x8000},
      {"3 * 2^-25: halfway between 1 and 2 subnormal ulps, ties to even 2", 3 * two_pow(-25), 0x0002},
      {"1023 * 2^-24: largest subnormal", 1023 * two_pow(-24), 0x03ff},
      {"1023.5 * 2^-24: halfway from largest subnormal to 2^-14, ties to even 0x0400", 1023.5f * two_pow(-24), 0x0400},
      {"2^-14: smallest normal, exponent 1", two_pow(-14), 0x0400},
      {"smallest float subnormal underflows to 0", std::numeric_limits<float>::denorm_min(), 0x0000},
      {"inf: exponent all ones, mantissa 0", std::numeric_limits<float>::infinity(), 0x7c00},
      {"-inf", -std::numeric_limits<float>::infinity(), 0xfc00},
      {"-0.0 keeps its sign", -0.0f, 0x8000},
      {"1 + 2^-11: halfway between 0x3c00 and 0x3c01, ties to even 0x3c00", 1.0f + two_pow(-11), 0x3c00},
      {"1 + 3 * 2^-11: halfway between 0x3c01 and 0x3c02, ties to even 0x3c02", 1.0f + 3 * two_pow(-11), 0x3c02},
      {"1 + 2^-11 + 2^-23: just past the tie rounds up", 1.0f + two_pow(-11) + two_pow(-23), 0x3c01},
      {"2049 = 2048 + 1: halfway between 2048 and 2050, ties to even 2048", 2049.0f, 0x6800},
  };
  for (const conversion& c : table) {
    const std::uint16_t got = half(c.in).bits;
    INFO(c.what << ": float " << hex(bits32(c.in)) << " became " << hex(got) << ", expected " << hex(c.out));
    CHECK(got == c.out);
  }
  // Any float NaN, even one whose payload sits in bits a half drops, is a
  // quiet half NaN (exponent all ones, top mantissa bit set) with its sign.
  for (std::uint32_t n : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7fa00000u}) {
    const std::uint16_t got = half(float_of(n)).bits;
    INFO("float NaN " << hex(n) << " became " << hex(got) << ": must be a quiet NaN with the same sign");
    CHECK((got & 0x7e00) == 0x7e00);
    CHECK((got >> 15) == (n >> 31));
  }
}

TEST_CASE("float to bfloat16 rounds to the hand-derived bit patterns; NaN stays a quiet NaN", "[element]") {
  // bfloat16 = the top 16 bits of a float: sign | 8-bit exponent | 7-bit mantissa.
  const conversion table[] = {
      {"1.0 = float 0x3f800000", 1.0f, 0x3f80},
      {"-2.0 = float 0xc0000000", -2.0f, 0xc000},
      {"0.1 = float 0x3dcccccd: low half 0xcccd > 0x8000 rounds up", 0.1f, 0x3dcd},
      {"1 + 2^-8 = float 0x3f808000: tie, to even 0x3f80", 1.0f + two_pow(-8), 0x3f80},
      {"1 + 3 * 2^-8 = float 0x3f818000: tie, to even 0x3f82", 1.0f + 3 * two_pow(-8), 0x3f82},
      {"1 + 2^-8 + 2^-23 = float 0x3f808001: past the tie, up", 1.0f + two_pow(-8) + two_pow(-23), 0x3f81},
      {"float 0x7f7f7fff: below the tie, largest finite 0x7f7f", float_of(0x7f7f7fffu), 0x7f7f},
      {"float 0x7f7f8000: tie between 0x7f7f and inf, to even inf", float_of(0x7f7f8000u), 0x7f80},
      {"largest float 0x7f7fffff overflows to inf", std::numeric_limits<float>::max(), 0x7f80},
      {"-largest float overflows to -inf", -std::numeric_limits<float>::max(), 0xff80},
      {"inf", std::numeric_limits<float>::infinity(), 0x7f80},
      {"-inf", -std::numeric_limits<float>::infinity(), 0xff80},
      {"-0.0 keeps its sign", -0.0f, 0x8000},
      {"float 0x00010000 = 2^-133: smallest bfloat16 subnormal", float_of(0x00010000u), 0x0001},
      {"float 0x00008000: halfway to the smallest subnormal, ties to even 0", float_of(0x00008000u), 0x0000},
      {"float 0x00018000: halfway between subnormals 1 and 2, ties to even 2", float_of(0x00018000u), 0x0002},
      {"float 0x007fffff, largest float subnormal: rounds up to 2^-126", float_of(0x007fffffu), 0x0080},
  };
  for (const conversion& c : table) {
    const std::uint16_t got = bfloat16(c.in).bits;
    INFO(c.what << ": float " << hex(bits32(c.in)) << " became " << hex(got) << ", expected " << hex(c.out));
    CHECK(got == c.out);
  }
  for (std::uint32_t n : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    const std::uint16_t got = bfloat16(float_of(n)).bits;
    INFO("float NaN " << hex(n) << " became " << hex(got) << ": must be a quiet NaN with the same sign");
    CHECK((got & 0x7fc0) == 0x7fc0);  // exponent all ones, top mantissa bit set
    CHECK((got >> 15) == (n >> 31));
  }
}

TEMPLATE_TEST_CASE("every 16-bit pattern converts to its exact float value and back to itself", "[element]",
                   half_format, bfloat16_format) {
  using T = typename TestType::type;
  mismatches bad;
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b), magnitude = static_cast<std::uint16_t>(b & 0x7fff);
    const bool negative = (bits & 0x8000) != 0;
    const float f = static_cast<float>(T::from_bits(bits));
    const T back(f);
    if (is_nan_bits<TestType>(magnitude)) {  // NaN: stays a NaN of its sign both ways
      if (!std::isnan(f) || std::signbit(f) != negative || !is_nan_bits<TestType>(back.bits) ||
          (back.bits & 0x8000) != (bits & 0x8000))
        bad.add("NaN " + hex(bits) + " became float " + hex(bits32(f)) + " and came back as " + hex(back.bits));
      continue;
    }
    const double want =
        std::copysign(magnitude == TestType::inf ? HUGE_VAL : TestType::value(magnitude), negative ? -1.0 : 1.0);
    if (bits32(f) != bits32(static_cast<float>(want)))
      bad.add(hex(bits) + " became float " + hex(bits32(f)) + ", expected " + std::to_string(want));
    if (back.bits != bits) bad.add(hex(bits) + " came back as " + hex(back.bits));
  }
  INFO(bad.count << " mismatch(es), first:\n" << bad.first);
  CHECK(bad.count == 0);
}

TEMPLATE_TEST_CASE("bulk widening of every 16-bit pattern gives the same floats as converting one by one", "[element]",
                   half_format, bfloat16_format) {
  using T = typename TestType::type;
  std::vector<T> all;
  for (std::uint32_t b = 0; b <= 0xffff; ++b) all.push_back(T::from_bits(static_cast<std::uint16_t>(b)));
  mismatches bad;
  for (std::size_t skip = 0; skip <= 8; ++skip) {  // every alignment and tail of a vectorised loop
    const std::span<const T> src = std::span<const T>(all).subspan(skip);
    std::vector<float> out(src.size());
    convert<float, T>(src, out.data());
    for (std::size_t i = 0; i < src.size(); ++i) {
      const float one = static_cast<float>(src[i]);
      const bool same = is_nan_bits<TestType>(src[i].bits & 0x7fff)
                            ? std::isnan(out[i]) && std::signbit(out[i]) == std::signbit(one)
                            : bits32(out[i]) == bits32(one);
      if (!same)
        bad.add(hex(src[i].bits) + " (skip " + std::to_string(skip) + "): bulk " + hex(bits32(out[i])) +
                ", one by one " + hex(bits32(one)));
    }
  }
  INFO(bad.count << " mismatch(es), first:\n" << bad.first);
  CHECK(bad.count == 0);
}

TEMPLATE_TEST_CASE("float to 16 bits matches an independent nearest-even reference over all float ranges", "[element]",
                   half_format, bfloat16_format) {
  using format = TestType;
  const reference<format> ref;
  mismatches bad;
  std::size_t checked = 0;
  // Every 4099th bit pattern over the whole 32-bit range: both signs, every
  // exponent, NaNs and infinities included.
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 4099, ++checked)
    check_against_reference(ref, float_of(static_cast<std::uint32_t>(u)), bad);
  // Edges: each representable value, its float neighbours, and each midpoint
  // between neighbours (a tie) with its float neighbours, for both signs.
  const auto& values = ref.values();
  for (std::size_t b = 0; b + 1 < values.size(); ++b) {
    const auto exact = static_cast<float>(values[b]);
    const auto mid = static_cast<float>((values[b] + values[b + 1]) / 2);  // exact: needs one bit more
    const float inf = std::numeric_limits<float>::infinity();
    for (float x : {exact, std::nextafter(exact, inf), std::nextafter(exact, -inf), mid, std::nextafter(mid, inf),
                    std::nextafter(mid, -inf)}) {
      check_against_reference(ref, x, bad);
      check_against_reference(ref, -x, bad);
      checked += 2;
    }
  }
  INFO(bad.count << " of " << checked << " conversions differ from the reference, first:\n" << bad.first);
  CHECK(bad.count == 0);
}

namespace {

using ghostlink::test::small_config;

/// Inputs that round in both 16-bit types (ties, subnormals, overflow, NaN,
/// more significant bits than either keeps); `shift` picks another mix.
std::vector<float> awkward(std::size_t width, std::size_t index, std::size_t shift) {
  const float inputs[] = {
      0.1f,     1.0f / 3.0f, 1.0f + two_pow(-11), 65519.0f, 70000.0f, 3 * two_pow(-25),
      -2049.0f, 1e-30f,      123456.789f,         -0.0f,    3.0e38f,  std::numeric_limits<float>::quiet_NaN(),
      2.5e-40f};
  constexpr std::size_t count = std::size(inputs);
  std::vector<float> v(width);
  for (std::size_t lane = 0; lane < width; ++lane) v[lane] = inputs[(index + lane + shift) % count];
  return v;
}

/// Logs where `got` is not `in` stored as T, bit for bit.
template <class T>
void expect_stored(mismatches& bad, const std::string& where, std::span<const float> got, std::span<const float> in) {
  for (std::size_t lane = 0; lane < in.size(); ++lane)
    if (bits32(got[lane]) != bits32(stored<T>(in[lane])))
      bad.add(where + " lane " + std::to_string(lane) + ": read " + hex(bits32(got[lane])) + ", wrote " +
              hex(bits32(in[lane])) + ", expected " + hex(bits32(stored<T>(in[lane]))));
}

/// Checks token `i` of `snap` reads back as `keys`/`values` stored as T.
template <class T>
void expect_token(mismatches& bad, const std::string& where, const basic_kv_snapshot<T>& snap, std::size_t i,
                  std::span<const float> keys, std::span<const float> values) {
  kv_entry e;
  if (ghostlink::error_code ec = snap.read_kv(i, e)) return bad.add(where + ": read_kv " + ec.message());
  expect_stored<T>(bad, where + " token " + std::to_string(i) + " keys", e.keys, keys);
  expect_stored<T>(bad, where + " token " + std::to_string(i) + " values", e.values, values);
}

/// Makes `n` tokens of `c` valid and writes awkward inputs to each (keys
/// mixed by `shift`, values by shift + 5); returns the keys and the values.
template <class T>
std::array<std::vector<std::vector<float>>, 2> fill(basic_layer_kv_cache<T>& c, std::size_t n, std::size_t shift) {
  std::array<std::vector<std::vector<float>>, 2> kv;
  REQUIRE_FALSE(initialize(c, n));
  for (std::size_t i = 0; i < n; ++i) {
    kv[0].push_back(awkward(c.config().token_width(), i, shift));
    kv[1].push_back(awkward(c.config().token_width(), i, shift + 5));
    REQUIRE_FALSE(write(c, i, kv[0][i], kv[1][i]));
  }
  return kv;
}

}  // namespace

TEMPLATE_TEST_CASE("a 16-bit cache reads back each written float rounded to its storage type", "[element][cache]", half,
                   bfloat16) {
  asio::thread_pool threads{2};
  basic_layer_kv_cache<TestType> cache(threads, small_config());
  const std::size_t w = cache.config().token_width(), n = 6;  // two blocks of 4
  const auto [keys, values] = fill(cache, n, 0);
  const basic_kv_snapshot<TestType> snap = cache.snapshot();
  REQUIRE(snap.size() == n);
  mismatches bad;
  std::size_t rounded = 0;  // inputs that did change: the test is not vacuous
  for (std::size_t i = 0; i < n; ++i) {
    expect_token(bad, "read_kv", snap, i, keys[i], values[i]);
    for (float x : keys[i]) rounded += bits32(stored<TestType>(x)) != bits32(x) ? 1 : 0;
  }
  kv_range range;
  REQUIRE_FALSE(snap.read_range(0, n, range));
  for (std::size_t i = 0; i < n; ++i) {
    const auto at = std::span(range.keys).subspan(i * w, w), vat = std::span(range.values).subspan(i * w, w);
    expect_stored<TestType>(bad, "read_range keys of token " + std::to_string(i), at, keys[i]);
    expect_stored<TestType>(bad, "read_range values of token " + std::to_string(i), vat, values[i]);
  }
  const kv_entry async_read = cache.async_read_kv(n - 1, asio::use_future).get();
  expect_stored<TestType>(bad, "async_read_kv keys", async_read.keys, keys[n - 1]);

  std::size_t tokens_seen = 0;
  REQUIRE_FALSE(snap.for_each_block(0, n, [&](std::size_t first, std::size_t count, auto k, auto v) {
    static_assert(std::is_same_v<decltype(k), std::span<const TestType>>, "for_each_block hands out the stored type");
    static_assert(std::is_same_v<decltype(v), std::span<const TestType>>, "for_each_block hands out the stored type");
    for (std::size_t t = 0; t < count; ++t)
      for (std::size_t lane = 0; lane < w; ++lane) {
        const TestType want_k(keys[first + t][lane]), want_v(values[first + t][lane]);
        if (k[t * w + lane] != want_k || v[t * w + lane] != want_v)
          bad.add("for_each_block token " + std::to_string(first + t) + " lane " + std::to_string(lane) + ": bits " +
                  hex(k[t * w + lane].bits) + "/" + hex(v[t * w + lane].bits) + ", expected " + hex(want_k.bits) + "/" +
                  hex(want_v.bits));
      }
    tokens_seen += count;
  }));
  CHECK(tokens_seen == n);
  INFO(bad.count << " mismatch(es), first:\n" << bad.first);
  CHECK(bad.count == 0);
  CHECK(rounded > 0);
}

TEMPLATE_TEST_CASE("a 16-bit cache's blocks take half the bytes of a float cache's for the same tokens",
                   "[element][cache]", half, bfloat16) {
  static_assert(sizeof(TestType) == 2);
  const kv_cache_config config = small_config();
  const std::size_t bytes16 = kv_block_pool::block_bytes_for<TestType>(config);
  const std::size_t bytes32 = kv_block_pool::block_bytes_for<float>(config);
  INFO("16-bit block " << bytes16 << " bytes, float block " << bytes32 << " bytes");
  CHECK(2 * bytes16 == bytes32);
  CHECK(bytes16 == 2 * config.block_tokens * config.token_width() * sizeof(std::uint16_t));

  asio::thread_pool threads{2};
  basic_layer_kv_cache<TestType> narrow(threads, config);
  layer_kv_cache wide(threads, config);
  CHECK(narrow.pool().block_bytes() == bytes16);
  const std::size_t n = 10;
  fill(narrow, n, 0);
  fill(wide, n, 0);
  const kv_cache_stats s16 = narrow.stats(), s32 = wide.stats();
  INFO("16-bit: " << s16.blocks_in_use << " blocks, " << s16.bytes_in_use << " bytes; float: " << s32.blocks_in_use
                  << " blocks, " << s32.bytes_in_use << " bytes");
  CHECK(s16.blocks_in_use == (n + config.block_tokens - 1) / config.block_tokens);
  CHECK(s16.blocks_in_use == s32.blocks_in_use);
  CHECK(2 * s16.bytes_in_use == s32.bytes_in_use);
  CHECK(narrow.pool().stats().bytes_in_use() == s16.bytes_in_use);
}

TEMPLATE_TEST_CASE("a 16-bit cache forks sharing its blocks and truncates, each side keeping its own values",
                   "[element][cache]", half, bfloat16) {
  asio::thread_pool threads{2};
  basic_layer_kv_cache<TestType> parent(threads, small_config());
  const std::size_t w = parent.config().token_width(), n = 6;
  const auto [keys, values] = fill(parent, n, 2);
  const std::size_t blocks_before = parent.pool().stats().blocks_in_use;
  basic_layer_kv_cache<TestType> child = parent.async_fork(asio::use_future).get();
  REQUIRE(child.valid());
  CHECK(child.pool() == parent.pool());
  CHECK(child.size() == n);
  INFO("blocks in use before the fork " << blocks_before << ", after " << parent.pool().stats().blocks_in_use);
  CHECK(parent.pool().stats().blocks_in_use == blocks_before);

  const auto other_k = ghostlink::test::filled(w, 0.1f), other_v = ghostlink::test::filled(w, -1.0f / 3.0f);
  REQUIRE_FALSE(write(child, 1, other_k, other_v));  // copy-on-write of a shared block
  REQUIRE_FALSE(truncate(parent, 3));
  CHECK(parent.size() == 3);
  CHECK(child.size() == n);

  mismatches bad;
  const basic_kv_snapshot<TestType> ps = parent.snapshot(), cs = child.snapshot();
  for (std::size_t i = 0; i < 3; ++i) expect_token(bad, "parent", ps, i, keys[i], values[i]);
  for (std::size_t i = 0; i < n; ++i)
    expect_token(bad, "child", cs, i, i == 1 ? other_k : keys[i], i == 1 ? other_v : values[i]);

  // The child truncates below and writes past its end: skipped tokens are zeros.
  REQUIRE_FALSE(truncate(child, 2));
  REQUIRE_FALSE(write(child, 4, keys[4], values[4]));
  const basic_kv_snapshot<TestType> cs2 = child.snapshot();
  CHECK(cs2.size() == 5);
  const auto zeros = ghostlink::test::filled(w, 0.0f);
  expect_token(bad, "child after truncate", cs2, 2, zeros, zeros);
  expect_token(bad, "child after truncate", cs2, 3, zeros, zeros);
  expect_token(bad, "child after truncate", cs2, 4, keys[4], values[4]);
  expect_token(bad, "child after truncate", cs2, 1, other_k, other_v);
  INFO(bad.count << " mismatch(es), first:\n" << bad.first);
  CHECK(bad.count == 0);
}

}  // namespace element_types_tests
