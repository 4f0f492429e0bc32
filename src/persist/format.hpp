#pragma once
// The file format of a saved sequence, version 2, and version 1 read as a
// full layout (docs/FORMAT.md gives both byte by byte): encoding, decoding and validation, with no file I/O. Every
// decoder returns `file_corrupt`, `file_truncated` or
// `file_version_unsupported` for a file it refuses, and checks every size
// and offset against the layout the geometry implies, without overflow, so
// that a reader never goes out of bounds whatever the bytes say.

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/detail/persist_interface.hpp"
#include "ghostlink/layout.hpp"
#include "ghostlink/types.hpp"
#include "io/bytes.hpp"
#include "io/checksum.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// The first 8 bytes of every file: "\x89GLKV\r\n\x1a" (as PNG's, it
/// catches a file mangled as text).
inline constexpr std::array<unsigned char, 8> file_magic = {0x89, 'G', 'L', 'K', 'V', '\r', '\n', 0x1a};
/// What saves write; loads read it, version 2 (no scales: 1) and version 1
/// (no layout section: every layer full, rollback_tokens 0).
inline constexpr std::uint32_t file_version = 3;
/// The header's fixed part: everything up to the model id.
inline constexpr std::size_t fixed_header_bytes = 96;
inline constexpr std::size_t max_model_bytes = 65536;
/// A layer's payload starts at a multiple of this.
inline constexpr std::uint64_t layer_alignment = 64;

/// Where everything is, as the geometry and the layout section imply it.
struct file_layout {
  std::uint64_t header_bytes = 0;   // the fixed part, the model id and the header's checksum
  std::uint64_t tokens_offset = 0;  // the token ids, then their checksum
  std::uint64_t layout_offset = 0;  // version 2: the layout section, then its checksum
  std::uint64_t table_offset = 0;   // the layer table, then its checksum
  std::uint64_t first_layer = 0;    // layer 0's payload
  std::vector<std::uint64_t> layer_offsets;  // each layer's payload, 64-aligned one after another
  std::vector<std::uint64_t> layer_sizes;    // each layer's payload: its saved tokens' keys, then their values
  std::uint64_t file_bytes = 0;

  std::uint64_t layer_offset(std::size_t layer) const noexcept { return layer_offsets[layer]; }
  std::uint64_t layer_bytes(std::size_t layer) const noexcept { return layer_sizes[layer]; }
};

/// One layer of the layout section: its window, its sinks, and the first
/// position past the sinks it holds (0, 0, 0 for a full layer).
struct saved_layer {
  std::uint64_t window = 0, sink_tokens = 0, kept_from = 0;
};

/// What the header (and a version 2 file's layout section) says.
struct file_header {
  std::uint32_t version = file_version;
  std::uint32_t element = 0;  // element_code<T>
  std::uint32_t element_bytes = 0;  // of a group (32 elements of q8_0, q4_0) or an element
  float key_scale = 1.0f, value_scale = 1.0f;  // version 3's layout section (fp8; 1 for the others)
  std::uint64_t num_layers = 0, num_heads = 0, head_dim = 0, block_tokens = 0;
  std::uint64_t tokens = 0;
  std::string model;
  std::uint64_t rollback_tokens = 0;
  bool keys_only = false;           // the layout section's flag: no values saved
  std::vector<saved_layer> layers;  // num_layers of them (version 1: every one full)
  file_layout layout;               // computed from the above

  std::uint64_t token_width() const noexcept { return num_heads * head_dim; }
  /// How its element type is stored (its size, group and loads).
  const element_codec& codec() const noexcept;
  /// Elements per stored group: 32 for q8_0 and q4_0, else 1.
  std::uint64_t group() const noexcept { return codec().group; }
  /// Bytes of one token's keys, and of its values (0 keys only).
  std::uint64_t token_bytes() const noexcept { return token_width() / group() * element_bytes; }
  std::uint64_t value_token_bytes() const noexcept { return value_width() / group() * element_bytes; }
  /// The tokens layer `l` saves: positions [0, sinks_end(l)) and
  /// [kept_begin(l), tokens), in that order (every token for a full layer).
  std::uint64_t sinks_end(std::size_t l) const noexcept;
  std::uint64_t kept_begin(std::size_t l) const noexcept;
  std::uint64_t saved_tokens(std::size_t l) const noexcept { return sinks_end(l) + (tokens - kept_begin(l)); }
  /// Bytes of layer `l`'s keys: half its payload, or all of it (keys only);
  /// its values follow them.
  std::uint64_t key_bytes(std::size_t l) const noexcept {
    return keys_only ? layout.layer_bytes(l) : layout.layer_bytes(l) / 2;
  }
  /// Elements per token's values: token_width(), or 0 (keys only).
  std::uint64_t value_width() const noexcept { return keys_only ? 0 : token_width(); }
  /// The model layout the file records.
  kv_model_layout model_layout() const;
};

/// One record of the layer table.
struct layer_record {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;  // XXH3-64 of the payload
};

/// A header for `tokens` tokens of `config`'s geometry, whose layers are
/// `layers` (what each holds) with `rollback_tokens`, storing keys alone if
/// `keys_only`; `file_corrupt` if the layout overflows (it cannot for a
/// snapshot that exists).
error_code make_header(std::vector<saved_layer> layers, std::size_t rollback_tokens, bool keys_only,
                       const kv_cache_config& config, std::size_t tokens, element_codec element, std::string model,
                       file_header& out);

/// Bytes [0, layout.first_layer): the header, the token ids and the layer
/// table, each with its checksum, and the zero padding between them.
std::vector<std::byte> encode_front(const file_header& header, std::span<const token_id> ids,
                                    std::span<const layer_record> table);

/// From the file's first min(file_bytes, fixed_header_bytes) bytes: the
/// header's length (`header_bytes`), or why the file is refused.
error_code header_length(std::span<const std::byte> start, std::uint64_t file_bytes, std::size_t& header_bytes);
/// The whole header (`header_length()` bytes), checked: its checksum, its
/// geometry and offsets, and the file's length.
error_code decode_header(std::span<const std::byte> bytes, std::uint64_t file_bytes, file_header& out);
/// The layout section (version 2: `layout_section_bytes()` bytes at
/// `layout.layout_offset`), checked; then the layers' offsets and sizes.
error_code decode_layout(file_header& header, std::span<const std::byte> bytes, std::uint64_t file_bytes);
std::uint64_t layout_section_bytes(const file_header& header) noexcept;
/// `element_type_mismatch`, `geometry_mismatch`, `model_mismatch` or
/// `layout_mismatch` unless the header is what `expected` asks for.
error_code check_expected(const file_header& header, const file_expectation& expected);
/// The token section (`token_section_bytes()` bytes), checked.
error_code decode_tokens(const file_header& header, std::span<const std::byte> bytes, std::vector<token_id>& out);
std::uint64_t token_section_bytes(const file_header& header) noexcept;
/// The layer table (`table_bytes()` bytes), checked against its checksum and
/// the layout.
error_code decode_table(const file_header& header, std::span<const std::byte> bytes, std::vector<layer_record>& out);
std::uint64_t table_bytes(const file_header& header) noexcept;

}  // namespace detail
GHOSTLINK_NAMESPACE_END
