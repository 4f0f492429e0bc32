#pragma once
// The KV-event wire format of vLLM v0.25.1 (vllm/distributed/kv_events.py,
// commit 752a3a504485790a2e8491cacbb35c137339ad34), msgpack through
// nlohmann::json (src/events/wire.cpp); docs/API.md lists every field.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include "ghostlink/detail/flavour.hpp"

#include "events/batch_queue.hpp"
#include "ghostlink/event_publisher.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// What every batch of one publisher shares.
struct wire_format {
  kv_wire_hash hashes = kv_wire_hash::bytes;
  std::string medium = "RAM";        // the RAM tier's
  std::string store_medium = "STORE";  // the store tier's
  /// The medium of `tier`.
  const std::string& medium_of(kv_prefix_tier tier) const noexcept {
    return tier == kv_prefix_tier::store ? store_medium : medium;
  }
  std::size_t block_size = 0;
  std::int64_t data_parallel_rank = 0;
};

/// A batch's number as it goes on the wire: 8 bytes, big-endian.
std::array<std::byte, 8> wire_seq(std::uint64_t seq) noexcept;
/// The end of a replay: -1 as 8 bytes.
inline constexpr std::uint64_t end_of_replay = ~std::uint64_t{0};

/// The payload of `batch` (its events in order; runs of stored events of
/// one tier that continue one prefix become one BlockStored, runs of
/// removed events of one tier one BlockRemoved), stamped `ts` (seconds since the epoch). Throws
/// std::bad_alloc.
std::string encode_batch(const queued_batch& batch, const wire_format& f, double ts);
/// The payload of dump entries: one BlockStored each, of its tier's medium.
/// Throws std::bad_alloc.
std::string encode_dump(std::span<const kv_prefix_dump::entry> entries, const wire_format& f, double ts);

}  // namespace detail
GHOSTLINK_NAMESPACE_END
