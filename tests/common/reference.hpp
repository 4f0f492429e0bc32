#pragma once
// The reference model of one layer cache, written once for the unit tests
// (pool_support.hpp) and the stress test (stress/common.hpp): the seed's
// semantics, token by token. The fuzzer's model (fuzz/model.hpp) also
// models blocks and epochs, so it keeps its own.

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

namespace ghostlink::test {

/// What a cache should hold: per token, the tag it was last written with
/// (`Tag{}` for zeros: a token made valid by initialize or skipped by a
/// write); `stored`, one past the last token written and not truncated
/// since (tokens past it need no block).
template <class Tag>
struct reference_cache {
  bool initialized = false;
  std::vector<Tag> tags;
  std::size_t stored = 0;

  std::size_t size() const { return tags.size(); }
  /// `initialize(n)` (n > 0) of a cache holding at most `max_tokens`.
  void initialize(std::size_t n, std::size_t max_tokens = std::numeric_limits<std::size_t>::max()) {
    initialized = true;
    tags.resize(std::max(tags.size(), std::min(n, max_tokens)), Tag{});
  }
  void write(std::size_t index, Tag tag) {
    if (index >= tags.size()) tags.resize(index + 1, Tag{});
    tags[index] = tag;
    stored = std::max(stored, index + 1);
  }
  void write(std::size_t begin, std::size_t end, Tag tag) {
    for (std::size_t i = begin; i < end; ++i) write(i, tag);
  }
  void truncate(std::size_t n) {
    if (n < tags.size()) tags.resize(n);
    stored = std::min(stored, n);
  }
};

}  // namespace ghostlink::test
