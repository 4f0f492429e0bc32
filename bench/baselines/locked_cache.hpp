#pragma once
// The seed's design in C++ (seed/kv_cache.rs): one pre-allocated contiguous
// buffer per layer for keys and one for values, guarded by one lock. Reads
// copy out under the lock (shared for std::shared_mutex), writes take it
// exclusively. `rwlock` and `mutex` baselines differ only in the lock.
// `rwlock_zero_copy` is the best lock design a team would write: the rwlock
// cache read through visit_range(), which hands the kernel the buffer itself
// under the shared lock, so nothing is copied.

#include <algorithm>
#include <cstddef>
#include <memory_resource>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <type_traits>
#include <vector>

#include <ghostlink/config.hpp>
#include <ghostlink/element.hpp>
#include <ghostlink/error.hpp>
#include <ghostlink/types.hpp>

namespace ghostlink::bench {

/// `T`: the stored element type (the seed's f32 by default; a 16-bit or
/// quantized type converts on write, as ghostlink's caches do: a token is
/// `token_width() / elements_per<T>` of them).
template <class Mutex, storage_element T = float>
class locked_cache {
 public:
  /// Buffers from `memory` (bench/arena.hpp), else the default resource.
  explicit locked_cache(const kv_cache_config& config,
                        std::pmr::memory_resource* memory = std::pmr::get_default_resource())
      : config_(config), keys_(memory), values_(memory) {}
  locked_cache(locked_cache&& o) noexcept
      : config_(o.config_), keys_(std::move(o.keys_)), values_(std::move(o.values_)), len_(o.len_) {}

  std::error_code initialize(std::size_t seq_len) {
    if (seq_len == 0) return kv_errc::zero_length;
    std::unique_lock lock(mutex_);
    if (keys_.empty()) {
      keys_.assign(config_.max_tokens_per_seq * stored_width(), T{});
      values_.assign(keys_.size(), T{});
    }
    len_ = std::max(len_, std::min(seq_len, config_.max_tokens_per_seq));
    return {};
  }

  std::error_code write(std::size_t index, std::span<const float> keys, std::span<const float> values) {
    const kv_write one[] = {{index, keys, values}};
    return write_batch(one);
  }

  std::error_code write_batch(std::span<const kv_write> entries) {
    const std::size_t width = config_.token_width();
    for (const kv_write& w : entries) {
      if (w.keys.size() != w.values.size()) return kv_errc::length_mismatch;
      if (w.keys.size() != width) return kv_errc::width_mismatch;
      if (w.index >= config_.max_tokens_per_seq) return kv_errc::index_out_of_range;
    }
    if (entries.empty()) return {};
    std::unique_lock lock(mutex_);
    if (keys_.empty()) return kv_errc::not_initialized;
    for (const kv_write& w : entries) {
      convert<T, float>(w.keys, keys_.data() + w.index * stored_width());
      convert<T, float>(w.values, values_.data() + w.index * stored_width());
      len_ = std::max(len_, w.index + 1);
    }
    return {};
  }

  /// Drops tokens [n, size()) (the seed's truncate).
  void truncate(std::size_t n) {
    std::unique_lock lock(mutex_);
    len_ = std::min(len_, n);
  }

  /// Copies [begin, end) out under the (shared) lock, as the seed's read_range.
  std::error_code read_range(std::size_t begin, std::size_t end, kv_range& out) const
    requires std::is_same_v<T, float>
  {
    if (begin > end) return kv_errc::invalid_range;
    const std::size_t width = config_.token_width();
    read_lock lock(mutex_);
    if (end > len_) return kv_errc::range_out_of_bounds;
    out.begin = begin;
    out.end = end;
    out.keys.assign(keys_.begin() + std::ptrdiff_t(begin * width), keys_.begin() + std::ptrdiff_t(end * width));
    out.values.assign(values_.begin() + std::ptrdiff_t(begin * width), values_.begin() + std::ptrdiff_t(end * width));
    return {};
  }

  /// Calls `f(keys, values)` with tokens [begin, end) straight from the
  /// buffers, under the (shared) lock: the zero-copy read.
  template <class F>
  std::error_code visit_range(std::size_t begin, std::size_t end, F&& f) const {
    if (begin > end) return kv_errc::invalid_range;
    const std::size_t width = stored_width();
    read_lock lock(mutex_);
    if (end > len_) return kv_errc::range_out_of_bounds;
    const std::span<const T> k(keys_), v(values_);
    f(k.subspan(begin * width, (end - begin) * width), v.subspan(begin * width, (end - begin) * width));
    return {};
  }

  /// A new cache holding copies of this one's valid tokens: what forking a
  /// sequence costs in this design.
  locked_cache copy() const {
    locked_cache c(config_);
    read_lock lock(mutex_);
    const auto valid = std::ptrdiff_t(len_ * stored_width());
    c.keys_.assign(keys_.begin(), keys_.begin() + valid);
    c.values_.assign(values_.begin(), values_.begin() + valid);
    c.len_ = len_;
    return c;
  }

  std::size_t size() const {
    read_lock lock(mutex_);
    return len_;
  }

 private:
  /// Stored Ts per token.
  std::size_t stored_width() const noexcept { return config_.token_width() / elements_per<T>; }
  using read_lock =
      std::conditional_t<std::is_same_v<Mutex, std::shared_mutex>, std::shared_lock<Mutex>, std::unique_lock<Mutex>>;
  const kv_cache_config config_;
  mutable Mutex mutex_;
  std::pmr::vector<T> keys_, values_;
  std::size_t len_ = 0;
};

using rwlock_cache = locked_cache<std::shared_mutex>;
using mutex_cache = locked_cache<std::mutex>;

}  // namespace ghostlink::bench
