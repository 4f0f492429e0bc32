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
#include <cstdio>
#include <cstdlib>
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

/// The bits a float reads back as from a cache storing T (16-bit types round
/// through T; conversion back is exact).
template <class T>
GHOSTLINK_FUZZ_QUIET std::uint32_t read_bits(float x) {
  return std::bit_cast<std::uint32_t>(static_cast<float>(T(x)));
}
template <class T>
GHOSTLINK_FUZZ_QUIET std::uint32_t raw_bits(T v) {
  if constexpr (std::is_same_v<T, float>)
    return std::bit_cast<std::uint32_t>(v);
  else
    return v.bits;
}

/// Compares `n` tokens read token-major into `keys`/`values` from `first`
/// on with what `e` holds.
template <class T, class W>
GHOSTLINK_FUZZ_QUIET void compare_tokens(const mepoch& e, std::size_t first, std::size_t n, std::size_t width,
                                         std::span<const float> keys, std::span<const float> values, const W& what) {
  for (std::size_t t = 0; t < n; ++t) {
    const recipe r = e.token(first + t);
    for (std::size_t lane = 0; lane < width; ++lane) {
      const std::size_t at = t * width + lane;
      const std::uint32_t k = std::bit_cast<std::uint32_t>(keys[at]), v = std::bit_cast<std::uint32_t>(values[at]);
      const std::uint32_t wk = read_bits<T>(token_float(r, lane, false)), wv = read_bits<T>(token_float(r, lane, true));
      if (k != wk || v != wv)
        fail(str(what, ": epoch ", e.number, " token ", first + t, " lane ", lane, ": keys bits 0x", std::hex, k,
                 " values 0x", v, ", model says 0x", wk, " and 0x", wv, std::dec, " (recipe ", r.serial, '/',
                 int(r.seed), ')'));
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
                                         std::size_t width, const where& what) {
  expect_eq(s.epoch(), e ? e->number : 0, what, "epoch()");
  expect_eq(s.size(), shown, what, "size()");
  expect_eq(s.empty(), shown == 0, what, "empty()");
  expect_eq(s.token_width(), e ? width : 0, what, "token_width()");
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
          if (first != next || count == 0 || first + count > end || k.size() != count * width || v.size() != k.size())
            fail(str(what, ": for_each_block(", begin, ", ", end, ") gave run ", first, "+", count, " with ", k.size(),
                     " keys, expected to start at ", next));
          for (std::size_t t = 0; t < count; ++t)
            for (std::size_t lane = 0; lane < width; ++lane) {
              const recipe r = e->token(first + t);
              if (raw_bits<T>(k[t * width + lane]) != raw_bits<T>(T(token_float(r, lane, false))) ||
                  raw_bits<T>(v[t * width + lane]) != raw_bits<T>(T(token_float(r, lane, true))))
                fail(str(what, ": for_each_block: token ", first + t, " lane ", lane, " differs from the model"));
            }
          next = first + count;
        });
    if (ec) fail(str(what, ": for_each_block(", begin, ", ", end, "): ", ec_name(ec)));
    if (next != end) fail(str(what, ": for_each_block(", begin, ", ", end, ") stopped at ", next));
  }
}

}  // namespace ghostlink::fuzz
