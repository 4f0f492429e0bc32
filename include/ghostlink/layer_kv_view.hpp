#pragma once
/// @file
/// `basic_layer_kv_view<T>`: a read-only handle on one layer of a sequence.

#include <cstddef>
#include <ostream>
#include <utility>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/layer_kv_cache.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// A read-only handle on one layer of a `basic_sequence_kv_cache<T>`, as
/// its `layer(i)` hands out: every read of `basic_layer_kv_cache<T>` (its
/// size, snapshots, reads, counters) and none of its writes, so that no
/// token reaches a layer around the sequence's bookkeeping. Write through
/// the sequence: `async_append`, or a step's `async_write`.
///
/// A handle: copies share one layer, and every member is `const`. The layer
/// holds what the sequence appended, plus an open step's tokens once that
/// layer is written (the sequence's snapshots show those at the commit).
template <storage_element T>
class basic_layer_kv_view {
 public:
  /// The layer's strand, as `basic_layer_kv_cache::executor_type`.
  using executor_type = typename basic_layer_kv_cache<T>::executor_type;
  /// The stored element type.
  using value_type = T;
  /// What `snapshot()` returns.
  using snapshot_type = basic_kv_snapshot<T>;

  /// An empty handle: only `valid()`, assignment and destruction may be used.
  basic_layer_kv_view() noexcept = default;
  /// A view of `cache`.
  explicit basic_layer_kv_view(basic_layer_kv_cache<T> cache) noexcept : cache_(std::move(cache)) {}

  /// False for an empty handle.
  bool valid() const noexcept { return cache_.valid(); }
  /// As `valid()`.
  explicit operator bool() const noexcept { return valid(); }
  /// True when both views show one layer.
  friend bool operator==(const basic_layer_kv_view& a, const basic_layer_kv_view& b) noexcept {
    return a.cache_ == b.cache_;
  }

  /// As `basic_layer_kv_cache::config()`.
  const kv_cache_config& config() const noexcept { return cache_.config(); }
  /// As `basic_layer_kv_cache::pool()`.
  kv_block_pool pool() const noexcept { return cache_.pool(); }
  /// As `basic_layer_kv_cache::get_executor()`: the layer's strand.
  executor_type get_executor() const noexcept { return cache_.get_executor(); }
  /// As `basic_layer_kv_cache::size()`.
  std::size_t size() const noexcept { return cache_.size(); }
  /// True when `size() == 0`.
  bool empty() const noexcept { return cache_.empty(); }
  /// As `basic_layer_kv_cache::snapshot()`.
  snapshot_type snapshot() const noexcept { return cache_.snapshot(); }
  /// As `basic_layer_kv_cache::stats()`.
  kv_cache_stats stats() const noexcept { return cache_.stats(); }

  /// As `basic_layer_kv_cache::async_read_kv`.
  template <class CompletionToken = default_completion_token>
  auto async_read_kv(std::size_t index, CompletionToken&& token = default_completion_token()) const {
    return cache_.async_read_kv(index, std::forward<CompletionToken>(token));
  }
  /// As `basic_layer_kv_cache::async_read_range`.
  template <class CompletionToken = default_completion_token>
  auto async_read_range(std::size_t begin, std::size_t end,
                        CompletionToken&& token = default_completion_token()) const {
    return cache_.async_read_range(begin, end, std::forward<CompletionToken>(token));
  }

  /// Prints as the layer's cache does: the config and the length.
  friend std::ostream& operator<<(std::ostream& os, const basic_layer_kv_view& view) { return os << view.cache_; }

 private:
  basic_layer_kv_cache<T> cache_;
};

/// The read-only view of a float layer.
using layer_kv_view = basic_layer_kv_view<float>;

GHOSTLINK_NAMESPACE_END
