#pragma once
/// @file
/// `kv_snapshot`: a pinned, immutable view of one published epoch.

#include <cstddef>
#include <cstdint>
#include <span>
#include <system_error>
#include <type_traits>

#include "ghostlink/detail/ref_ptr.hpp"
#include "ghostlink/detail/storage.hpp"
#include "ghostlink/error.hpp"
#include "ghostlink/types.hpp"

namespace ghostlink {

/// A move-only handle that pins one published epoch of a `layer_kv_cache`.
///
/// What it shows never changes, whatever is written later: its size, its
/// epoch number and every token it covers. It may be held across `co_await`,
/// moved to another thread and destroyed there; releasing the last snapshot
/// of an epoch frees the blocks only that epoch could reach. All member
/// functions are safe to call from many threads at once.
///
/// A default-constructed or moved-from snapshot is empty: size 0, epoch 0.
class kv_snapshot {
 public:
  kv_snapshot() noexcept = default;
  /// Pins `e` (used by `layer_kv_cache::snapshot()`).
  explicit kv_snapshot(detail::ref_ptr<detail::epoch> e) noexcept : epoch_(std::move(e)) {}
  kv_snapshot(kv_snapshot&&) noexcept = default;
  kv_snapshot& operator=(kv_snapshot&&) noexcept = default;
  kv_snapshot(const kv_snapshot&) = delete;
  kv_snapshot& operator=(const kv_snapshot&) = delete;

  /// The epoch number: strictly increasing with each publication of a cache.
  std::uint64_t epoch() const noexcept { return epoch_ ? epoch_->number : 0; }
  /// Tokens this snapshot covers.
  std::size_t size() const noexcept { return epoch_ ? epoch_->length : 0; }
  bool empty() const noexcept { return size() == 0; }

  /// Copies token `index`'s keys and values into the first `token_width()`
  /// floats of each output span.
  /// @return `index_out_of_range` if `index >= size()`, `buffer_too_small`
  ///         if an output span is shorter than a token; nothing is written
  ///         on error.
  std::error_code read_kv(std::size_t index, std::span<float> keys_out,
                          std::span<float> values_out) const;

  /// Copies tokens `[begin, end)` token-major into the output spans.
  /// @return `invalid_range` if `begin > end`, `range_out_of_bounds` if
  ///         `end > size()`, `buffer_too_small` if an output span holds fewer
  ///         than `(end - begin) * token_width()` floats.
  std::error_code read_range(std::size_t begin, std::size_t end, std::span<float> keys_out,
                             std::span<float> values_out) const;

  /// As `read_kv` above, into a `kv_entry` sized to one token (left empty on
  /// error).
  std::error_code read_kv(std::size_t index, kv_entry& out) const;

  /// As `read_range` above, into a `kv_range` sized to the range (its
  /// `begin`/`end` set, its vectors left empty on error).
  std::error_code read_range(std::size_t begin, std::size_t end, kv_range& out) const;

  /// Zero-copy read: calls `f(first_index, count, keys, values)` once per
  /// stored run of consecutive tokens in `[begin, end)`, in order; the spans
  /// (`std::span<const float>`, `count * token_width()` floats each) point
  /// into the cache's blocks and stay valid while this snapshot lives.
  /// @return `invalid_range` or `range_out_of_bounds` as `read_range`; `f`
  ///         is not called on error.
  template <class F>
  std::error_code for_each_block(std::size_t begin, std::size_t end, F&& f) const {
    if (std::error_code ec = check_range(begin, end)) return ec;
    for (std::size_t first = begin; first < end;) {
      const detail::epoch& e = *epoch_;
      const std::size_t count = e.run_from(first, end);
      const std::size_t at = first % e.block_tokens * e.width;
      const detail::block& b = e.block_of(first);
      f(first, count, std::span<const float>(b.keys() + at, count * e.width),
        std::span<const float>(b.values() + at, count * e.width));
      first += count;
    }
    return {};
  }

  /// The floats per token (0 for an empty snapshot).
  std::size_t token_width() const noexcept { return epoch_ ? epoch_->width : 0; }

 private:
  std::error_code check_range(std::size_t begin, std::size_t end) const noexcept {
    if (begin > end) return kv_errc::invalid_range;
    if (end > size()) return kv_errc::range_out_of_bounds;
    return {};
  }

  detail::ref_ptr<detail::epoch> epoch_;
};

}  // namespace ghostlink
