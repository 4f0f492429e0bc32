#pragma once
// Operations on held snapshots: reads into caller buffers (of arbitrary
// sizes) with arbitrary indexes and ranges, prefix, move, release.

#include "world.hpp"

#include <bit>
#include <string>
#include <utility>
#include <vector>

namespace ghostlink::fuzz {

/// `needed` floats give or take one, at most `cap` (a read that needs more
/// must then fail with buffer_too_small before touching it).
inline std::vector<float> output_buffer(std::size_t needed, std::uint8_t b) {
  constexpr std::size_t cap = 4096;
  std::size_t n = needed;
  if (needed > cap)
    n = 16;
  else if (b % 4 == 0 && needed > 0)
    n = needed - 1;
  else if (b % 4 == 3)
    n = needed + 1;
  return std::vector<float>(n, std::bit_cast<float>(sentinel_bits));
}

/// One read of held snapshot `k` through the span, kv_entry, kv_range or
/// for_each_block interface; the result must be what the model says, and a
/// failed read must leave its outputs untouched.
template <class T>
void snapshot_read(world<T>& w, std::size_t k) {
  const auto& s = w.snaps[k];
  const mepoch* e = s.m.get();
  const std::size_t shown = s.shown, width = e ? w.width() : 0;
  const std::uint8_t variant = w.in.byte() % 5;
  std::size_t begin = w.pick_index(shown), end = variant == 0 || variant == 2 ? begin + 1 : w.pick_index(shown);
  ghostlink::error_code want;
  if (variant == 0 || variant == 2) {
    if (begin >= shown) want = kv_errc::index_out_of_range;
  } else if (begin > end) {
    want = kv_errc::invalid_range;
  } else if (end > shown) {
    want = kv_errc::range_out_of_bounds;
  } else if (variant != 1 && end - begin > 64) {
    end = begin + (end - begin) % 65;  // copies out or walks the range: keep it small
  }
  current_trace().add("snapshot_read", variant, begin, end);
  const std::string what = str("held snapshot ", k, variant == 0 || variant == 2 ? " read_kv(" : " read_range(", begin,
                               variant == 0 || variant == 2 ? "" : str(", ", end), ") variant ", int(variant));
  // Tokens the read covers, if its range is good (`end - begin` cannot
  // overflow times the width: the config bounds max_tokens * width).
  const std::size_t tokens = want ? 0 : end - begin;

  if (variant == 0 || variant == 1) {
    std::vector<float> keys = output_buffer(tokens * width, w.in.byte());
    std::vector<float> values = output_buffer(tokens * width, w.in.byte());
    if (!want && (keys.size() < tokens * width || values.size() < tokens * width)) want = kv_errc::buffer_too_small;
    const ghostlink::error_code ec =
        variant == 0 ? s.real.read_kv(begin, keys, values) : s.real.read_range(begin, end, keys, values);
    expect_ec(ec, want, what);
    const std::size_t written = want ? 0 : tokens * width;
    if (written > 0) compare_tokens(w.tm, *e, begin, tokens, keys, values, what.c_str());
    expect_sentinel(keys, written, what + " keys");
    expect_sentinel(values, written, what + " values");
  } else if (variant == 2) {
    kv_entry out{{1.0f}, {2.0f}};
    expect_ec(s.real.read_kv(begin, out), want, what);
    const std::size_t n = want ? 0 : width;
    if (out.keys.size() != n || out.values.size() != n) fail(str(what, ": entry holds ", out.keys.size(), " keys"));
    if (n > 0) compare_tokens(w.tm, *e, begin, 1, out.keys, out.values, what.c_str());
  } else if (variant == 3) {
    kv_range out{7, 9, {1.0f}, {2.0f}};
    expect_ec(s.real.read_range(begin, end, out), want, what);
    if (out.begin != begin || out.end != end) fail(what + ": kv_range's begin/end not set");
    const std::size_t n = want ? 0 : tokens * width;
    if (out.keys.size() != n || out.values.size() != n) fail(str(what, ": range holds ", out.keys.size(), " keys"));
    if (n > 0) compare_tokens(w.tm, *e, begin, tokens, out.keys, out.values, what.c_str());
  } else {
    std::size_t next = begin;
    const ghostlink::error_code ec =
        s.real.for_each_block(begin, end, [&](std::size_t first, std::size_t count, auto, auto) {
          if (want) fail(what + ": called f on a failed read");
          if (first != next || count == 0 || first + count > end) fail(str(what, ": run ", first, "+", count));
          next = first + count;
        });
    expect_ec(ec, want, what);
    if (!want && next != end) fail(str(what, ": runs stopped at ", next));
  }
}

/// Narrows, moves out, or replaces with an empty one, held snapshot `k`.
template <class T>
void snapshot_reshape(world<T>& w, std::size_t k) {
  auto& s = w.snaps[k];
  const std::uint8_t b = w.in.byte();
  current_trace().add("snapshot_reshape", b % 3);
  if (b % 3 == 0) {
    const std::size_t n = w.pick_index(s.shown);
    s.real = std::move(s.real).prefix(n);
    s.shown = std::min(n, s.shown);
  } else if (b % 3 == 1) {
    // The moved-to snapshot shows the same; the moved-from one is empty.
    typename world<T>::snap_slot moved{std::move(s.real), s.m, s.shown};
    s.m = nullptr;
    s.shown = 0;
    if (w.snaps.size() < world<T>::max_snaps) w.snaps.push_back(std::move(moved));
  } else {
    s.real = basic_kv_snapshot<T>();
    s.m = nullptr;
    s.shown = 0;
  }
}

}  // namespace ghostlink::fuzz
