#pragma once
// A reader's pin on one published epoch, what a snapshot holds, and the one
// call the inlined read path makes into src/: where the stored runs of a
// range of tokens are. The epoch itself (its block table, its layout) lives
// in src/core/epoch.hpp.

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

struct epoch;
struct epoch_access;

/// Consecutive tokens `[first, first + count)` stored in one run of memory
/// (one block, or blocks that lie next to each other): their keys and their
/// values, `count` tokens of the cache's element type each.
struct stored_run {
  std::size_t first;
  std::size_t count;
  const std::byte* keys;
  const std::byte* values;
};

/// What a windowed layer's epoch holds: positions `[sinks, kept_from)` are
/// dropped (none for a full layer: every field 0).
struct window_view {
  std::size_t window = 0;
  std::size_t sinks = 0;
  std::size_t kept_from = 0;
};

/// What an fp8 cache's stored keys and values are multiplied by when read
/// (kv_cache_config::key_scale, value_scale); 1 for every other type.
struct element_scales {
  float key = 1.0f;
  float value = 1.0f;
};

/// Asks the processor for the first cache lines of a run's keys and values,
/// so the next block's streams are under way while the current one is
/// read (a block starts two streams the hardware prefetcher has not seen).
inline void prefetch_run(const stored_run& r) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  for (std::size_t line = 0; line < 4; ++line) {
    __builtin_prefetch(r.keys + line * 64);
    __builtin_prefetch(r.values + line * 64);
  }
#else
  (void)r;
#endif
}

/// Fills `out` with the runs of `e` that cover tokens `[first, end)` from
/// `first` on (`first < end <= e`'s size), in order; returns how many (at
/// least one). Consecutive blocks whose keys and values lie right after
/// the previous block's are one run. Tokens never written point into a
/// block of zeros.
std::size_t stored_runs(const epoch& e, std::size_t first, std::size_t end, std::span<stored_run> out) noexcept;
/// Releases a pin taken by pin() (src/core/actor.hpp); may free the epoch.
void unpin(const epoch& e) noexcept;

/// A reference to one published epoch, counted in its cache's statistics
/// while held; move-only. The number, size and width are copied out so a
/// reader asks src/ only where the runs are.
class pinned_epoch {
 public:
  pinned_epoch() noexcept = default;
  pinned_epoch(pinned_epoch&& other) noexcept
      : epoch_(std::exchange(other.epoch_, nullptr)),
        number_(other.number_),
        size_(other.size_),
        width_(other.width_),
        value_width_(other.value_width_),
        window_(other.window_),
        scales_(other.scales_) {}
  pinned_epoch& operator=(pinned_epoch&& other) noexcept {
    if (this != &other) {
      close();
      epoch_ = std::exchange(other.epoch_, nullptr);
      number_ = other.number_;
      size_ = other.size_;
      width_ = other.width_;
      value_width_ = other.value_width_;
      window_ = other.window_;
      scales_ = other.scales_;
    }
    return *this;
  }
  pinned_epoch(const pinned_epoch&) = delete;
  pinned_epoch& operator=(const pinned_epoch&) = delete;
  ~pinned_epoch() { close(); }

  explicit operator bool() const noexcept { return epoch_ != nullptr; }
  std::uint64_t number() const noexcept { return number_; }
  std::size_t size() const noexcept { return size_; }
  /// Elements per token's keys.
  std::size_t width() const noexcept { return width_; }
  /// Elements per token's values: width(), or 0 for a keys-only layer.
  std::size_t value_width() const noexcept { return value_width_; }
  /// The layer's window and what it dropped.
  const window_view& window() const noexcept { return window_; }
  /// What fp8 keys and values are multiplied by when read.
  element_scales scales() const noexcept { return scales_; }
  /// See stored_runs(); the epoch must be pinned.
  std::size_t runs(std::size_t first, std::size_t end, std::span<stored_run> out) const noexcept {
    return stored_runs(*epoch_, first, end, out);
  }

 private:
  friend struct epoch_access;
  pinned_epoch(const epoch* e, std::uint64_t number, std::size_t size, std::size_t width, std::size_t value_width,
               window_view w, element_scales scales) noexcept
      : epoch_(e),
        number_(number),
        size_(size),
        width_(width),
        value_width_(value_width),
        window_(w),
        scales_(scales) {}
  void close() noexcept {
    if (epoch_) unpin(*std::exchange(epoch_, nullptr));
  }

  const epoch* epoch_ = nullptr;
  std::uint64_t number_ = 0;
  std::size_t size_ = 0;
  std::size_t width_ = 0;
  std::size_t value_width_ = 0;
  window_view window_{};
  element_scales scales_{};
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
