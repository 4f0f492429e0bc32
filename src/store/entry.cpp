#include "store/entry.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <new>

#include "io/bytes.hpp"
#include "io/checksum.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

// Byte offsets of the header's fields (docs/FORMAT.md, "Block entries").
enum entry_field : std::size_t {
  at_magic = 0,
  at_version = 8,
  at_element = 12,
  at_element_bytes = 16,
  at_reserved = 20,
  at_num_layers = 24,
  at_num_heads = 32,
  at_head_dim = 40,
  at_block_tokens = 48,
  at_hash = 56,
  at_key_scale = 88,
  at_value_scale = 92,
  at_header_checksum = 96,
};

}  // namespace

void encode_entry(const entry_geometry& g, const kv_block_hash& hash, std::span<const std::byte* const> halves,
                  std::span<std::byte> out) noexcept {
  std::byte* p = out.data();
  std::memset(p, 0, entry_header_bytes);
  std::memcpy(p + at_magic, entry_magic.data(), entry_magic.size());
  put_le<std::uint32_t>(p + at_version, entry_version);
  put_le<std::uint32_t>(p + at_element, g.element);
  put_le<std::uint32_t>(p + at_element_bytes, g.element_bytes);
  put_le<std::uint64_t>(p + at_num_layers, g.num_layers);
  put_le<std::uint64_t>(p + at_num_heads, g.num_heads);
  put_le<std::uint64_t>(p + at_head_dim, g.head_dim);
  put_le<std::uint64_t>(p + at_block_tokens, g.block_tokens);
  std::memcpy(p + at_hash, hash.bytes.data(), hash.bytes.size());
  put_le<std::uint32_t>(p + at_key_scale, std::bit_cast<std::uint32_t>(g.key_scale));
  put_le<std::uint32_t>(p + at_value_scale, std::bit_cast<std::uint32_t>(g.value_scale));
  put_le<std::uint64_t>(p + at_header_checksum, xxh3_64(out.first(at_header_checksum)));
  const std::size_t block = g.block_bytes(), half = block / 2;
  for (std::size_t l = 0; l < g.num_layers; ++l) {
    std::memcpy(p + entry_header_bytes + l * block, halves[2 * l], half);
    std::memcpy(p + entry_header_bytes + l * block + half, halves[2 * l + 1], half);
  }
  const std::size_t payload = g.num_layers * block;
  put_le<std::uint64_t>(p + entry_header_bytes + payload, xxh3_64(out.subspan(entry_header_bytes, payload)));
}

bool check_entry(const entry_geometry& g, const kv_block_hash& hash, std::span<const std::byte> bytes) noexcept {
  if (bytes.size() != g.entry_bytes()) return false;
  const std::byte* p = bytes.data();
  if (std::memcmp(p + at_magic, entry_magic.data(), entry_magic.size()) != 0) return false;
  if (get_le<std::uint64_t>(p + at_header_checksum) != xxh3_64(bytes.first(at_header_checksum))) return false;
  if (get_le<std::uint32_t>(p + at_version) != entry_version || get_le<std::uint32_t>(p + at_element) != g.element ||
      get_le<std::uint32_t>(p + at_element_bytes) != g.element_bytes || get_le<std::uint32_t>(p + at_reserved) != 0 ||
      get_le<std::uint64_t>(p + at_num_layers) != g.num_layers ||
      get_le<std::uint64_t>(p + at_num_heads) != g.num_heads || get_le<std::uint64_t>(p + at_head_dim) != g.head_dim ||
      get_le<std::uint64_t>(p + at_block_tokens) != g.block_tokens ||
      get_le<std::uint32_t>(p + at_key_scale) != std::bit_cast<std::uint32_t>(g.key_scale) ||
      get_le<std::uint32_t>(p + at_value_scale) != std::bit_cast<std::uint32_t>(g.value_scale))
    return false;
  if (std::memcmp(p + at_hash, hash.bytes.data(), hash.bytes.size()) != 0) return false;
  const std::size_t payload = g.num_layers * g.block_bytes();
  return get_le<std::uint64_t>(p + entry_header_bytes + payload) == xxh3_64(bytes.subspan(entry_header_bytes, payload));
}

held_entry::held_entry(const entry_geometry& g, const kv_block_hash& hash, std::vector<ref_ptr<block>> blocks)
    : geometry_(g), hash_(hash), blocks_(std::move(blocks)) {
  halves_.reserve(2 * blocks_.size());
  for (const ref_ptr<block>& b : blocks_) {
    halves_.push_back(b->keys());
    halves_.push_back(b->values());
  }
}

void held_entry::encode(std::span<std::byte> out) const noexcept { encode_entry(geometry_, hash_, halves_, out); }

std::shared_ptr<copied_entry> copied_entry::make(const entry_geometry& g, const kv_block_hash& hash,
                                                 std::span<const std::byte* const> halves) noexcept {
  try {
    auto e = std::make_shared<copied_entry>(hash);
    e->bytes_.resize(g.entry_bytes());
    encode_entry(g, hash, halves, e->bytes_);
    return e;
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}

void copied_entry::encode(std::span<std::byte> out) const noexcept {
  std::copy(bytes_.begin(), bytes_.end(), out.begin());
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
