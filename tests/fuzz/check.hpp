#pragma once
// How the fuzzer compares what ghostlink shows with the model, and how it
// reports a difference: print it with the last operations, then abort() so
// that libFuzzer (or the replay program) records the input.

#include "common/str.hpp"
#include "model.hpp"

#include <ghostlink/element.hpp>
#include <ghostlink/snapshot.hpp>

#include <array>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace ghostlink::fuzz {

/// The last operations decoded, printed on failure (a ring, so recording
/// costs no allocation on the hot path).
struct trace {
  struct entry {
    const char* op = "";
    std::size_t a = 0, b = 0, c = 0;
  };
  std::array<entry, 24> ring{};
  std::size_t count = 0;
  std::string config;

  void add(const char* op, std::size_t a = 0, std::size_t b = 0, std::size_t c = 0) {
    ring[count++ % ring.size()] = {op, a, b, c};
    if (verbose()) std::fprintf(stderr, "#%zu %s %zu %zu %zu\n", count - 1, op, a, b, c);
  }
  /// GHOSTLINK_FUZZ_VERBOSE=1 prints every operation and its expected
  /// outcome as it runs (to read what a corpus file or crash does).
  static bool verbose() {
    // NOLINTNEXTLINE(concurrency-mt-unsafe): nothing in the fuzzer sets the environment
    static const bool on = std::getenv("GHOSTLINK_FUZZ_VERBOSE") != nullptr;
    return on;
  }
};

inline trace& current_trace() {
  static trace t;
  return t;
}

using ghostlink::test::str;

[[noreturn]] inline void fail(const std::string& what) {
  const trace& t = current_trace();
  std::fprintf(stderr, "\nghostlink fuzz: MISMATCH: %s\n  config: %s\n  last operations (oldest first):\n",
               what.c_str(), t.config.c_str());
  const std::size_t n = t.count < t.ring.size() ? t.count : t.ring.size();
  for (std::size_t i = t.count - n; i < t.count; ++i) {
    const trace::entry& e = t.ring[i % t.ring.size()];
    std::fprintf(stderr, "    #%zu %s %zu %zu %zu\n", i, e.op, e.a, e.b, e.c);
  }
  std::abort();
}

/// Names what a check looks at; printed only on failure, as checks run after
/// every operation and building strings each time would dominate.
struct where {
  const char* what = "";
  std::size_t index = 0;
  const char* part = nullptr;
  std::size_t part_index = 0;
  friend std::ostream& operator<<(std::ostream& os, const where& w) {
    os << w.what << ' ' << w.index;
    if (w.part) os << ' ' << w.part << ' ' << w.part_index;
    return os;
  }
};

inline std::string ec_name(ghostlink::error_code ec) {
  return ec ? str(ec.category().name(), ':', ec.value(), " (", ec.message(), ')') : "success";
}

inline void expect_ec(ghostlink::error_code got, ghostlink::error_code want, const std::string& what) {
  if (got != want) fail(str(what, ": got ", ec_name(got), ", model says ", ec_name(want)));
}

template <class A, class B>
void expect_eq(const A& got, const B& want, const std::string& what) {
  if (!(got == want)) fail(str(what, ": got ", got, ", model says ", want));
}

template <class A, class B>
GHOSTLINK_FUZZ_QUIET void expect_eq(const A& got, const B& want, const where& w, const char* field) {
  if (!(got == want)) fail(str(w, ": ", field, ": got ", got, ", model says ", want));
}

/// The element type's name, as the trace's config line prints it.
template <class T>
constexpr const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  if constexpr (std::is_same_v<T, half>) return "half";
  if constexpr (std::is_same_v<T, bfloat16>) return "bfloat16";
  if constexpr (std::is_same_v<T, q8_0>) return "q8_0";
  if constexpr (std::is_same_v<T, q4_0>) return "q4_0";
  if constexpr (std::is_same_v<T, fp8_e4m3>) return "fp8_e4m3";
}

/// Whether two stored `T`s are the same bits (a group: the same bytes).
template <class T>
GHOSTLINK_FUZZ_QUIET bool same_unit(const T& a, const T& b) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
  else
    return a == b;  // bitwise for every other storage type
}

