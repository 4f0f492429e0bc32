#pragma once
/// @file
/// `basic_kv_snapshot<T>` (`kv_snapshot` for float caches): a pinned,
/// immutable view of one published epoch.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <system_error>
#include <type_traits>
#include <utility>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/detail/cache_access.hpp"
#include "ghostlink/detail/pinned_epoch.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/error.hpp"
#include "ghostlink/types.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// A move-only handle that pins one published epoch of a
/// `basic_layer_kv_cache<T>`.
///
/// What it shows never changes, whatever is written later: its size, its
/// epoch number and every token it covers. It may be held across `co_await`,
/// moved to another thread and destroyed there; releasing the last snapshot
/// of an epoch frees the blocks only that epoch could reach. All const
/// member functions are safe to call from many threads at once; moving from
/// or assigning to a snapshot is not, as for any object.
///
/// Reads into `float` spans convert from the stored type `T` exactly (an
/// `fp8_e4m3` times its scale, `kv_cache_config::key_scale` or
/// `value_scale`; a group type `d * q`); `for_each_block` hands out the
/// stored `T`s themselves.
///
/// A default-constructed or moved-from snapshot is empty: size 0, epoch 0.
template <storage_element T>
class basic_kv_snapshot {
 public:
  /// The stored element type.
  using value_type = T;

  /// An empty snapshot: size 0, epoch 0, no epoch pinned.
  basic_kv_snapshot() noexcept = default;
  /// Takes over the other snapshot's pin; the other is left empty.
  basic_kv_snapshot(basic_kv_snapshot&&) noexcept = default;
  /// Releases this snapshot's pin (which, if it held its epoch's last
  /// reference, frees the blocks only that epoch could reach, on this
  /// thread) and takes over the other's; the other is left empty.
  basic_kv_snapshot& operator=(basic_kv_snapshot&&) noexcept = default;
  /// Not copyable: move it, or call `snapshot()` again.
  basic_kv_snapshot(const basic_kv_snapshot&) = delete;
  /// Not copyable: move it, or call `snapshot()` again.
  basic_kv_snapshot& operator=(const basic_kv_snapshot&) = delete;

  /// The epoch number: strictly increasing with each publication of a cache.
  std::uint64_t epoch() const noexcept { return epoch_ ? epoch_.number() : 0; }
  /// Tokens this snapshot covers.
  std::size_t size() const noexcept { return epoch_ ? size_ : 0; }
  /// True when it covers no token (`size() == 0`).
  bool empty() const noexcept { return size() == 0; }

  /// The window of its layer (`kv_layer_layout::window`): 0 for a full
  /// layer or a layer cache.
  std::size_t window() const noexcept { return epoch_ ? epoch_.window().window : 0; }
  /// Its layer's attention sinks (`kv_layer_layout::sink_tokens`).
  std::size_t sink_tokens() const noexcept { return epoch_ ? epoch_.window().sinks : 0; }
  /// The first position past the sinks that it holds: a windowed layer
  /// dropped positions `[sink_tokens(), kept_from())`, and reading one of
  /// them (`read_kv`, `read_range`, `for_each_block`) fails with
  /// `kv_errc::outside_window`. `sink_tokens()` when it dropped none (0
  /// for a full layer). Windows never narrow `size()`.
  std::size_t kept_from() const noexcept { return epoch_ ? epoch_.window().kept_from : 0; }

  /// This snapshot (moved) narrowed to its first `min(n, size())` tokens:
  /// same epoch, reads past the new size fail as past any snapshot's end.
  basic_kv_snapshot prefix(std::size_t n) && noexcept {
    basic_kv_snapshot s(std::move(*this));
    if (n < s.size()) s.size_ = n;
    return s;
  }

  /// Copies token `index`'s keys and values into the first `token_width()`
  /// floats of `keys_out` and `value_width()` of `values_out` (none for a
  /// keys-only layer, whose `values_out` may be empty).
  /// @return `index_out_of_range` if `index >= size()`, `outside_window` if
  ///         its layer's window dropped it, `buffer_too_small` if an output
  ///         span is shorter than a token's keys (or values); nothing is
  ///         written on error.
  std::error_code read_kv(std::size_t index, std::span<float> keys_out, std::span<float> values_out) const {
    if (index >= size()) return kv_errc::index_out_of_range;
    return read_range(index, index + 1, keys_out, values_out);
  }

  /// Copies tokens `[begin, end)` token-major into the output spans.
  /// @return `invalid_range` if `begin > end`, `range_out_of_bounds` if
  ///         `end > size()`, `outside_window` if the range holds a position
  ///         its layer's window dropped, `buffer_too_small` if `keys_out`
  ///         holds fewer than `(end - begin) * token_width()` floats or
  ///         `values_out` fewer than `(end - begin) * value_width()`.
  ///         Nothing is written on error.
  std::error_code read_range(std::size_t begin, std::size_t end, std::span<float> keys_out,
                             std::span<float> values_out) const {
    if (std::error_code ec = check_range(begin, end)) return ec;
    const std::size_t width = token_width(), value_width = this->value_width();
    if (keys_out.size() < (end - begin) * width || values_out.size() < (end - begin) * value_width)
      return kv_errc::buffer_too_small;
    const detail::element_scales scales = epoch_.scales();
    return for_each_block(begin, end, [&](std::size_t first, std::size_t, auto keys, auto values) {
      detail::to_floats(keys.data(), keys.size(), keys_out.data() + (first - begin) * width, scales.key);
      detail::to_floats(values.data(), values.size(), values_out.data() + (first - begin) * value_width, scales.value);
    });
  }

