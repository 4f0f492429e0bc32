#pragma once
/// @file
/// `kv_block_hash`: the name of one full block of tokens and of every token
/// before it, under which a prefix cache and its stores keep the block's
/// keys and values (defined in `basic_kv_prefix_cache`).

#include <array>
#include <compare>
#include <cstdint>
#include <string>

#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// The hash of one full block of tokens and of every token before it (see
/// the definition in `basic_kv_prefix_cache`): SHA-256, so that another
/// process or language computes the same from the same tokens.
struct kv_block_hash {
  std::array<std::uint8_t, 32> bytes{};  ///< The digest.
  /// 64 lowercase hex digits.
  std::string hex() const;
  /// Bytewise order.
  friend auto operator<=>(const kv_block_hash&, const kv_block_hash&) = default;
};

GHOSTLINK_NAMESPACE_END
