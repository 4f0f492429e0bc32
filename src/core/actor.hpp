#pragma once
// The actor behind a layer_kv_cache and behind a sequence: a mailbox of
// requests drained on a strand, the working states of its layers (one for
// a layer cache; a sequence's model layers and its token ids), and the
// cells readers pin epochs from. The templates reach it through
// detail/layer_interface.hpp and detail/sequence_interface.hpp.
//
// Threads:
// - submit(), pin(), size(), stats() are safe from any thread at any time.
// - drain() runs on strand_, or inside submit() for a request of urgency
//   `here` that finds the actor idle; either way one drain runs at a time
//   (pending_, below), and it alone touches the working states and
//   publishes into the cells. Consecutive drains are ordered by pending_'s
//   acq_rel updates: the drain's final decrement, then the next submitter's
//   raise from zero (or the deferred drain the strand runs).
// - A drain's completions are queued last, after its decrement of pending_
//   and its release of the actor: a completion may let the user destroy the
//   cache and then its execution context at once, while the drain's thread
//   (maybe outside the context, see schedule()) is still returning.
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
//
// Invariants of a group (more than one layer):
// - Every request applies to every layer or to none (apply_all): what can
//   fail (blocks, table memory, epochs) is taken for every layer first, and
//   a layer that fails after others applied is impossible by construction
//   (see each request kind in actor.cpp).
// - group_ holds, after every drain that published, the latest epoch of
//   every layer: one state in which every layer shows the same tokens. A
//   layer's own cell may run ahead of group_ only inside a drain.
// - A step's epochs (begin_step) are staged: built by the begin's drain,
//   held by the step, in no cell until its commit's drain publishes them.
//   No other request reaches the group meanwhile (the sequence is busy).

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

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
class actor;

/// One layer of an actor: its working state and the cell its readers pin.
struct layer_slot {
  explicit layer_slot(std::unique_ptr<working_state> s);
  ~layer_slot();
  layer_slot(const layer_slot&) = delete;
  layer_slot& operator=(const layer_slot&) = delete;

  const std::unique_ptr<working_state> state;  // strand only
  const ref_ptr<epoch_registry> registry;
  const std::uint64_t id;  // the cache id its blocks and events carry
  ref_ptr<epoch> latest;   // strand only: what `current` holds (a group's layers; null for a lone layer)
  ref_ptr<epoch> staged;   // strand only: to publish at the end of this drain (a step's commit)
  epoch_cell current;
  std::atomic<std::size_t> published_size{0};
};

/// A request to a group that carries epochs: a step's begin stages one per
/// layer into `staged`, and its commit publishes those in `staged`.
class group_request : public request {
 public:
  std::vector<ref_ptr<epoch>> staged;

 protected:
  using request::request;
  ~group_request() = default;
};

/// Told what a sequence's drains store: a prefix cache tracking the
/// sequence (src/prefix/track.cpp). Called inside the drain, on whatever
/// thread runs it, one call at a time.
class fill_observer {
 public:
  virtual ~fill_observer() = default;
  /// Every layer stores `size` tokens, and no window has dropped what a
  /// token at `size` no longer attends yet: `group.working(l)` shows them.
  virtual void filled(const actor& group, std::size_t size) noexcept = 0;
  /// The sequence was cut to `size` tokens.
  virtual void truncated(std::size_t size) noexcept = 0;
};

class actor : public std::enable_shared_from_this<actor> {
 public:
  using strand_type = asio::strand<asio::any_io_executor>;

  /// A layer cache: see make_actor() (detail/layer_interface.hpp); `pool`
  /// null for a private one. `prefix`: blocks of another cache the new one
  /// starts with (an attach), moved from.
  static std::shared_ptr<actor> make(asio::any_io_executor ex, const kv_cache_config& config, element_codec codec,
                                     ref_ptr<block_pool> pool, bool initialized, std::span<ref_ptr<block>> prefix = {});

  /// Use make(), or pass a group's working states (a sequence's, made in
  /// src/sequence); public for std::make_shared. Publishes each state's
  /// initial epoch.
  actor(asio::any_io_executor ex, std::vector<std::unique_ptr<working_state>> states);
  /// Discards requests still in the mailbox (their handlers are destroyed
  /// unrun); only reached when no drain is queued.
  ~actor();
  /// Destroys every request in the mailbox with its handler unrun. Called
  /// when the execution context destroys a queued drain unrun: the handlers
  /// may hold handles to this cache, a cycle only this breaks.
  void discard_mailbox() noexcept;
  actor(const actor&) = delete;
  actor& operator=(const actor&) = delete;

