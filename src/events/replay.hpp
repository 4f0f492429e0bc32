#pragma once
// The ROUTER socket's side of the protocol (src/events/replay.cpp): parsing
// a request, and the buffer of batches a replay reads. Neither touches a
// socket, so the fuzzer (tests/fuzz/fuzz_replay.cpp) drives them alone.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// What a client asked of the ROUTER socket.
struct replay_request {
  enum class kind : std::uint8_t {
    replay,   ///< the batches from `start` on (8 bytes, big-endian), then the end
    dump,     ///< the body "dump": every entry, then the end
    invalid,  ///< any other body: the end alone
  };
  kind what = kind::invalid;
  std::uint64_t start = 0;
};

/// The body that asks for a dump.
inline constexpr std::string_view dump_request_body = "dump";

/// The request in a message's frames after the identity the ROUTER socket
/// adds: an empty delimiter, then the body (a REQ socket's one frame, or a
/// DEALER's two). None if the frames are not that (not answered: the
/// reply's envelope would be a guess), as vLLM's publisher does.
std::optional<replay_request> parse_replay_request(std::span<const std::span<const std::byte>> frames) noexcept;

/// The last batches sent, up to `capacity` of them and `max_bytes` of
/// payload (the newest always kept), by number (increasing, with gaps
/// where batches were lost), their payloads shared with replies in flight.
class replay_buffer {
 public:
  struct batch {
    std::uint64_t seq;
    std::shared_ptr<const std::string> payload;
  };
  replay_buffer(std::size_t capacity, std::size_t max_bytes = SIZE_MAX) noexcept
      : capacity_(capacity), max_bytes_(max_bytes) {}
  /// Keeps batch `seq` (later than any kept), dropping the oldest past the
  /// capacity or the bytes. Throws std::bad_alloc, keeping nothing new.
  void push(std::uint64_t seq, std::shared_ptr<const std::string> payload);
  /// The batches numbered `start` or later, oldest first (valid until the next push).
  std::span<const batch> from(std::uint64_t start) const noexcept;
  std::size_t size() const noexcept { return batches_.size() - head_; }
  /// The payload bytes kept.
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  // The kept batches are batches_[head_..]: dropping the oldest moves
  // head_, and the dropped ones are erased at once when head_ reaches the
  // capacity (amortised O(1)), so that the kept ones stay one span.
  const std::size_t capacity_, max_bytes_;
  std::vector<batch> batches_;
  std::size_t head_ = 0;
  std::size_t bytes_ = 0;  // of batches_[head_..]
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
