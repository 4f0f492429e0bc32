#pragma once
// A prefix-cache entry as a block store keeps it (docs/FORMAT.md, "Block
// entries"): encoding, and checking bytes a store returned, with no I/O.
// The values handed to a store (kv_store_value): a write-through value holds
// the entry's blocks until the store encodes it; a write-back value is
// encoded at once, since eviction is about to free the blocks.

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/block_store.hpp"
#include "ghostlink/config.hpp"
#include "ghostlink/layout.hpp"
#include "memory/block.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// "\x89GLKB\r\n\x1a": a block entry (a saved sequence's file has "GLKV").
inline constexpr std::array<unsigned char, 8> entry_magic = {0x89, 'G', 'L', 'K', 'B', '\r', '\n', 0x1a};
/// Version 3 added the layout (a layer table, layers absent); version 2
/// the fp8 scales. Older entries are misses.
inline constexpr std::uint32_t entry_version = 3;
/// The fixed part of the header; the layer table follows it.
inline constexpr std::size_t entry_fixed_bytes = 96;
/// Bytes per layer in the layer table: u64 window, u64 sink_tokens, u64 present.
inline constexpr std::size_t entry_layer_record_bytes = 24;

/// What every entry of one prefix cache shares.
struct entry_geometry {
  std::size_t num_layers = 0;
  std::size_t num_heads = 0;
  std::size_t head_dim = 0;
  std::size_t block_tokens = 0;
  std::uint32_t element = 0;        // element_code<T>
  std::uint32_t element_bytes = 0;  // sizeof(T)
  std::size_t group = 1;            // elements per T (32 for q8_0, q4_0)
  float key_scale = 1.0f, value_scale = 1.0f;  // fp8's (1 for the others)
  bool keys_only = false;
  std::shared_ptr<const std::vector<kv_layer_layout>> layers;  // num_layers of them (shared: a copy allocates nothing)

  entry_geometry() = default;
  /// @throws std::bad_alloc
  entry_geometry(const kv_model_layout& layout, const kv_cache_config& c, const element_codec& codec)
      : num_layers(layout.num_layers()),
        num_heads(c.num_heads),
        head_dim(c.head_dim),
        block_tokens(c.block_tokens),
        element(codec.code),
        element_bytes(static_cast<std::uint32_t>(codec.size)),
        group(codec.group),
        key_scale(c.key_scale),
        value_scale(c.value_scale),
        keys_only(layout.keys_only),
        layers(std::make_shared<const std::vector<kv_layer_layout>>(layout.layers)) {}

  /// One half of a layer's block: its keys (or its values).
  std::size_t half_bytes() const noexcept { return block_tokens * (num_heads * head_dim / group) * element_bytes; }
  /// One layer's block: its keys, then its values (none when keys_only).
  std::size_t block_bytes() const noexcept { return (keys_only ? 1 : 2) * half_bytes(); }
  /// The header: fixed fields, the layer table, its checksum.
  std::size_t header_bytes() const noexcept { return entry_fixed_bytes + num_layers * entry_layer_record_bytes + 8; }
  /// An entry holding `present` layers' blocks: header, blocks, the payload's checksum.
  std::size_t entry_bytes(std::size_t present) const noexcept { return header_bytes() + present * block_bytes() + 8; }
};

/// Writes the entry of `hash` whose layer l has the keys `halves[2 * l]`
/// and the values `halves[2 * l + 1]` (half_bytes() each; the values
/// ignored when keys_only), or none when `halves[2 * l]` is null, to `out`
/// (entry_bytes() of the layers present).
void encode_entry(const entry_geometry& g, const kv_block_hash& hash, std::span<const std::byte* const> halves,
                  std::span<std::byte> out) noexcept;

/// Whether `bytes` is exactly a well-formed entry of `hash` and `g`: both
/// checksums hold, its header names this hash, geometry, element type and
/// layout, and it holds every full layer's block. Reads nothing out of
/// bounds whatever the bytes are.
bool check_entry(const entry_geometry& g, const kv_block_hash& hash, std::span<const std::byte> bytes) noexcept;

/// Layer `layer`'s block in a checked entry (keys, then values), or null
/// when the entry holds none for it.
const std::byte* entry_layer(const entry_geometry& g, std::span<const std::byte> entry, std::size_t layer) noexcept;

/// The layers present among `halves` (as encode_entry takes them).
inline std::size_t present_layers(std::span<const std::byte* const> halves) noexcept {
  std::size_t n = 0;
  for (std::size_t i = 0; i < halves.size(); i += 2) n += halves[i] ? 1 : 0;
  return n;
}

/// What the prefix cache's values share: the hash, and the receipt (null:
/// none) its store tells whether it is stored.
class entry_value : public kv_store_value {
 public:
  const kv_block_hash& hash() const noexcept final { return hash_; }
  std::shared_ptr<kv_store_receipt> receipt() const noexcept final { return receipt_; }

 protected:
  entry_value(const kv_block_hash& hash, std::shared_ptr<kv_store_receipt> receipt) noexcept
      : hash_(hash), receipt_(std::move(receipt)) {}

 private:
  kv_block_hash hash_;
  std::shared_ptr<kv_store_receipt> receipt_;
};

/// A write-through value: the entry's blocks, held until the store is done.
class held_entry final : public entry_value {
 public:
  /// `blocks[l]` null: the entry holds none for layer l.
  /// @throws std::bad_alloc
  held_entry(entry_geometry g, const kv_block_hash& hash, std::vector<ref_ptr<block>> blocks,
             std::shared_ptr<kv_store_receipt> receipt = nullptr);
  std::size_t size() const noexcept override { return geometry_.entry_bytes(present_layers(halves_)); }
  void encode(std::span<std::byte> out) const noexcept override;

 private:
  entry_geometry geometry_;
  std::vector<ref_ptr<block>> blocks_;
  std::vector<const std::byte*> halves_;  // blocks_[l]'s keys and values
};

/// A write-back value: the entry, encoded when it was evicted.
class copied_entry final : public entry_value {
 public:
  /// Null if memory is refused.
  static std::shared_ptr<copied_entry> make(const entry_geometry& g, const kv_block_hash& hash,
                                            std::span<const std::byte* const> halves,
                                            std::shared_ptr<kv_store_receipt> receipt = nullptr) noexcept;
  std::size_t size() const noexcept override { return bytes_.size(); }
  void encode(std::span<std::byte> out) const noexcept override;

  copied_entry(const kv_block_hash& hash, std::shared_ptr<kv_store_receipt> receipt) noexcept
      : entry_value(hash, std::move(receipt)) {}

 private:
  std::vector<std::byte> bytes_;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
