#pragma once
// The token encodings of the unit tests, written once. Every float of a
// test token is distinct and says where it belongs, so a misplaced or torn
// float shows up:
//   pattern_value(index, tag, lane) = index * 1000 + tag * 100 + lane.
// token_pattern is one layer's token; make_token adds its values (the keys
// negated); key_of is one layer of a whole-model step, with a fraction that
// 16-bit storage must round.
//
// The stress test (stress/common.hpp) keeps its own encoding on purpose: its
// readers decode a 64-bit tag back out of any token they read, which these
// patterns cannot carry.

#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

namespace ghostlink::test {

/// Lane `lane` of token `index` written with `tag`.
inline float pattern_value(std::size_t index, std::size_t tag, std::size_t lane) {
  return static_cast<float>(index * 1000 + tag * 100 + lane);
}

/// Token `index` written with `tag`, `width` floats.
inline std::vector<float> token_pattern(std::size_t width, std::size_t index, int tag) {
  std::vector<float> v(width);
  for (std::size_t lane = 0; lane < width; ++lane) v[lane] = pattern_value(index, static_cast<std::size_t>(tag), lane);
  return v;
}

/// A token's keys (token_pattern) and values (their negation); tag 0 is a
/// never-written token (zeros).
struct token_data {
  std::vector<float> keys, values;
};

inline token_data make_token(std::size_t width, std::size_t index, int tag) {
  if (tag == 0) return {std::vector<float>(width, 0.0f), std::vector<float>(width, 0.0f)};
  token_data t{token_pattern(width, index, tag), {}};
  for (float k : t.keys) t.values.push_back(-k);
  return t;
}

/// The tag token `index` was written with, decoded from its first key (0 for
/// zeros). A torn or misplaced token decodes to something diff_token rejects.
inline int tag_of(std::size_t index, std::span<const float> keys) {
  if (keys[0] == 0.0f && keys[1] == 0.0f) return 0;
  return static_cast<int>(std::lround((keys[0] - pattern_value(index, 0, 0)) / 100.0f));
}

/// Lane `lane` of layer `layer`'s key for token `index` appended with `tag`
/// (layer, tag and lane below 10): the pattern with the layer in the tag's
/// place and tag * 10 + lane in the lane's, plus a third. Values are the
/// keys negated.
inline float key_of(std::size_t layer, std::size_t index, int tag, std::size_t lane) {
  return pattern_value(index, layer, static_cast<std::size_t>(tag) * 10 + lane) + 1.0f / 3.0f;
}

}  // namespace ghostlink::test
