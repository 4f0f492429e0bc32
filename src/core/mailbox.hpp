#pragma once
// The actor's mailbox: a lock-free multi-producer queue of requests, bounded
// by the cache's max_pending, with an intrusive FIFO of requests waiting for
// room.
//
// Invariants (mutex_ guards waiting_head_/waiting_tail_ and every change of
// waiting_count_):
// - queued_ counts places held in queue_: a request holds one before it
//   is enqueued (a carried request holds one too) and the drain releases one
//   per request it dequeues, so a bounded queue_ never holds more than
//   max_pending_ requests and its memory stays bounded by them. An unbounded
//   mailbox (max_pending_ = SIZE_MAX) is the same code with a bound it never
//   reaches: it never parks.
// - waiting_count_ is the length of the waiting list. While it is non-zero,
//   every new request parks behind the waiting ones. Read without the lock
//   it may be stale: a stale 0 only sends a request to try_hold_place(), which
//   is exact, and a drain that misses a park is followed by another, as the
//   parked request is counted in the actor's pending_.
// - Order: per thread, a queued request precedes any request parked after
//   it. take() hands out parked requests only when, under mutex_, queued_ is
//   zero: every request that held a place before a park the take can see
//   has then been dequeued already, into this batch or an earlier one.
//   moodycamel's ConcurrentQueue keeps each producer thread's items in FIFO
//   order; with the above, requests initiated from one thread apply in the
//   order they were initiated.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include "ghostlink/detail/flavour.hpp"

#include "core/concurrent_queue.hpp"
#include "ghostlink/detail/layer_interface.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// moodycamel's allocation hooks, counting the bytes every mailbox holds.
struct mailbox_traits : moodycamel::ConcurrentQueueDefaultTraits {
  static void* malloc(std::size_t size);
  static void free(void* p);
};

class mailbox {
 public:
  explicit mailbox(std::size_t max_pending) noexcept : max_pending_(max_pending) {}
  mailbox(const mailbox&) = delete;
  mailbox& operator=(const mailbox&) = delete;

  /// Queues `r` if there is room and nothing waits, else parks it (which
  /// allocates nothing). False, with `r` neither queued nor parked, if the
  /// queue could not grow.
  bool push(request* r) noexcept;
  /// Takes up to `n` requests into `out`, queued ones first; returns how
  /// many. One thread at a time (the actor's strand).
  std::size_t take(request** out, std::size_t n) noexcept;

  // A request may bypass the queue when the actor is idle: the drain it
  // schedules carries it (see actor.hpp). It holds a place as if queued
  // (so bounds, order and queued() are as for a queued request) from
  // hold_carried_place() until release_carried() or enqueue_carried().

  /// Sets aside a place for a carried request; false (nothing set aside)
  /// when it must queue or park instead: the mailbox holds a request (a
  /// place is held or one waits for room), so an earlier request of this
  /// thread may still be in it.
  bool hold_carried_place() noexcept;
  /// The drain took its carried request (or discarded it): frees the place.
  void release_carried() noexcept;
  /// Queues a request whose place hold_carried_place() set aside, the drain it
  /// was to ride not being scheduled; as push() otherwise.
  bool enqueue_carried(request* r) noexcept;

  /// Requests in the queue now.
  std::size_t queued() const noexcept;
  /// Requests waiting for room now.
  std::size_t waiting() const noexcept { return waiting_count_.load(std::memory_order_relaxed); }
  /// Requests that ever had to wait for room.
  std::uint64_t delayed() const noexcept { return delayed_.load(std::memory_order_relaxed); }
  /// Bytes the mailboxes of every cache in the process hold (see testing/hooks.hpp).
  static std::uint64_t bytes_allocated() noexcept;

 private:
  bool try_hold_place() noexcept;
  bool enqueue_held(request* r) noexcept;
  void park(request* r) noexcept;  // mutex_ held

  const std::size_t max_pending_;
  moodycamel::ConcurrentQueue<request*, mailbox_traits> queue_;
  std::atomic<std::size_t> queued_{0};
  std::mutex mutex_;
  request* waiting_head_ = nullptr;
  request* waiting_tail_ = nullptr;
  std::atomic<std::size_t> waiting_count_{0};
  std::atomic<std::uint64_t> delayed_{0};
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