  /// The first layer's config.
  const kv_cache_config& config() const noexcept { return config_; }
  std::size_t layers() const noexcept { return layers_.size(); }
  /// See working_state::use_account: before the first request only.
  void use_account(std::size_t layer, ref_ptr<block_account> account) noexcept;
  /// A sequence's windows: truncates may take back `rollback` tokens below
  /// the high-water mark (see kv_model_layout), which starts at the first
  /// layer's size. Before the first request only; the layers' windows are
  /// their working states' (working_state::use_layer_layout).
  void use_rollback(std::size_t rollback) noexcept;
  /// Reports what later drains store to `o` (null: to none), from the next
  /// drain on. Any thread.
  void observe(std::shared_ptr<fill_observer> o) noexcept;
  /// Layer `layer`'s working state: inside a drain only (a fill_observer's).
  const working_state& working(std::size_t layer) const noexcept { return *layers_[layer]->state; }
  /// The first layer's pool (a sequence's model layers share it).
  block_pool& pool() const noexcept { return *pool_; }
  const strand_type& strand() const noexcept { return strand_; }
  /// Where a handler without an associated executor completes: the
  /// executor the cache was made from, not the strand.
  const asio::any_io_executor& executor() const noexcept { return executor_; }

  std::size_t size(std::size_t layer) const noexcept {
    return layers_[layer]->published_size.load(std::memory_order_acquire);
  }
  ref_ptr<epoch> pin(std::size_t layer) const noexcept { return layers_[layer]->current.pin(); }
  /// A group's latest state, every layer in it (null for one layer).
  ref_ptr<group_epoch> pin_group() const noexcept { return group_ ? group_->pin() : ref_ptr<group_epoch>(); }
  kv_cache_stats stats(std::size_t layer) const noexcept;

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
  /// schedule() from a thread outside the executor's context: the drain
  /// goes through the executor (then onto the strand), counted in posting_.
  void post_from_outside(request* carried) noexcept;
  /// Applies `carried` (if not null), then what the mailbox holds, and
  /// publishes; queues the completions `how` (never defer inside an
  /// initiating call: its caller may block the thread, and a deferred
  /// handler would wait behind it). `self` (this actor) is released before
  /// the first completion is queued: nothing of the actor is touched after.
  void drain(std::shared_ptr<actor> self, request* carried, queueing how);
  /// Applies `n` requests, constructing their results in `results` (raw
  /// storage for n); if the next epochs cannot be prepared, applies none
  /// and fails each with capacity_exhausted.
  void apply(request* const* batch, error_code* results, std::size_t n);
  /// Applies one claimed request to every layer: the one place a request's
  /// kind decides what happens.
  error_code apply(request& r);
  /// Sets aside every layer's blocks for `tokens` tokens at `index` (the
  /// layers' common size), then opens those positions in every layer; on
  /// error no layer changed.
  error_code open_all(std::size_t index, std::size_t tokens);
  /// A group's append: open_all(), then every layer stores its tokens.
  error_code append(const request& r);
  error_code truncate(std::size_t size);
  /// A fork: a new actor on a new strand of the same executor, whose first
  /// epochs are the working states, sharing their blocks; into `r.forked`.
  error_code fork(request& r) noexcept;
  error_code begin_step(group_request& r);
  /// The least high-water mark for a sequence of `size` tokens whose
  /// windowed layers hold what they hold now: `size`, or more where a
  /// window dropped a position that a truncate within rollback_ of a lower
  /// mark would need.
  std::size_t least_high_water(std::size_t size) const noexcept;
  /// The sequence now holds `size` tokens: raises the high-water mark, and
  /// each windowed layer drops what no later token attends.
  void advance(std::size_t size) noexcept;
  /// Publishes what changed in every layer (and the group's state).
  void publish();

  const kv_cache_config config_;
  const asio::any_io_executor executor_;
  const strand_type strand_;
  const std::unique_ptr<mailbox> mailbox_;
  const std::vector<std::unique_ptr<layer_slot>> layers_;
  const ref_ptr<block_pool> pool_;
  const std::unique_ptr<group_cell> group_;  // more than one layer only
  std::unique_ptr<group_epoch> next_group_;  // strand only: the next group state's memory, prepared
  // Strand only: the high-water mark h and the rollback of a sequence's
  // windows (kv_model_layout); 0 for a layer cache, whose truncates ignore them.
  std::size_t high_water_ = 0;
  std::size_t rollback_ = 0;
  // The observer of a tracked sequence: set from any thread under its mutex,
  // read by the drain (observed_ first, so an untracked drain takes no lock).
  /// The observer now (under its mutex).
  std::shared_ptr<fill_observer> observed() const noexcept;
  mutable std::mutex observer_mutex_;
  std::shared_ptr<fill_observer> observer_;
  std::atomic<bool> observed_{false};
  std::atomic<std::int64_t> pending_{0};  // enqueued and not yet drained; may dip below 0 briefly
  std::atomic<unsigned> posting_{0};      // submitters outside the context inside their post (post_from_outside)
  // Counters the drain alone writes (on the strand); stats() reads them.
  std::atomic<std::uint64_t> drains_{0};
  std::atomic<std::uint64_t> applied_{0};
  std::atomic<std::uint64_t> failed_{0};
  std::atomic<std::uint64_t> cancelled_{0};
  std::array<std::atomic<std::uint64_t>, kv_cache_stats::drain_histogram{}.size()> drain_sizes_{};
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