  /// As `read_kv` above, into a `kv_entry` sized to one token (its values
  /// empty for a keys-only layer; both left empty on error).
  std::error_code read_kv(std::size_t index, kv_entry& out) const {
    out = {};
    if (index >= size()) return kv_errc::index_out_of_range;
    if (std::error_code ec = check_range(index, index + 1)) return ec;
    out.keys.resize(token_width());
    out.values.resize(value_width());
    return read_kv(index, out.keys, out.values);
  }

  /// As `read_range` above, into a `kv_range` sized to the range (its
  /// `begin`/`end` set, its vectors left empty on error).
  std::error_code read_range(std::size_t begin, std::size_t end, kv_range& out) const {
    out = {begin, end, {}, {}};
    if (std::error_code ec = check_range(begin, end)) return ec;
    out.keys.resize((end - begin) * token_width());
    out.values.resize((end - begin) * value_width());
    return read_range(begin, end, out.keys, out.values);
  }

  /// Zero-copy read: calls `f(first_index, count, keys, values)` once per
  /// stored run of consecutive tokens in `[begin, end)`, in order (a run is
  /// a block, or blocks the cache filled one after another, which lie next
  /// to each other in the pool's memory); the spans
  /// (`std::span<const T>`, `count * token_width() / elements_per<T>` of
  /// keys and `count * value_width() / elements_per<T>` of values: none for
  /// a keys-only layer; an fp8 layer's as stored, divided by its scales) point
  /// into the cache's blocks and stay valid while this snapshot lives.
  /// @return `invalid_range`, `range_out_of_bounds` or `outside_window` as
  ///         `read_range`; `f` is not called on error.
  template <class F>
  std::error_code for_each_block(std::size_t begin, std::size_t end, F&& f) const {
    if (std::error_code ec = check_range(begin, end)) return ec;
    // Stored Ts per token's keys and values.
    const std::size_t width = epoch_.width() / elements_per<T>, value_width = epoch_.value_width() / elements_per<T>;
    std::array<detail::stored_run, 16> runs;  // NOLINT(cppcoreguidelines-pro-type-member-init): runs() fills them
    for (std::size_t first = begin; first < end;) {
      const std::size_t n = epoch_.runs(first, end, runs);
      // Never 0 while first < end; said, so that no compiler warns of
      // runs[n - 1] (GCC 12 did, for an `f` that does not return).
      if (n == 0) break;
      for (std::size_t i = 0; i < n; ++i) {
        const detail::stored_run& r = runs[i];
        if (i + 1 < n) detail::prefetch_run(runs[i + 1]);
        f(r.first, r.count, std::span<const T>(reinterpret_cast<const T*>(r.keys), r.count * width),
          std::span<const T>(reinterpret_cast<const T*>(r.values), r.count * value_width));
      }
      first = runs[n - 1].first + runs[n - 1].count;
    }
    return {};
  }

  /// What its stored keys are multiplied by when read: its cache's
  /// `kv_cache_config::key_scale` for an `fp8_e4m3` cache, else 1 (and 1
  /// for an empty snapshot).
  float key_scale() const noexcept { return epoch_ ? epoch_.scales().key : 1.0f; }
  /// As `key_scale()`, for values (`kv_cache_config::value_scale`).
  float value_scale() const noexcept { return epoch_ ? epoch_.scales().value : 1.0f; }

  /// The floats of a token's keys (0 for an empty snapshot).
  std::size_t token_width() const noexcept { return epoch_ ? epoch_.width() : 0; }
  /// The floats of a token's values: `token_width()`, or 0 for a layer of
  /// a `keys_only` layout (and an empty snapshot).
  std::size_t value_width() const noexcept { return epoch_ ? epoch_.value_width() : 0; }

 private:
  friend struct detail::cache_access;
  explicit basic_kv_snapshot(detail::pinned_epoch e) noexcept : epoch_(std::move(e)), size_(epoch_.size()) {}

  std::error_code check_range(std::size_t begin, std::size_t end) const noexcept {
    if (begin > end) return kv_errc::invalid_range;
    if (end > size()) return kv_errc::range_out_of_bounds;
    // The positions a window dropped: [sink_tokens(), kept_from()).
    if (begin < end && sink_tokens() < kept_from() && begin < kept_from() && end > sink_tokens())
      return kv_errc::outside_window;
    return {};
  }

  detail::pinned_epoch epoch_;
  std::size_t size_ = 0;  // tokens shown (the epoch's, or a prefix of them); 0 when epoch_ is null
};

/// The snapshot of a `layer_kv_cache` (float storage).
using kv_snapshot = basic_kv_snapshot<float>;

GHOSTLINK_NAMESPACE_END
