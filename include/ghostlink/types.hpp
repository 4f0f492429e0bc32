#pragma once
/// @file
/// Value types that cross the API: one write of a batch, one read token, one
/// read range.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// A token's id in the model's vocabulary, as a sequence stores it with the
/// token (see `basic_sequence_kv_cache::async_append`).
using token_id = std::int32_t;
/// The id of a token appended without one.
inline constexpr token_id no_token_id = -1;

/// One token of an `async_write_batch`. The spans are the caller's and must
/// stay valid until the batch completes.
struct kv_write {
  /// The token's position: below `max_tokens_per_seq`, or the batch fails
  /// with `kv_errc::index_out_of_range`.
  std::size_t index = 0;
  /// The token's keys: `token_width()` floats (else `kv_errc::width_mismatch`).
  std::span<const float> keys;
  /// The token's values: as many floats as `keys` (else
  /// `kv_errc::length_mismatch`).
  std::span<const float> values;
};

/// An owned copy of one token's keys and values (`token_width()` floats each).
struct kv_entry {
  /// The token's keys, widened to float.
  std::vector<float> keys;
  /// The token's values, widened to float.
  std::vector<float> values;
};

/// An owned copy of tokens `[begin, end)`, token-major: token `begin` first,
/// `token_width()` floats per token.
struct kv_range {
  /// The first token read.
  std::size_t begin = 0;
  /// One past the last token read.
  std::size_t end = 0;
  /// `(end - begin) * token_width()` floats: the keys of token `begin`, then
  /// of `begin + 1`, and so on.
  std::vector<float> keys;
  /// The values, laid out as `keys`.
  std::vector<float> values;
};

GHOSTLINK_NAMESPACE_END
