#pragma once
// What tests/store/store_writer.cpp writes, shared with the test that
// checks what a killed writer left: the geometry, the two token runs, and
// the data of each token.

#include <ghostlink/kv_cache.hpp>

#include "common/asio_compat.hpp"

#include <cstddef>
#include <span>
#include <vector>

namespace ghostlink::test::store_writer {

inline constexpr std::size_t layers = 4;
inline constexpr std::size_t length = 256;

/// 8 heads of 64 lanes, 16 tokens a block: 4 layers of 256 tokens are 4 MiB.
inline kv_cache_config config() {
  return {.max_tokens_per_seq = length, .num_heads = 8, .head_dim = 64, .block_tokens = 16};
}

/// Run `r`'s token ids.
inline std::vector<token_id> tokens(std::size_t r) {
  std::vector<token_id> t(length);
  for (std::size_t i = 0; i < length; ++i) t[i] = static_cast<token_id>(r * 100000 + i);
  return t;
}

/// The key of layer `l`, position `i`, token `id`, lane `lane`; values are
/// the keys negated.
inline float key(std::size_t l, std::size_t i, token_id id, std::size_t lane) {
  return static_cast<float>((l * 7 + i * 13 + static_cast<std::size_t>(id) * 3 + lane) % 100003);
}

/// Appends `ids` with their key() data to `seq` (empty), waiting.
inline void fill(const sequence_kv_cache& seq, std::span<const token_id> ids) {
  const std::size_t width = config().token_width();
  std::vector<std::vector<float>> keys(layers), values(layers);
  std::vector<std::span<const float>> ks, vs;
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t i = 0; i < ids.size(); ++i)
      for (std::size_t lane = 0; lane < width; ++lane) {
        keys[l].push_back(key(l, i, ids[i], lane));
        values[l].push_back(-key(l, i, ids[i], lane));
      }
    ks.emplace_back(keys[l]);
    vs.emplace_back(values[l]);
  }
  seq.async_append(ids, ks, vs, asio::use_future).get();
}

}  // namespace ghostlink::test::store_writer
