#include "persist/format.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <new>
#include <utility>

#include "ghostlink/error.hpp"

// The payload (and the token ids) are written as the host stores them; the
// format says little-endian, so a big-endian host would have to swap them.
static_assert(std::endian::native == std::endian::little, "the saved-sequence format is written little-endian");

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

namespace {

// Byte offsets of the header's fixed fields (docs/FORMAT.md).
enum header_field : std::size_t {
  at_magic = 0,
  at_version = 8,
  at_header_bytes = 12,
  at_element = 16,
  at_element_bytes = 20,
  at_num_layers = 24,
  at_num_heads = 32,
  at_head_dim = 40,
  at_block_tokens = 48,
  at_tokens = 56,
  at_tokens_offset = 64,
  at_table_offset = 72,
  at_file_bytes = 80,
  at_model_bytes = 88,
  at_reserved = 92,
};
constexpr std::size_t checksum_bytes = 8;
constexpr std::size_t record_bytes = 24;  // a layer table's record, and a layout section's
/// The layout section's fixed part: rollback_tokens and flags; from version
/// 3 on the fp8 scales too.
constexpr std::size_t layout_fixed_bytes(std::uint32_t version) noexcept { return version >= 3 ? 24 : 16; }
constexpr std::uint64_t keys_only_flag = 1;

// Checked arithmetic on what a file says: false on overflow.
bool mul(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept { return !__builtin_mul_overflow(a, b, &out); }
bool add(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept { return !__builtin_add_overflow(a, b, &out); }
/// `a` rounded up to a multiple of `to` (a power of two).
bool align(std::uint64_t a, std::uint64_t to, std::uint64_t& out) noexcept {
  if (!add(a, to - 1, out)) return false;
  out &= ~(to - 1);
  return true;
}

std::uint32_t element_bytes_of(std::uint32_t element) noexcept {
  const element_codec* codec = codec_for(element);
  return codec != nullptr ? static_cast<std::uint32_t>(codec->size) : 0;
}

/// Whether a file of `element` may record these scales (kv_cache_config's rule).
bool valid_scales(std::uint32_t element, float key, float value) noexcept {
  const bool scaled = element == element_code<fp8_e4m3>;
  return valid_scale(key, scaled) && valid_scale(value, scaled);
}

/// Offsets up to layer 0's payload, as the header's fields imply them;
/// false on overflow.
bool lay_out_front(file_header& h) noexcept {
  file_layout& l = h.layout;
  std::uint64_t ids = 0, table = 0, section = 0, end = 0;
  l.header_bytes = fixed_header_bytes + h.model.size() + checksum_bytes;
  // The token ids and their checksum, 8-aligned after the header.
  if (!align(l.header_bytes, 8, l.tokens_offset) || !mul(h.tokens, sizeof(token_id), ids) ||
      !add(l.tokens_offset, ids, end) || !add(end, checksum_bytes, end))
    return false;
  // Version 2: the layout section and its checksum, 8-aligned after them.
  if (h.version >= 2) {
    if (!align(end, 8, l.layout_offset) || !mul(h.num_layers, record_bytes, section) ||
        !add(section, layout_fixed_bytes(h.version) + checksum_bytes, section) || !add(l.layout_offset, section, end))
      return false;
  }
  // The layer table and its checksum, 8-aligned after them.
  if (!align(end, 8, l.table_offset) || !mul(h.num_layers, record_bytes, table) || !add(l.table_offset, table, end) ||
      !add(end, checksum_bytes, end))
    return false;
  return align(end, layer_alignment, l.first_layer);
}

/// Each layer's payload (its saved tokens' keys and values), 64-aligned one
/// after another from layer 0's, and the file's length; false on overflow.
bool lay_out_layers(file_header& h) noexcept {
  file_layout& l = h.layout;
  std::uint64_t width = 0, at = l.first_layer;
  if (!mul(h.num_heads, h.head_dim, width) || h.head_dim % h.group() != 0) return false;
  width /= h.group();  // stored groups (or elements) per token
  l.layer_offsets.assign(h.num_layers, 0);
  l.layer_sizes.assign(h.num_layers, 0);
  for (std::size_t i = 0; i < h.num_layers; ++i) {
    std::uint64_t elements = 0, end = 0;
    if (!mul(width, h.saved_tokens(i), elements) ||
        !mul(elements, (h.keys_only ? 1 : 2) * std::uint64_t{h.element_bytes}, l.layer_sizes[i]))
      return false;
    l.layer_offsets[i] = at;
    if (!add(at, l.layer_sizes[i], end)) return false;
    l.file_bytes = end;
    if (!align(end, layer_alignment, at)) return false;
  }
  return true;
}

/// Whether `layers` and `rollback` are a layout a sequence can have held.
bool valid_layers(const std::vector<saved_layer>& layers, std::uint64_t rollback, std::uint64_t tokens) noexcept {
  return std::ranges::all_of(layers, [&](const saved_layer& l) {
    if (l.window == 0) return l.sink_tokens == 0 && l.kept_from == 0;
    return l.window <= std::numeric_limits<std::uint64_t>::max() - rollback && l.kept_from >= l.sink_tokens &&
           l.kept_from <= std::max(l.sink_tokens, tokens);
  });
}

}  // namespace

namespace {

/// Lays out the layers, then checks the stored length against it and the
/// file's.
error_code check_length(file_header& h, std::uint64_t file_bytes) {
  const std::uint64_t stored = h.layout.file_bytes;
  if (!lay_out_layers(h) || stored != h.layout.file_bytes) return kv_errc::file_corrupt;
  if (file_bytes < h.layout.file_bytes) return kv_errc::file_truncated;
  if (file_bytes > h.layout.file_bytes) return kv_errc::file_corrupt;
  return {};
}

}  // namespace

const element_codec& file_header::codec() const noexcept {
  const element_codec* c = codec_for(element);
  return c != nullptr ? *c : codec_of<float>;  // (a decoded header's element names one)
}

std::uint64_t file_header::sinks_end(std::size_t l) const noexcept {
  return layers[l].window != 0 ? std::min(layers[l].sink_tokens, tokens) : 0;
}

std::uint64_t file_header::kept_begin(std::size_t l) const noexcept {
  return layers[l].window != 0 ? std::min(std::max(layers[l].kept_from, sinks_end(l)), tokens) : 0;
}

kv_model_layout file_header::model_layout() const {
  kv_model_layout m;
  m.rollback_tokens = rollback_tokens;
  m.keys_only = keys_only;
  for (const saved_layer& l : layers) m.layers.push_back({l.window, l.sink_tokens});
  return m;
}

error_code make_header(std::vector<saved_layer> layers, std::size_t rollback_tokens, bool keys_only,
                       const kv_cache_config& config, std::size_t tokens, element_codec element, std::string model,
                       file_header& out) {
  out = {};
  out.keys_only = keys_only;
  out.element = element.code;
  out.element_bytes = static_cast<std::uint32_t>(element.size);
  out.key_scale = config.key_scale;
  out.value_scale = config.value_scale;
  out.num_layers = layers.size();
  out.layers = std::move(layers);
  out.rollback_tokens = rollback_tokens;
  out.num_heads = config.num_heads;
  out.head_dim = config.head_dim;
  out.block_tokens = config.block_tokens;
  out.tokens = tokens;
  out.model = std::move(model);
  if (out.num_layers == 0 || !valid_layers(out.layers, rollback_tokens, tokens) || !lay_out_front(out) ||
      !lay_out_layers(out))
    return kv_errc::file_corrupt;
  return {};
}

std::vector<std::byte> encode_front(const file_header& h, std::span<const token_id> ids,
                                    std::span<const layer_record> table) {
  const file_layout& l = h.layout;
  std::vector<std::byte> out(l.first_layer);  // zeros: the padding
  std::byte* p = out.data();
  std::memcpy(p + at_magic, file_magic.data(), file_magic.size());
  put_le<std::uint32_t>(p + at_version, file_version);
  put_le<std::uint32_t>(p + at_header_bytes, static_cast<std::uint32_t>(l.header_bytes));
  put_le<std::uint32_t>(p + at_element, h.element);
  put_le<std::uint32_t>(p + at_element_bytes, h.element_bytes);
  put_le<std::uint64_t>(p + at_num_layers, h.num_layers);
  put_le<std::uint64_t>(p + at_num_heads, h.num_heads);
  put_le<std::uint64_t>(p + at_head_dim, h.head_dim);
  put_le<std::uint64_t>(p + at_block_tokens, h.block_tokens);
  put_le<std::uint64_t>(p + at_tokens, h.tokens);
  put_le<std::uint64_t>(p + at_tokens_offset, l.tokens_offset);
  put_le<std::uint64_t>(p + at_table_offset, l.table_offset);
  put_le<std::uint64_t>(p + at_file_bytes, l.file_bytes);
  put_le<std::uint32_t>(p + at_model_bytes, static_cast<std::uint32_t>(h.model.size()));
  std::memcpy(p + fixed_header_bytes, h.model.data(), h.model.size());
  const std::size_t hashed = fixed_header_bytes + h.model.size();
  put_le<std::uint64_t>(p + hashed, xxh3_64(std::span(out).first(hashed)));

  std::byte* t = p + l.tokens_offset;
  for (std::size_t i = 0; i < ids.size(); ++i) put_le<std::uint32_t>(t + 4 * i, std::bit_cast<std::uint32_t>(ids[i]));
  put_le<std::uint64_t>(t + 4 * ids.size(), xxh3_64(std::span(out).subspan(l.tokens_offset, 4 * ids.size())));

  std::byte* y = p + l.layout_offset;
  put_le<std::uint64_t>(y, h.rollback_tokens);
  put_le<std::uint64_t>(y + 8, h.keys_only ? keys_only_flag : 0);
  put_le<std::uint32_t>(y + 16, std::bit_cast<std::uint32_t>(h.key_scale));
  put_le<std::uint32_t>(y + 20, std::bit_cast<std::uint32_t>(h.value_scale));
  for (std::size_t i = 0; i < h.layers.size(); ++i) {
    std::byte* r = y + layout_fixed_bytes(file_version) + record_bytes * i;
    put_le<std::uint64_t>(r, h.layers[i].window);
    put_le<std::uint64_t>(r + 8, h.layers[i].sink_tokens);
    put_le<std::uint64_t>(r + 16, h.layers[i].kept_from);
  }
  const std::size_t section = layout_fixed_bytes(file_version) + record_bytes * h.layers.size();
  put_le<std::uint64_t>(y + section, xxh3_64(std::span(out).subspan(l.layout_offset, section)));

  std::byte* e = p + l.table_offset;
  for (std::size_t i = 0; i < table.size(); ++i) {
    put_le<std::uint64_t>(e + record_bytes * i, table[i].offset);
    put_le<std::uint64_t>(e + record_bytes * i + 8, table[i].bytes);
    put_le<std::uint64_t>(e + record_bytes * i + 16, table[i].checksum);
  }
  put_le<std::uint64_t>(e + record_bytes * table.size(),
                        xxh3_64(std::span(out).subspan(l.table_offset, record_bytes * table.size())));
  return out;
}

error_code header_length(std::span<const std::byte> start, std::uint64_t file_bytes, std::size_t& header_bytes) {
  const std::size_t have = std::min<std::uint64_t>(start.size(), file_bytes);
  const std::size_t magic = std::min(have, file_magic.size());
  // (An empty file has no data pointer to compare: memcmp must not see it.)
  if (magic != 0 && std::memcmp(start.data(), file_magic.data(), magic) != 0) return kv_errc::file_corrupt;
  if (have < at_version + 4) return kv_errc::file_truncated;
  const std::uint32_t version = get_le<std::uint32_t>(start.data() + at_version);
  if (version == 0 || version > file_version) return kv_errc::file_version_unsupported;
  if (have < fixed_header_bytes) return kv_errc::file_truncated;
  const std::uint32_t model = get_le<std::uint32_t>(start.data() + at_model_bytes);
  header_bytes = get_le<std::uint32_t>(start.data() + at_header_bytes);
  if (model > max_model_bytes || header_bytes != fixed_header_bytes + model + checksum_bytes)
    return kv_errc::file_corrupt;
  if (file_bytes < header_bytes) return kv_errc::file_truncated;
  return {};
}

error_code decode_header(std::span<const std::byte> bytes, std::uint64_t file_bytes, file_header& out) {
  out = {};
  const std::byte* p = bytes.data();
  const std::size_t hashed = bytes.size() - checksum_bytes;
  if (get_le<std::uint64_t>(p + hashed) != xxh3_64(bytes.first(hashed))) return kv_errc::file_corrupt;
  out.version = get_le<std::uint32_t>(p + at_version);
  out.element = get_le<std::uint32_t>(p + at_element);
  out.element_bytes = get_le<std::uint32_t>(p + at_element_bytes);
  out.num_layers = get_le<std::uint64_t>(p + at_num_layers);
  out.num_heads = get_le<std::uint64_t>(p + at_num_heads);
  out.head_dim = get_le<std::uint64_t>(p + at_head_dim);
  out.block_tokens = get_le<std::uint64_t>(p + at_block_tokens);
  out.tokens = get_le<std::uint64_t>(p + at_tokens);
  out.model.assign(reinterpret_cast<const char*>(p + fixed_header_bytes), hashed - fixed_header_bytes);
  if (out.element_bytes == 0 || out.element_bytes != element_bytes_of(out.element) || out.num_layers == 0 ||
      out.num_heads == 0 || out.head_dim == 0 || out.block_tokens == 0 || get_le<std::uint32_t>(p + at_reserved) != 0 ||
      !lay_out_front(out))
    return kv_errc::file_corrupt;
  const file_layout& l = out.layout;
  if (get_le<std::uint64_t>(p + at_tokens_offset) != l.tokens_offset ||
      get_le<std::uint64_t>(p + at_table_offset) != l.table_offset)
    return kv_errc::file_corrupt;
  out.layout.file_bytes = get_le<std::uint64_t>(p + at_file_bytes);  // as stored: decode_layout() checks it
  if (l.first_layer > file_bytes) return kv_errc::file_truncated;  // bounds the layers' records below
  // Version 1: every layer full, and what follows from that alone.
  if (out.version == 1) {
    try {
      out.layers.assign(out.num_layers, saved_layer{});
    } catch (const std::bad_alloc&) {
      return kv_errc::file_corrupt;  // a layer count no file of this length can hold
    }
    return check_length(out, file_bytes);
  }
  return {};  // version 2: decode_layout() lays out the layers
}

std::uint64_t layout_section_bytes(const file_header& h) noexcept {
  return layout_fixed_bytes(h.version) + record_bytes * h.num_layers + checksum_bytes;
}

error_code decode_layout(file_header& h, std::span<const std::byte> bytes, std::uint64_t file_bytes) {
  if (h.version == 1) return {};
  const std::size_t section = bytes.size() - checksum_bytes;
  if (get_le<std::uint64_t>(bytes.data() + section) != xxh3_64(bytes.first(section))) return kv_errc::file_corrupt;
  h.rollback_tokens = get_le<std::uint64_t>(bytes.data());
  const std::uint64_t flags = get_le<std::uint64_t>(bytes.data() + 8);
  if ((flags & ~keys_only_flag) != 0) return kv_errc::file_corrupt;
  h.keys_only = (flags & keys_only_flag) != 0;
  if (h.version >= 3) {
    h.key_scale = std::bit_cast<float>(get_le<std::uint32_t>(bytes.data() + 16));
    h.value_scale = std::bit_cast<float>(get_le<std::uint32_t>(bytes.data() + 20));
  }
  if (!valid_scales(h.element, h.key_scale, h.value_scale)) return kv_errc::file_corrupt;
  h.layers.resize(h.num_layers);
  for (std::size_t i = 0; i < h.num_layers; ++i) {
    const std::byte* r = bytes.data() + layout_fixed_bytes(h.version) + record_bytes * i;
    h.layers[i] = {get_le<std::uint64_t>(r), get_le<std::uint64_t>(r + 8), get_le<std::uint64_t>(r + 16)};
  }
  if (!valid_layers(h.layers, h.rollback_tokens, h.tokens)) return kv_errc::file_corrupt;
  return check_length(h, file_bytes);
}

error_code check_expected(const file_header& h, const file_expectation& expected) {
  // The fp8 scales are part of what the data is, as its element type.
  if (h.element != expected.element.code || h.key_scale != expected.config.key_scale ||
      h.value_scale != expected.config.value_scale)
    return kv_errc::element_type_mismatch;
  if (h.num_layers != expected.num_layers || h.num_heads != expected.config.num_heads ||
      h.head_dim != expected.config.head_dim || h.block_tokens != expected.config.block_tokens)
    return kv_errc::geometry_mismatch;
  if (h.model != expected.model) return kv_errc::model_mismatch;
  const kv_model_layout want = expected.layout.value_or(kv_model_layout::full(expected.num_layers));
  if (h.rollback_tokens != want.rollback_tokens || h.keys_only != want.keys_only) return kv_errc::layout_mismatch;
  for (std::size_t i = 0; i < h.num_layers; ++i)
    if (h.layers[i].window != want.layers[i].window || h.layers[i].sink_tokens != want.layers[i].sink_tokens)
      return kv_errc::layout_mismatch;
  return {};
}

std::uint64_t token_section_bytes(const file_header& h) noexcept {
  return sizeof(token_id) * h.tokens + checksum_bytes;
}

error_code decode_tokens(const file_header& h, std::span<const std::byte> bytes, std::vector<token_id>& out) {
  const std::size_t ids = bytes.size() - checksum_bytes;
  if (get_le<std::uint64_t>(bytes.data() + ids) != xxh3_64(bytes.first(ids))) return kv_errc::file_corrupt;
  out.resize(h.tokens);
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = std::bit_cast<token_id>(get_le<std::uint32_t>(bytes.data() + sizeof(token_id) * i));
  return {};
}

std::uint64_t table_bytes(const file_header& h) noexcept { return record_bytes * h.num_layers + checksum_bytes; }

error_code decode_table(const file_header& h, std::span<const std::byte> bytes, std::vector<layer_record>& out) {
  const std::size_t records = bytes.size() - checksum_bytes;
  if (get_le<std::uint64_t>(bytes.data() + records) != xxh3_64(bytes.first(records))) return kv_errc::file_corrupt;
  out.resize(h.num_layers);
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::byte* e = bytes.data() + record_bytes * i;
    out[i] = {get_le<std::uint64_t>(e), get_le<std::uint64_t>(e + 8), get_le<std::uint64_t>(e + 16)};
    if (out[i].offset != h.layout.layer_offset(i) || out[i].bytes != h.layout.layer_bytes(i))
      return kv_errc::file_corrupt;
  }
  return {};
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
