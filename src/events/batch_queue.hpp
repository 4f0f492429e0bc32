#pragma once
// The events a publisher's handler queues for its thread, numbered into
// batches as they are queued (src/events/batch_queue.cpp).
//
// Invariants (under mutex_):
// - batches_ holds the batches not taken yet, oldest first, numbered
//   next_seq_ - batches_.size() .. next_seq_ - 1 without gaps; only the
//   last may be open (events join it while `open_`).
// - A lost batch holds no event: its events were dropped (the queue was
//   full or memory was refused), so its number is a gap on the wire.
// - queued_ counts the events in batches_; it never exceeds max_events_.
// - spans_ holds (number, first event, last event) of the last
//   keep_spans_ batches taken, sent or lost, in order (a batch memory was
//   refused for, or its record, is a hole): with batches_, what maps a
//   dump's event number to the first batch after it. last_event_ is the
//   last event pushed, queued or dropped.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/block_hash.hpp"
#include "ghostlink/events.hpp"
#include "ghostlink/types.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// One event as a batch keeps it (its token ids in the batch's `tokens`).
struct wire_event {
  kv_prefix_event::kind what = kv_prefix_event::kind::stored;
  kv_prefix_tier tier = kv_prefix_tier::ram;
  kv_block_hash hash{};
  std::optional<kv_block_hash> parent;
  std::size_t tokens_at = 0;  // its token ids: tokens[tokens_at, tokens_at + tokens_size)
  std::size_t tokens_size = 0;
};

/// One numbered batch.
struct queued_batch {
  std::uint64_t seq = 0;
  std::uint64_t first_event = 0;  // the cache's event numbers it holds (or dropped)
  std::uint64_t last_event = 0;
  bool lost = false;
  std::vector<wire_event> events;
  std::vector<token_id> tokens;
};

class batch_queue {
 public:
  /// At most `max_events` queued, `max_batch` in a batch; the spans of the
  /// last `keep_spans` batches taken kept.
  batch_queue(std::size_t max_events, std::size_t max_batch, std::size_t keep_spans) noexcept
      : max_events_(max_events), max_batch_(max_batch), keep_spans_(keep_spans) {}

  /// From the cache's handler, one call at a time: queues `e` into the
  /// open batch (or a new one), or drops it into a lost batch. True if the
  /// queue was empty before (the thread is to be woken).
  bool push(const kv_prefix_event& e) noexcept;
  /// Takes every batch queued, the open one closed.
  std::deque<queued_batch> take() noexcept;
  /// The first batch whose events a mirror must apply after a dump taken
  /// as of event `event` (kv_prefix_dump::sequence): every batch from it on
  /// holds only events after `event` or some it applies again, which is
  /// harmless. None if the batches holding the events right after it are
  /// no longer recorded (the dump is older than the spans kept: take
  /// another). Closes the open batch, so no later event joins a batch
  /// before the one returned.
  std::optional<std::uint64_t> first_after(std::uint64_t event) noexcept;

  /// No batch is queued.
  bool empty() const noexcept;
  /// Events and batches dropped so far.
  std::uint64_t dropped_events() const noexcept;

 private:
  struct span {
    std::uint64_t seq, first_event, last_event;
  };
  const std::size_t max_events_, max_batch_, keep_spans_;
  mutable std::mutex mutex_;
  std::deque<queued_batch> batches_;
  std::deque<span> spans_;
  std::uint64_t next_seq_ = 0;
  std::uint64_t last_event_ = 0;
  std::size_t queued_ = 0;
  bool open_ = false;
  std::uint64_t dropped_ = 0;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
