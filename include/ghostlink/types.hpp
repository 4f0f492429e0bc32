#pragma once
/// @file
/// Value types that cross the API: one write of a batch, one read token, one
/// read range.

#include <cstddef>
#include <span>
#include <vector>

namespace ghostlink {

/// One token of an `async_write_batch`. The spans are the caller's and must
/// stay valid until the batch completes.
struct kv_write {
  std::size_t index = 0;
  std::span<const float> keys;
  std::span<const float> values;
};

/// An owned copy of one token's keys and values (`token_width()` floats each).
struct kv_entry {
  std::vector<float> keys;
  std::vector<float> values;
};

/// An owned copy of tokens `[begin, end)`, token-major: token `begin` first,
/// `token_width()` floats per token.
struct kv_range {
  std::size_t begin = 0;
  std::size_t end = 0;
  std::vector<float> keys;
  std::vector<float> values;
};

}  // namespace ghostlink
