#pragma once
// The prefix cache's match rule over a layout (ghostlink/prefix_cache.hpp):
// which blocks a match of k blocks needs from each layer, and the longest k
// whose needs are met. One definition for the index (its entries), an
// attach from a store (the fetched blocks) and an insert (what a sequence
// still holds).

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/layout.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class window_rule {
 public:
  window_rule(kv_model_layout layout, std::size_t block_tokens) : layout_(std::move(layout)), bt_(block_tokens) {
    for (std::size_t l = 0; l < layout_.num_layers(); ++l) {
      const kv_layer_layout& w = layout_.layers[l];
      if (w.window == 0) continue;
      auto same = [&](const window_class& c) { return c.window == w.window && c.sinks == w.sink_tokens; };
      auto it = std::find_if(classes_.begin(), classes_.end(), same);
      if (it == classes_.end()) it = classes_.insert(classes_.end(), window_class{w.window, w.sink_tokens, {}});
      it->layers.push_back(l);
    }
  }

  const kv_model_layout& layout() const noexcept { return layout_; }
  std::size_t num_layers() const noexcept { return layout_.num_layers(); }
  /// True when some layer has a window (the rule is then not the plain run).
  bool windowed() const noexcept { return !classes_.empty(); }
  /// True when every layer has a window (an entry may then hold no block).
  bool all_windowed() const noexcept {
    return std::all_of(layout_.layers.begin(), layout_.layers.end(),
                       [](const kv_layer_layout& w) { return w.window != 0; });
  }
  bool layer_windowed(std::size_t l) const noexcept { return layout_.layers[l].window != 0; }

  /// Where the blocks past its sinks that windowed layer `l` needs for a
  /// match of `k` blocks begin (L = k * B: the block holding `L + 1 -
  /// window`, the first position a query at L attends), or its sinks' end
  /// when it needs every block: the `kept_from()` of a sequence of L tokens
  /// that held them, as a window drops whole blocks.
  std::size_t kept_from(std::size_t l, std::size_t k) const noexcept {
    const kv_layer_layout& w = layout_.layers[l];
    const std::size_t end = k * bt_;
    const std::size_t first = end + 1 > w.window ? end + 1 - w.window : 0;
    return std::max(w.sink_tokens, first / bt_ * bt_);
  }
  /// Whether layer `l` needs block `j` (< k) for a match of `k` blocks.
  bool needs(std::size_t l, std::size_t j, std::size_t k) const noexcept {
    const kv_layer_layout& w = layout_.layers[l];
    if (w.window == 0) return true;
    return j * bt_ < w.sink_tokens || (j + 1) * bt_ > kept_from(l, k);
  }

  /// The longest k <= n such that every windowed layer has every block it
  /// needs for a match of k blocks, `has(l, j)` saying whether layer l has
  /// block j (j < n). Full layers are the caller's: it passes an `n` within
  /// which they hold every block. Not monotone in k, so every k is looked
  /// at, from n down; O(n) per layer of a window.
  template <class Has>
  std::size_t longest(std::size_t n, Has has) const {
    if (classes_.empty() || n == 0) return n;
    // missing[c][j]: blocks before j that some layer of class c lacks.
    std::vector<std::vector<std::size_t>> missing(classes_.size(), std::vector<std::size_t>(n + 1, 0));
    for (std::size_t c = 0; c < classes_.size(); ++c)
      for (std::size_t j = 0; j < n; ++j) {
        const bool all =
            std::all_of(classes_[c].layers.begin(), classes_[c].layers.end(), [&](std::size_t l) { return has(l, j); });
        missing[c][j + 1] = missing[c][j] + (all ? 0 : 1);
      }
    for (std::size_t k = n; k > 0; --k) {
      bool ok = true;
      for (std::size_t c = 0; c < classes_.size() && ok; ++c) {
        const std::size_t l = classes_[c].layers.front();
        const std::size_t from = std::min(kept_from(l, k) / bt_, k);  // the window's first block
        const std::size_t sink_blocks = std::min((std::min(classes_[c].sinks, k * bt_) + bt_ - 1) / bt_, k);
        ok = missing[c][k] == missing[c][from] && missing[c][sink_blocks] == 0;
      }
      if (ok) return k;
    }
    return 0;
  }

 private:
  struct window_class {
    std::size_t window = 0, sinks = 0;
    std::vector<std::size_t> layers;
  };
  kv_model_layout layout_;
  std::size_t bt_;
  std::vector<window_class> classes_;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
