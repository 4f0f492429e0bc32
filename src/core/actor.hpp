#pragma once
// The actor behind a layer_kv_cache: a mailbox of requests drained on a
// strand, the working state they are applied to, and the cell readers pin
// epochs from. The templates reach it through detail/layer_interface.hpp.
//
// Threads:
// - submit(), pin(), size(), stats() are safe from any thread at any time.
// - drain() runs only on strand_; it alone touches *state_ and publishes
//   into current_.
// - A request enqueued (queued or parked for room, see mailbox.hpp) is
//   counted in pending_ afterwards; whoever raises pending_ from zero
//   schedules a drain, and a drain that leaves work behind defers the next,
//   so one drain is queued or running while requests wait. pending_ may dip
//   below zero for an instant: a drain took a request whose submitter has
//   not counted it yet. A submitter that finds the count negative schedules
//   nothing; the late submitter's own count then brings pending_ up from
//   zero and schedules the drain that takes whatever was enqueued meanwhile.
// - Carried requests: a submitter that finds the mailbox empty (it takes
//   the first place, mailbox::hold_carried_place) and raises pending_ from zero
//   to one by CAS hands its request to the drain it schedules instead of
//   the queue. The drain applies it first: every earlier request of the
//   same thread left the mailbox before, taken by a drain that the strand
//   runs before this one. (pending_ at zero alone would not do: while it is
//   one short, an earlier request of this thread may wait in the mailbox.)
//   Other threads' requests enqueued meanwhile are concurrent with it and
//   drain after it.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "ghostlink/detail/asio_config.hpp"

#include "core/epoch_cell.hpp"
#include "ghostlink/config.hpp"
#include "ghostlink/detail/layer_interface.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/stats.hpp"
#include "memory/block.hpp"
#include "memory/block_pool.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class working_state;
class mailbox;

class actor : public std::enable_shared_from_this<actor> {
 public:
  using strand_type = asio::strand<asio::any_io_executor>;

  /// See make_actor() (detail/layer_interface.hpp); `pool` null for a private one.
  /// `prefix`: blocks of another cache the new one starts with (an attach),
  /// moved from.
  static std::shared_ptr<actor> make(asio::any_io_executor ex, const kv_cache_config& config, element_codec codec,
                                     ref_ptr<block_pool> pool, bool initialized, std::span<ref_ptr<block>> prefix = {});

  /// Use make(); public for std::make_shared. Publishes `state`'s initial epoch.
  actor(asio::any_io_executor ex, std::unique_ptr<working_state> state);
  /// Discards requests still in the mailbox (their handlers are destroyed
  /// unrun); only reached when no drain is queued.
  ~actor();
  /// Destroys every request in the mailbox with its handler unrun. Called
  /// when the execution context destroys a queued drain unrun: the handlers
  /// may hold handles to this cache, a cycle only this breaks.
  void discard_mailbox() noexcept;
  actor(const actor&) = delete;
  actor& operator=(const actor&) = delete;

  const kv_cache_config& config() const noexcept { return config_; }
  /// See working_state::use_account: before the first request only.
  void use_account(ref_ptr<block_account> account) noexcept;
  block_pool& pool() const noexcept { return *pool_; }
  const strand_type& strand() const noexcept { return strand_; }
  /// Where a handler without an associated executor completes: the
  /// executor the cache was made from, not the strand.
  const asio::any_io_executor& executor() const noexcept { return executor_; }

  std::size_t size() const noexcept { return published_size_.load(std::memory_order_acquire); }
  ref_ptr<epoch> pin() const noexcept { return current_.pin(); }
  kv_cache_stats stats() const noexcept;

  /// Takes ownership of `r`; it completes after the epoch that holds its
  /// result is published, never inline. Terminates if Asio cannot allocate
  /// to schedule the drain (the request is then already in the mailbox and
  /// could be neither withdrawn nor run).
  void submit(request* r, urgency u) noexcept;

 private:
  friend class drain_op;
  /// Queues a drain on the strand (dispatched when `u` is now), carrying
  /// `carried` if not null.
  void schedule(urgency u, request* carried) noexcept;
  /// Applies `carried` (if not null), then what the mailbox holds, and
  /// publishes.
  void drain(request* carried);
  /// Applies `n` requests, constructing their results in `results` (raw
  /// storage for n); if the next epoch cannot be prepared, applies none and
  /// fails each with capacity_exhausted.
  void apply(request* const* batch, error_code* results, std::size_t n);
  /// Applies one claimed request: the one place a request's kind decides
  /// what happens.
  error_code apply(request& r);
  /// A fork: a new actor on a new strand of the same executor, whose first
  /// epoch is the working state, sharing its blocks; into `r.forked`.
  error_code fork(request& r) noexcept;

  const kv_cache_config config_;
  const asio::any_io_executor executor_;
  const strand_type strand_;
  const std::unique_ptr<mailbox> mailbox_;
  const std::unique_ptr<working_state> state_;  // strand only
  const ref_ptr<block_pool> pool_;
  epoch_cell current_;
  std::atomic<std::size_t> published_size_{0};
  std::atomic<std::int64_t> pending_{0};  // enqueued and not yet drained; may dip below 0 briefly
  // Counters the drain alone writes (on the strand); stats() reads them.
  std::atomic<std::uint64_t> drains_{0};
  std::atomic<std::uint64_t> applied_{0};
  std::atomic<std::uint64_t> failed_{0};
  std::atomic<std::uint64_t> cancelled_{0};
  std::array<std::atomic<std::uint64_t>, kv_cache_stats::drain_histogram{}.size()> drain_sizes_{};
  const ref_ptr<epoch_registry> registry_;
  const std::uint64_t id_;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
