#include "events/wire.hpp"

#include <bit>
#include <cstring>
#include <iterator>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include <nlohmann/json.hpp>

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

// Ordered: msgspec writes a tagged struct's "type" first, then its fields
// in declaration order.
using json = nlohmann::ordered_json;

json wire_hash(const kv_block_hash& h, kv_wire_hash form) {
  if (form == kv_wire_hash::uint64) {
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < 8; ++i) v = v << 8 | h.bytes[i];
    return v;
  }
  return json::binary(std::vector<std::uint8_t>(std::begin(h.bytes), std::end(h.bytes)));
}

json wire_parent(const std::optional<kv_block_hash>& parent, kv_wire_hash form) {
  return parent ? wire_hash(*parent, form) : json(nullptr);
}

/// vLLM's BlockStored: fields without a default are always written (nil
/// for None); those with one (extra_keys, group_idx, kv_cache_spec_kind,
/// kv_cache_spec_sliding_window) are left out, as msgspec's omit_defaults does.
json block_stored(json hashes, json parent, std::span<const token_id> tokens, kv_prefix_tier tier,
                  const wire_format& f) {
  json e = json::object();
  e["type"] = "BlockStored";
  e["block_hashes"] = std::move(hashes);
  e["parent_block_hash"] = std::move(parent);
  e["token_ids"] = json::array();
  for (const token_id t : tokens) e["token_ids"].push_back(t);
  e["block_size"] = f.block_size;
  e["lora_id"] = nullptr;
  e["medium"] = f.medium_of(tier);
  e["lora_name"] = nullptr;
  return e;
}

json block_removed(json hashes, kv_prefix_tier tier, const wire_format& f) {
  json e = json::object();
  e["type"] = "BlockRemoved";
  e["block_hashes"] = std::move(hashes);
  e["medium"] = f.medium_of(tier);
  return e;
}

/// EventBatch is array-like: [ts (float64), events, data_parallel_rank].
/// nlohmann writes a float as float32 where that loses nothing; msgspec
/// (a Python float) always writes float64, so the header is written here.
std::string envelope(const json& events, const wire_format& f, double ts) {
  std::string out;
  out.push_back(static_cast<char>(0x93));  // fixarray of 3
  out.push_back(static_cast<char>(0xcb));  // float64, big-endian
  const auto bits = std::bit_cast<std::uint64_t>(ts);
  for (int shift = 56; shift >= 0; shift -= 8) out.push_back(static_cast<char>(bits >> shift & 0xff));
  json::to_msgpack(events, out);
  json::to_msgpack(json(f.data_parallel_rank), out);
  return out;
}

}  // namespace

std::array<std::byte, 8> wire_seq(std::uint64_t seq) noexcept {
  std::array<std::byte, 8> out{};
  for (std::size_t i = 0; i < 8; ++i) out[i] = static_cast<std::byte>(seq >> (56 - 8 * i) & 0xff);
  return out;
}

std::string encode_batch(const queued_batch& batch, const wire_format& f, double ts) {
  json events = json::array();
  const std::span<const token_id> tokens(batch.tokens);
  const std::span<const wire_event> in(batch.events);
  for (std::size_t i = 0; i < in.size();) {
    const wire_event& e = in[i];
    std::size_t j = i + 1;
    switch (e.what) {
      case kv_prefix_event::kind::stored: {
        // A run of one tier that continues one prefix, its tokens following on.
        while (j < in.size() && in[j].what == e.what && in[j].tier == e.tier && in[j].parent == in[j - 1].hash &&
               in[j].tokens_at == in[j - 1].tokens_at + in[j - 1].tokens_size)
          ++j;
        json hashes = json::array();
        for (std::size_t k = i; k < j; ++k) hashes.push_back(wire_hash(in[k].hash, f.hashes));
        const std::size_t size = in[j - 1].tokens_at + in[j - 1].tokens_size - e.tokens_at;
        events.push_back(block_stored(std::move(hashes), wire_parent(e.parent, f.hashes),
                                      tokens.subspan(e.tokens_at, size), e.tier, f));
        break;
      }
      case kv_prefix_event::kind::removed: {
        while (j < in.size() && in[j].what == e.what && in[j].tier == e.tier) ++j;
        json hashes = json::array();
        for (std::size_t k = i; k < j; ++k) hashes.push_back(wire_hash(in[k].hash, f.hashes));
        events.push_back(block_removed(std::move(hashes), e.tier, f));
        break;
      }
      case kv_prefix_event::kind::cleared: events.push_back(json{{"type", "AllBlocksCleared"}}); break;
    }
    i = j;
  }
  return envelope(events, f, ts);
}

std::string encode_dump(std::span<const kv_prefix_dump::entry> entries, const wire_format& f, double ts) {
  json events = json::array();
  for (const kv_prefix_dump::entry& e : entries) {
    json hashes = json::array();
    hashes.push_back(wire_hash(e.hash, f.hashes));
    events.push_back(block_stored(std::move(hashes), wire_parent(e.parent, f.hashes), e.token_ids, e.tier, f));
  }
  return envelope(events, f, ts);
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
