#include "events/batch_queue.hpp"

#include <new>
#include <utility>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

bool batch_queue::push(const kv_prefix_event& e) noexcept {
  std::lock_guard lock(mutex_);
  const bool was_empty = batches_.empty();
  last_event_ = e.sequence;
  if (queued_ < max_events_) {
    try {
      if (!open_ || batches_.back().lost || batches_.back().events.size() >= max_batch_) {
        queued_batch& b = batches_.emplace_back();
        b.seq = next_seq_++;
        b.first_event = b.last_event = e.sequence;
        open_ = true;
      }
      queued_batch& b = batches_.back();
      wire_event w{e.what, e.tier, e.hash, e.parent, b.tokens.size(), e.token_ids.size()};
      b.tokens.insert(b.tokens.end(), e.token_ids.begin(), e.token_ids.end());
      try {
        b.events.push_back(w);
      } catch (const std::bad_alloc&) {
        b.tokens.resize(w.tokens_at);
        throw;
      }
      b.last_event = e.sequence;
      ++queued_;
      return was_empty;
    } catch (const std::bad_alloc&) {
      // A batch opened for it alone stays empty: it becomes the lost one.
      if (open_ && batches_.back().events.empty()) batches_.back().lost = true;
    }
  }
  ++dropped_;
  if (open_ && batches_.back().lost) {
    batches_.back().last_event = e.sequence;
    return was_empty;
  }
  // A new lost batch: its number is taken even if memory is refused for
  // its record, so the gap shows all the same.
  const std::uint64_t seq = next_seq_++;
  open_ = false;
  try {
    queued_batch& b = batches_.emplace_back();
    b.seq = seq;
    b.first_event = b.last_event = e.sequence;
    b.lost = true;
    open_ = true;
  } catch (const std::bad_alloc&) {  // unrecorded: first_after() sees the hole
  }
  return was_empty;
}

std::deque<queued_batch> batch_queue::take() noexcept {
  std::lock_guard lock(mutex_);
  open_ = false;
  queued_ = 0;
  for (const queued_batch& b : batches_) {
    try {
      spans_.push_back({b.seq, b.first_event, b.last_event});
    } catch (const std::bad_alloc&) {  // a hole: first_after() sees it
    }
  }
  while (spans_.size() > keep_spans_) spans_.pop_front();
  return std::exchange(batches_, {});
}

namespace {

/// The first of `batches` (spans or queued batches, in order) that ends
/// after `event`; null if none does.
template <class Range>
const auto* first_ending_after(const Range& batches, std::uint64_t event) noexcept {
  for (const auto& b : batches)
    if (b.last_event > event) return &b;
  return static_cast<const typename Range::value_type*>(nullptr);
}

}  // namespace

std::optional<std::uint64_t> batch_queue::first_after(std::uint64_t event) noexcept {
  std::lock_guard lock(mutex_);
  open_ = false;
  // Every event is in some batch, in order: the first batch recorded that
  // ends after `event` starts right after it, unless the batch between was
  // never recorded (older than the spans kept, or memory refused).
  const auto starts_after = [&](const auto& b) -> std::optional<std::uint64_t> {
    if (b.first_event > event + 1) return std::nullopt;
    return b.seq;
  };
  if (const auto* s = first_ending_after(spans_, event)) return starts_after(*s);
  if (const auto* b = first_ending_after(batches_, event)) return starts_after(*b);
  if (last_event_ > event) return std::nullopt;  // in the newest batch, unrecorded
  return next_seq_;
}

bool batch_queue::empty() const noexcept {
  std::lock_guard lock(mutex_);
  return batches_.empty();
}

std::uint64_t batch_queue::dropped_events() const noexcept {
  std::lock_guard lock(mutex_);
  return dropped_;
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