/// A stored `T`'s bytes in hex (for a mismatch's report).
template <class T>
std::string unit_hex(const T& u) {
  std::array<unsigned char, sizeof(T)> bytes{};
  std::memcpy(bytes.data(), &u, sizeof(T));
  std::string out;
  for (unsigned char b : bytes) out += str(std::hex, b < 16 ? "0" : "", unsigned{b});
  return out;
}

/// What a cache of `T` is given for a token (lane_float) and stores and
/// reads back, as the model defines it from those floats: a 16-bit
/// type or float rounds each float (`T(x)`); fp8 stores `fp8_e4m3(x /
/// scale)` and reads `scale * float(code)`; a group type quantizes each 32
/// lanes with `T::quantize` (bit-exact against ggml in the unit tests) and
/// reads `g[i]`. A token never written (serial 0) is zero bytes (the zero
/// block, and the zeros a write puts in a gap), whatever the type: for q4_0
/// that is not `quantize` of zeros. A token's stored keys and values are
/// computed once per run (the serials are the run's).
template <class T>
class token_model {
 public:
  /// Elements per stored `T`.
  static constexpr std::size_t per = elements_per<T>;

  /// Lane `lane` of a token's keys (values) as written to a cache of `T`:
  /// token_float's, but for a group type a special token (seed's top bit)
  /// has a special in one lane of each group only, plain numbers in the
  /// others, unless the seed's next bit asks for specials everywhere (every
  /// group of those has all of them: an infinite `d`, read back as
  /// infinities and NaN).
  static GHOSTLINK_FUZZ_QUIET float lane_float(recipe r, std::size_t lane, bool value) {
    if constexpr (per != 1) {
      if ((r.seed & 0xc0) == 0x80 && lane % per != (r.seed + r.serial) % per)
        return token_float({r.serial, static_cast<std::uint8_t>(r.seed & 0x7f)}, lane, value);
    }
    return token_float(r, lane, value);
  }

  token_model(std::size_t width, float key_scale, float value_scale)
      : width_(width), units_(width / per), key_scale_(key_scale), value_scale_(value_scale), zeros_(2 * units_) {}

  /// Floats per token's keys (or values).
  std::size_t width() const { return width_; }
  /// Stored `T`s per token's keys (or values).
  std::size_t units() const { return units_; }
  float key_scale() const { return key_scale_; }
  float value_scale() const { return value_scale_; }

  /// The `2 * units()` Ts stored for token `r`: its keys, then its values.
  /// Valid until the next call.
  GHOSTLINK_FUZZ_QUIET const T* stored(recipe r) const {
    if (r.serial == 0) return zeros_.data();
    const std::size_t slot = r.serial;
    if (slot >= known_.size()) {
      known_.resize(2 * slot + 16, 0);
      memo_.resize(known_.size() * 2 * units_);
    }
    T* out = memo_.data() + slot * 2 * units_;
    if (!known_[slot]) {
      store(r, false, out);
      store(r, true, out + units_);
      known_[slot] = 1;
    }
    return out;
  }

  /// Lane `lane` of keys (values) stored as `units`, read back as a float.
  GHOSTLINK_FUZZ_QUIET float read(const T* units, std::size_t lane, bool value) const {
    if constexpr (std::is_same_v<T, float>)
      return units[lane];
    else if constexpr (std::is_same_v<T, fp8_e4m3>)
      return (value ? value_scale_ : key_scale_) * static_cast<float>(units[lane]);
    else if constexpr (per != 1)
      return units[lane / per][lane % per];
    else
      return static_cast<float>(units[lane]);
  }

  /// Whether a float read back is the model's: the same bits; for the
  /// quantized types any NaN for a NaN (a NaN's payload through a float
  /// multiply, `d * q` or `scale * code`, is not specified).
  static GHOSTLINK_FUZZ_QUIET bool same_float(float got, float want) {
    if (std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(want)) return true;
    constexpr bool quantized = std::is_same_v<T, fp8_e4m3> || per != 1;
    return quantized && got != got && want != want;
  }

