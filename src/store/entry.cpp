#include "store/entry.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <new>
#include <utility>

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
  at_flags = 20,
  at_num_layers = 24,
  at_num_heads = 32,
  at_head_dim = 40,
  at_block_tokens = 48,
  at_hash = 56,
  at_key_scale = 88,
  at_value_scale = 92,
  at_layer_table = 96,
};
inline constexpr std::uint32_t flag_keys_only = 1;

std::byte* layer_record(std::byte* p, std::size_t l) noexcept {
  return p + at_layer_table + l * entry_layer_record_bytes;
}
const std::byte* layer_record(const std::byte* p, std::size_t l) noexcept {
  return p + at_layer_table + l * entry_layer_record_bytes;
}

}  // namespace

void encode_entry(const entry_geometry& g, const kv_block_hash& hash, std::span<const std::byte* const> halves,
                  std::span<std::byte> out) noexcept {
  std::byte* p = out.data();
  const std::size_t header = g.header_bytes();
  std::memset(p, 0, header);
  std::memcpy(p + at_magic, entry_magic.data(), entry_magic.size());
  put_le<std::uint32_t>(p + at_version, entry_version);
  put_le<std::uint32_t>(p + at_element, g.element);
  put_le<std::uint32_t>(p + at_element_bytes, g.element_bytes);
  put_le<std::uint32_t>(p + at_flags, g.keys_only ? flag_keys_only : 0);
  put_le<std::uint64_t>(p + at_num_layers, g.num_layers);
  put_le<std::uint64_t>(p + at_num_heads, g.num_heads);
  put_le<std::uint64_t>(p + at_head_dim, g.head_dim);
  put_le<std::uint64_t>(p + at_block_tokens, g.block_tokens);
  std::memcpy(p + at_hash, hash.bytes.data(), hash.bytes.size());
  put_le<std::uint32_t>(p + at_key_scale, std::bit_cast<std::uint32_t>(g.key_scale));
  put_le<std::uint32_t>(p + at_value_scale, std::bit_cast<std::uint32_t>(g.value_scale));
  for (std::size_t l = 0; l < g.num_layers; ++l) {
    std::byte* r = layer_record(p, l);
    put_le<std::uint64_t>(r, (*g.layers)[l].window);
    put_le<std::uint64_t>(r + 8, (*g.layers)[l].sink_tokens);
    put_le<std::uint64_t>(r + 16, halves[2 * l] ? 1 : 0);
  }
  put_le<std::uint64_t>(p + header - 8, xxh3_64(out.first(header - 8)));
  const std::size_t half = g.half_bytes();
  std::byte* block = p + header;
  for (std::size_t l = 0; l < g.num_layers; ++l) {
    if (!halves[2 * l]) continue;
    std::memcpy(block, halves[2 * l], half);
    if (!g.keys_only) std::memcpy(block + half, halves[2 * l + 1], half);
    block += g.block_bytes();
  }
  const std::size_t payload = static_cast<std::size_t>(block - p) - header;
  put_le<std::uint64_t>(block, xxh3_64(out.subspan(header, payload)));
}

bool check_entry(const entry_geometry& g, const kv_block_hash& hash, std::span<const std::byte> bytes) noexcept {
  const std::size_t header = g.header_bytes();
  if (bytes.size() < header + 8) return false;
  const std::byte* p = bytes.data();
  if (std::memcmp(p + at_magic, entry_magic.data(), entry_magic.size()) != 0) return false;
  if (get_le<std::uint64_t>(p + header - 8) != xxh3_64(bytes.first(header - 8))) return false;
  if (get_le<std::uint32_t>(p + at_version) != entry_version || get_le<std::uint32_t>(p + at_element) != g.element ||
      get_le<std::uint32_t>(p + at_element_bytes) != g.element_bytes ||
      get_le<std::uint32_t>(p + at_flags) != (g.keys_only ? flag_keys_only : 0) ||
      get_le<std::uint64_t>(p + at_num_layers) != g.num_layers ||
      get_le<std::uint64_t>(p + at_num_heads) != g.num_heads || get_le<std::uint64_t>(p + at_head_dim) != g.head_dim ||
      get_le<std::uint64_t>(p + at_block_tokens) != g.block_tokens ||
      get_le<std::uint32_t>(p + at_key_scale) != std::bit_cast<std::uint32_t>(g.key_scale) ||
      get_le<std::uint32_t>(p + at_value_scale) != std::bit_cast<std::uint32_t>(g.value_scale))
    return false;
  if (std::memcmp(p + at_hash, hash.bytes.data(), hash.bytes.size()) != 0) return false;
  // The layout, layer by layer: a full layer's block is always there.
  std::size_t present = 0;
  for (std::size_t l = 0; l < g.num_layers; ++l) {
    const std::byte* r = layer_record(p, l);
    const std::uint64_t has = get_le<std::uint64_t>(r + 16);
    const kv_layer_layout& want = (*g.layers)[l];
    if (get_le<std::uint64_t>(r) != want.window || get_le<std::uint64_t>(r + 8) != want.sink_tokens || has > 1 ||
        (has == 0 && want.window == 0))
      return false;
    present += has;
  }
  if (bytes.size() != g.entry_bytes(present)) return false;
  const std::size_t payload = present * g.block_bytes();
  return get_le<std::uint64_t>(p + header + payload) == xxh3_64(bytes.subspan(header, payload));
}

const std::byte* entry_layer(const entry_geometry& g, std::span<const std::byte> entry, std::size_t layer) noexcept {
  const std::byte* p = entry.data();
  if (get_le<std::uint64_t>(layer_record(p, layer) + 16) == 0) return nullptr;
  std::size_t before = 0;
  for (std::size_t l = 0; l < layer; ++l) before += get_le<std::uint64_t>(layer_record(p, l) + 16);
  return p + g.header_bytes() + before * g.block_bytes();
}

held_entry::held_entry(entry_geometry g, const kv_block_hash& hash, std::vector<ref_ptr<block>> blocks,
                       std::shared_ptr<kv_store_receipt> receipt)
    : entry_value(hash, std::move(receipt)), geometry_(std::move(g)), blocks_(std::move(blocks)) {
  halves_.reserve(2 * blocks_.size());
  for (const ref_ptr<block>& b : blocks_) {
    halves_.push_back(b ? b->keys() : nullptr);
    halves_.push_back(b ? b->values() : nullptr);
  }
}

void held_entry::encode(std::span<std::byte> out) const noexcept { encode_entry(geometry_, hash(), halves_, out); }

std::shared_ptr<copied_entry> copied_entry::make(const entry_geometry& g, const kv_block_hash& hash,
                                                 std::span<const std::byte* const> halves,
                                                 std::shared_ptr<kv_store_receipt> receipt) noexcept {
  try {
    auto e = std::make_shared<copied_entry>(hash, std::move(receipt));
    e->bytes_.resize(g.entry_bytes(present_layers(halves)));
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
