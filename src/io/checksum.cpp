#include "io/checksum.hpp"

// XXH3, header-only: nothing to link, for us or for our consumers.
#define XXH_INLINE_ALL
#include <xxhash.h>

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

std::uint64_t xxh3_64(std::span<const std::byte> bytes) noexcept { return XXH3_64bits(bytes.data(), bytes.size()); }

struct xxh3_stream::state {
  XXH3_state_t xxh;
};

xxh3_stream::xxh3_stream() : state_(std::make_unique<state>()) { XXH3_64bits_reset(&state_->xxh); }
xxh3_stream::~xxh3_stream() = default;
void xxh3_stream::update(std::span<const std::byte> bytes) noexcept {
  XXH3_64bits_update(&state_->xxh, bytes.data(), bytes.size());
}
std::uint64_t xxh3_stream::digest() const noexcept { return XXH3_64bits_digest(&state_->xxh); }

}  // namespace detail
GHOSTLINK_NAMESPACE_END