 private:
  GHOSTLINK_FUZZ_QUIET void store(recipe r, bool value, T* out) const {
    if constexpr (per != 1) {
      std::array<float, per> group{};
      for (std::size_t u = 0; u < units_; ++u) {
        for (std::size_t i = 0; i < per; ++i) group[i] = lane_float(r, u * per + i, value);
        out[u] = T::quantize(std::span<const float, per>(group));
      }
    } else if constexpr (std::is_same_v<T, fp8_e4m3>) {
      const float scale = value ? value_scale_ : key_scale_;
      for (std::size_t lane = 0; lane < width_; ++lane) out[lane] = fp8_e4m3(lane_float(r, lane, value) / scale);
    } else {
      for (std::size_t lane = 0; lane < width_; ++lane) out[lane] = T(lane_float(r, lane, value));
    }
  }

  std::size_t width_, units_;
  float key_scale_, value_scale_;
  std::vector<T> zeros_;               // value-initialized: zero bytes
  mutable std::vector<T> memo_;        // per serial: keys, then values
  mutable std::vector<char> known_;    // per serial: memo_ holds it
};

/// Compares `n` tokens read token-major into `keys`/`values` from `first`
/// on with what `e` holds.
template <class T, class W>
GHOSTLINK_FUZZ_QUIET void compare_tokens(const token_model<T>& tm, const mepoch& e, std::size_t first, std::size_t n,
                                         std::span<const float> keys, std::span<const float> values, const W& what) {
  const std::size_t width = tm.width();
  for (std::size_t t = 0; t < n; ++t) {
    const recipe r = e.token(first + t);
    const T* stored = tm.stored(r);
    for (std::size_t lane = 0; lane < width; ++lane) {
      const std::size_t at = t * width + lane;
      const float wk = tm.read(stored, lane, false), wv = tm.read(stored + tm.units(), lane, true);
      if (!token_model<T>::same_float(keys[at], wk) || !token_model<T>::same_float(values[at], wv))
        fail(str(what, ": epoch ", e.number, " token ", first + t, " lane ", lane, ": keys bits 0x", std::hex,
                 std::bit_cast<std::uint32_t>(keys[at]), " values 0x", std::bit_cast<std::uint32_t>(values[at]),
                 ", model says 0x", std::bit_cast<std::uint32_t>(wk), " and 0x", std::bit_cast<std::uint32_t>(wv),
                 std::dec, " (recipe ", r.serial, '/', int(r.seed), ')'));
    }
  }
}

/// The token ranges a full check reads: all of them, or for a huge length
/// (zeros past a short stored prefix) its start and its end.
struct windows {
  std::array<std::pair<std::size_t, std::size_t>, 4> range{};
  std::size_t count = 0;
};
inline windows check_windows(std::size_t size) {
  windows w;
  if (size <= 96) {
    w.range[w.count++] = {0, size};
  } else {
    w.range[w.count++] = {0, 64};
    w.range[w.count++] = {size - 8, size};
  }
  return w;
}
/// `w`'s ranges without the positions [gap_begin, gap_end) (a window's
/// dropped ones); some may be empty.
inline windows held_windows(const windows& w, std::size_t gap_begin, std::size_t gap_end) {
  windows held;
  for (std::size_t i = 0; i < w.count; ++i) {
    const auto [b, e] = w.range[i];
    held.range[held.count++] = {b, std::max(b, std::min(e, gap_begin))};
    held.range[held.count++] = {std::min(e, std::max(b, gap_end)), e};
  }
  return held;
}

/// The sentinel output buffers are filled with, to see that a failed read
/// wrote nothing and a good one nothing past its data.
inline constexpr std::uint32_t sentinel_bits = 0x7fbadbadu;

inline void expect_sentinel(std::span<const float> buf, std::size_t from, const std::string& what) {
  for (std::size_t i = from; i < buf.size(); ++i)
    if (std::bit_cast<std::uint32_t>(buf[i]) != sentinel_bits) fail(str(what, ": wrote element ", i, " of the output"));
}

