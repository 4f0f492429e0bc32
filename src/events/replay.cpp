#include "events/replay.hpp"

#include <algorithm>
#include <cstring>
#include <utility>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

std::optional<replay_request> parse_replay_request(std::span<const std::span<const std::byte>> frames) noexcept {
  if (frames.size() != 2 || !frames[0].empty()) return std::nullopt;
  const std::span<const std::byte> body = frames[1];
  replay_request r;
  if (body.size() == 8) {
    r.what = replay_request::kind::replay;
    for (const std::byte b : body) r.start = r.start << 8 | std::to_integer<std::uint64_t>(b);
  } else if (body.size() == dump_request_body.size() &&
             std::memcmp(body.data(), dump_request_body.data(), body.size()) == 0) {
    r.what = replay_request::kind::dump;
  }
  return r;
}

void replay_buffer::push(std::uint64_t seq, std::shared_ptr<const std::string> payload) {
  if (capacity_ == 0) return;
  const std::size_t n = payload ? payload->size() : 0;
  batches_.push_back({seq, std::move(payload)});
  bytes_ += n;
  while (size() > capacity_ || (bytes_ > max_bytes_ && size() > 1)) {
    batch& oldest = batches_[head_++];
    bytes_ -= oldest.payload ? oldest.payload->size() : 0;
    oldest.payload.reset();
  }
  if (head_ >= capacity_) {
    batches_.erase(batches_.begin(), batches_.begin() + static_cast<std::ptrdiff_t>(head_));
    head_ = 0;
  }
}

std::span<const replay_buffer::batch> replay_buffer::from(std::uint64_t start) const noexcept {
  const std::span<const batch> kept = std::span(batches_).subspan(head_);
  const auto first = std::ranges::lower_bound(kept, start, {}, &batch::seq);
  return kept.subspan(static_cast<std::size_t>(first - kept.begin()));
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