/// Everything a snapshot shows (epoch, size, width, tokens through
/// for_each_block) against epoch `e` (null: an empty
/// snapshot) narrowed to `shown` tokens.
template <class T>
GHOSTLINK_FUZZ_QUIET void check_snapshot(const basic_kv_snapshot<T>& s, const mepoch* e, std::size_t shown,
                                         const token_model<T>& tm, const where& what) {
  const std::size_t width = tm.width(), units = tm.units();
  expect_eq(s.epoch(), e ? e->number : 0, what, "epoch()");
  expect_eq(s.size(), shown, what, "size()");
  expect_eq(s.empty(), shown == 0, what, "empty()");
  expect_eq(s.token_width(), e ? width : 0, what, "token_width()");
  expect_eq(s.value_width(), e ? width : 0, what, "value_width()");
  expect_eq(s.key_scale(), e ? tm.key_scale() : 1.0f, what, "key_scale()");
  expect_eq(s.value_scale(), e ? tm.value_scale() : 1.0f, what, "value_scale()");
  expect_eq(s.window(), e ? e->window : 0, what, "window()");
  expect_eq(s.sink_tokens(), e ? e->sinks : 0, what, "sink_tokens()");
  expect_eq(s.kept_from(), e ? e->kept_from : 0, what, "kept_from()");
  if (!e) return;
  // A window's dropped positions: every read reaching one fails with
  // outside_window and writes nothing.
  const std::size_t gap_begin = e->sinks, gap_end = std::min(e->kept_from, shown);
  if (gap_begin < gap_end) {
    const std::size_t at = gap_begin + (gap_end - gap_begin) / 2;
    std::vector<float> keys(width, std::bit_cast<float>(sentinel_bits)), values = keys;
    if (s.read_kv(at, keys, values) != kv_errc::outside_window)
      fail(str(what, ": read_kv(", at, ") of a dropped position"));
    expect_sentinel(keys, 0, str(what, ": read_kv of a dropped position"));
    expect_sentinel(values, 0, str(what, ": read_kv of a dropped position"));
    if (s.for_each_block(0, shown, [&](std::size_t, std::size_t, auto, auto) {
          fail(str(what, ": for_each_block over a dropped position called f"));
        }) != kv_errc::outside_window)
      fail(str(what, ": for_each_block(0, ", shown, ") over dropped positions"));
  }
  // The stored elements themselves, zero-copy; the explicit read operations
  // check the converting reads (a read_range here too doubled the run time).
  windows win = check_windows(shown);
  if (gap_begin < gap_end) win = held_windows(win, gap_begin, gap_end);
  for (std::size_t i = 0; i < win.count; ++i) {
    const auto [begin, end] = win.range[i];
    if (begin == end) continue;
    std::size_t next = begin;
    const ghostlink::error_code ec =
        s.for_each_block(begin, end, [&](std::size_t first, std::size_t count, auto k, auto v) GHOSTLINK_FUZZ_QUIET {
          if (first != next || count == 0 || first + count > end || k.size() != count * units || v.size() != k.size())
            fail(str(what, ": for_each_block(", begin, ", ", end, ") gave run ", first, "+", count, " with ", k.size(),
                     " keys, expected to start at ", next, " with ", count * units, " stored per span"));
          for (std::size_t t = 0; t < count; ++t) {
            const T* want = tm.stored(e->token(first + t));
            for (std::size_t u = 0; u < units; ++u) {
              const T &gk = k[t * units + u], &gv = v[t * units + u];
              if (!same_unit(gk, want[u]) || !same_unit(gv, want[units + u]))
                fail(str(what, ": for_each_block: token ", first + t, " stored unit ", u, " (lanes ",
                         u * token_model<T>::per, "+", token_model<T>::per, ") differs from the model: keys ",
                         unit_hex(gk), " values ", unit_hex(gv), ", model says ", unit_hex(want[u]), " and ",
                         unit_hex(want[units + u]), " (recipe ", e->token(first + t).serial, '/',
                         int(e->token(first + t).seed), ')'));
            }
          }
          next = first + count;
        });
    if (ec) fail(str(what, ": for_each_block(", begin, ", ", end, "): ", ec_name(ec)));
    if (next != end) fail(str(what, ": for_each_block(", begin, ", ", end, ") stopped at ", next));
  }
}

}  // namespace ghostlink::fuzz
