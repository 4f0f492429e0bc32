#include "core/actor.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <exception>
#include <new>
#include <ostream>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"
#include GHOSTLINK_ASIO_HEADER(io_context.hpp)
#include GHOSTLINK_ASIO_HEADER(thread_pool.hpp)

#include "base/fault_countdown.hpp"
#include "base/throw_errc.hpp"
#include "core/mailbox.hpp"
#include "core/working_state.hpp"
#include "ghostlink/block_pool.hpp"
#include "ghostlink/error.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

// Requests one drain takes before it publishes: large enough to commit a
// burst of writers as one epoch, small enough to keep a drain short.
constexpr std::size_t drain_capacity = 128;
static_assert(std::is_trivially_destructible_v<error_code>, "a drain's results are never destroyed");

/// Adds to a counter only the drain writes (one writer: a load and a store,
/// no read-modify-write); stats() reads it from any thread.
void add(std::atomic<std::uint64_t>& counter, std::uint64_t n) noexcept {
  counter.store(counter.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
}

/// The pool a new cache of `layout` takes blocks from: `pool`, checked
/// against it, or a private one.
ref_ptr<block_pool> pool_for(const kv_cache_config& config, const block_layout& layout, ref_ptr<block_pool> pool) {
  if (!pool) return ref_ptr<block_pool>::adopt(new block_pool(layout.block_bytes, config.max_blocks));
  if (!layout.fits(*pool) || config.max_blocks != kv_cache_config{}.max_blocks) throw_errc(kv_errc::invalid_config);
  return pool;
}

}  // namespace

/// A drain queued on the strand, maybe carrying the request that scheduled
/// it (see actor.hpp). Run, it drains; destroyed unrun (the execution
/// context shut down with it queued), it discards its request and the
/// mailbox.
class drain_op {
 public:
  drain_op(std::shared_ptr<actor> a, request* carried, queueing how = queueing::defer) noexcept
      : actor_(std::move(a)), carried_(carried), how_(how) {}
  drain_op(drain_op&& other) noexcept
      : actor_(std::move(other.actor_)), carried_(std::exchange(other.carried_, nullptr)), how_(other.how_) {}
  drain_op& operator=(drain_op&&) = delete;
  ~drain_op() {
    if (!actor_) return;
    if (carried_) {
      actor_->mailbox_->release_carried();
      carried_->discard();
    }
    actor_->discard_mailbox();
  }
  void operator()() {
    actor* const a = actor_.get();
    a->drain(std::move(actor_), std::exchange(carried_, nullptr), how_);
  }
  const actor::strand_type& strand() const noexcept { return actor_->strand_; }

 private:
  std::shared_ptr<actor> actor_;
  request* carried_;
  queueing how_;  // how its completions are queued: defer on the strand, post inside an initiating call
};

std::shared_ptr<actor> actor::make(asio::any_io_executor ex, const kv_cache_config& config, element_codec codec,
                                   ref_ptr<block_pool> pool, bool initialized, std::span<ref_ptr<block>> prefix) {
  validate(config, codec);
  auto layout = ref_ptr<const block_layout>::adopt(new block_layout(config, codec));
  ref_ptr<block_pool> checked = pool_for(config, *layout, std::move(pool));
  std::vector<std::unique_ptr<working_state>> states;
  states.push_back(std::make_unique<working_state>(config, std::move(layout), std::move(checked), initialized, prefix));
  return std::make_shared<actor>(std::move(ex), std::move(states));
}

layer_slot::layer_slot(std::unique_ptr<working_state> s)
    : state(std::move(s)),
      registry(state->registry()),
      id(state->owner()),
      latest(state->initial_epoch()),
      current(latest),
      published_size(state->size()) {}

layer_slot::~layer_slot() = default;

namespace {

std::vector<std::unique_ptr<layer_slot>> slots_of(std::vector<std::unique_ptr<working_state>> states) {
  std::vector<std::unique_ptr<layer_slot>> slots;
  slots.reserve(states.size());
  for (auto& s : states) slots.push_back(std::make_unique<layer_slot>(std::move(s)));
  return slots;
}

}  // namespace

actor::actor(asio::any_io_executor ex, std::vector<std::unique_ptr<working_state>> states)
    : config_(states.front()->config()),
      executor_(std::move(ex)),
      strand_(asio::make_strand(executor_)),
      mailbox_(std::make_unique<mailbox>(config_.max_pending)),
      layers_(slots_of(std::move(states))),
      pool_(layers_.front()->state->pool()),
      group_(layers_.size() > 1 ? std::make_unique<group_cell>(ref_ptr<group_epoch>::adopt(new group_epoch()))
                                : nullptr) {
  if (!group_) {
    layers_.front()->latest = {};  // a lone layer keeps no second reference to its latest epoch
    return;
  }
  // The first group state: every layer's initial epoch.
  ref_ptr<group_epoch> first = group_->pin();
  for (const auto& l : layers_) first->layers.push_back(l->latest);
}

actor::~actor() { discard_mailbox(); }

void actor::use_account(std::size_t layer, ref_ptr<block_account> account) noexcept {
  layers_[layer]->state->use_account(std::move(account));
}

void actor::use_rollback(std::size_t rollback) noexcept {
  rollback_ = rollback;
  high_water_ = least_high_water(layers_.front()->state->size());  // a loaded layer may have dropped some
}

std::size_t actor::least_high_water(std::size_t size) const noexcept {
  std::size_t h = size;
  for (const auto& l : layers_) {
    const kv_layer_layout& w = l->state->layer_layout();
    if (l->state->kept_from() > w.sink_tokens) h = std::max(h, l->state->kept_from() + w.window + rollback_ - 1);
  }
  return h;
}

void actor::observe(std::shared_ptr<fill_observer> o) noexcept {
  std::lock_guard lock(observer_mutex_);
  observed_.store(o != nullptr, std::memory_order_release);
  observer_ = std::move(o);
}

std::shared_ptr<fill_observer> actor::observed() const noexcept {
  std::lock_guard lock(observer_mutex_);
  return observer_;
}

void actor::advance(std::size_t size) noexcept {
  // Before any window drops: a tracked sequence's blocks are cached as
  // they fill (src/prefix/track.cpp).
  if (observed_.load(std::memory_order_acquire))
    if (const auto o = observed()) o->filled(*this, size);
  high_water_ = std::max(high_water_, size);
  for (const auto& l : layers_) {
    const std::size_t reach = l->state->layer_layout().window + rollback_;  // validated: no overflow
    if (high_water_ + 1 > reach) l->state->drop_before(high_water_ + 1 - reach);
  }
}

void actor::discard_mailbox() noexcept {
  std::array<request*, drain_capacity> batch{};
  while (const std::size_t n = mailbox_->take(batch.data(), batch.size()))
    for (std::size_t i = 0; i < n; ++i) batch[i]->discard();
}

void actor::submit(request* r, urgency u) noexcept {
  bool queued = false;
  if (pending_.load(std::memory_order_relaxed) == 0 && mailbox_->hold_carried_place()) {
    std::int64_t idle = 0;
    if (pending_.compare_exchange_strong(idle, 1, std::memory_order_acq_rel, std::memory_order_relaxed)) {
      schedule(u, r);  // no drain queued or running: the drain carries r
      return;
    }
    queued = mailbox_->enqueue_carried(r);
  } else {
    queued = mailbox_->push(r);
  }
  if (!queued) {
    r->complete(kv_errc::capacity_exhausted, queueing::post);  // the mailbox could not grow
    return;
  }
  if (void (*hook)() = enqueued_hook.load(std::memory_order_relaxed)) hook();  // tests only
  if (pending_.fetch_add(1, std::memory_order_acq_rel) != 0) return;  // a drain is queued or running
  schedule(u, nullptr);
}

namespace {

/// Takes a drain from the actor's executor onto its strand. A submitter on
/// a thread outside the executor's context hands the drain to the executor
/// alone (no strand, whose copies count references to its implementation):
/// once the drain is queued there, that thread touches nothing of the
/// context, so the drain's completions may let the user destroy the cache
/// and then the context while it is still returning.
struct to_strand {
  drain_op op;
  void operator()() {
    const actor::strand_type strand = op.strand();
    asio::dispatch(strand, std::move(op));
  }
};

/// True on a thread running `ex`'s context (a thread pool's or an
/// io_context's; false for any other executor): its context outlives what
/// that thread does, so it may queue onto the strand directly.
bool in_context(const asio::any_io_executor& ex) noexcept {
  if (const auto* pool = ex.target<asio::thread_pool::executor_type>()) return pool->running_in_this_thread();
  if (const auto* io = ex.target<asio::io_context::executor_type>()) return io->running_in_this_thread();
  return false;
}

}  // namespace

void actor::schedule(urgency u, request* carried) noexcept {
  switch (u) {
    case urgency::here: {
      // The drain may drop the last reference to this actor.
      asio::any_io_executor ex = executor_;
      try {
        drain_op(shared_from_this(), carried, queueing::post)();
      } catch (...) {
        // A completion that threw (see drain()): it leaves through the
        // executor's run(), as it would from a drain run there.
        asio::post(ex, [e = std::current_exception()] { std::rethrow_exception(e); });
      }
      return;
    }
    // On a thread of the executor's context, straight onto the strand (run
    // inline when it is idle, for `now`); from any other thread, through
    // the executor (see to_strand).
    case urgency::now:
      if (!in_context(executor_)) return post_from_outside(carried);
      asio::dispatch(strand_, drain_op(shared_from_this(), carried));
      return;
    case urgency::batch:
      if (!in_context(executor_)) return post_from_outside(carried);
      asio::post(strand_, drain_op(shared_from_this(), carried));
      return;
  }
}

void actor::post_from_outside(request* carried) noexcept {
  // Counted until the post has returned: the drain it queues waits for that
  // before it completes anything (drain()), so no completion can let the
  // user destroy the context while this thread is still in its scheduler
  // (which signals a waiting thread after it has queued the drain).
  posting_.fetch_add(1, std::memory_order_relaxed);
  asio::post(executor_, to_strand{drain_op(shared_from_this(), carried)});
  posting_.fetch_sub(1, std::memory_order_release);  // the drain holds this actor until it has seen it
}

void actor::apply(request* const* batch, error_code* results, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    error_code ec;
    try {
      // A request applies only with the next epochs' memory at hand, so
      // that publishing what it changed cannot fail.
      for (const auto& l : layers_) l->state->prepare_epoch();
      if (group_ && !next_group_) {
        next_group_ = std::make_unique<group_epoch>();
        next_group_->layers.reserve(layers_.size());
      }
    } catch (const std::bad_alloc&) {
      ec = kv_errc::capacity_exhausted;
    }
    if (!ec) ec = batch[i]->claim() ? apply(*batch[i]) : error_code(asio::error::operation_aborted);
    ::new (results + i) error_code(ec);
  }
}

error_code actor::apply(request& r) {
  switch (r.kind()) {
    case request_kind::initialize:
      for (const auto& l : layers_)
        if (error_code ec = l->state->initialize(r.size())) return ec;  // one layer: a layer cache's
      return {};
    case request_kind::write_batch: return layers_.front()->state->write(r.writes());  // a layer cache's
    case request_kind::append: return append(r);
    case request_kind::truncate: return truncate(r.size());
    case request_kind::fork: return fork(r);
    case request_kind::begin_step: return begin_step(static_cast<group_request&>(r));
    case request_kind::commit_step: {
      auto& g = static_cast<group_request&>(r);
      for (std::size_t l = 0; l < layers_.size(); ++l) layers_[l]->staged = std::move(g.staged[l]);
      // The step's epochs showed every token of it; a windowed layer drops
      // now what no later token attends, in an epoch after the staged one.
      advance(layers_.front()->state->size());
      for (const auto& l : layers_)
        if (l->state->has_changes()) l->staged = l->state->publish();  // memory prepared by apply()
      return {};
    }
  }
  return {};
}

error_code actor::open_all(std::size_t index, std::size_t tokens) {
  // Every layer's blocks first, so that no open fails for want of one; an
  // open can then fail only for page-table memory, and the layers opened
  // before it are cut back without copying anything.
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    if (error_code ec = layers_[l]->state->set_aside(index, tokens)) {
      for (std::size_t k = 0; k < l; ++k) layers_[k]->state->release_set_aside();
      return ec;
    }
  }
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    if (error_code ec = layers_[l]->state->open(index, tokens)) {
      // Opened in this drain: their tables and chunks are this epoch's, so
      // cutting them back copies nothing and cannot fail.
      for (std::size_t k = 0; k < l; ++k) layers_[k]->state->cut(index);
      for (std::size_t k = l; k < layers_.size(); ++k) layers_[k]->state->release_set_aside();
      return ec;
    }
  }
  return {};
}

error_code actor::append(const request& r) {
  const std::span<const kv_write> writes = r.writes();  // one per layer
  const std::size_t index = writes.front().index;
  if (error_code ec = open_all(index, r.tokens())) return ec;
  for (std::size_t l = 0; l < layers_.size(); ++l) layers_[l]->state->store(index, writes[l].keys, writes[l].values);
  advance(index + r.tokens());
  return {};
}

error_code actor::truncate(std::size_t size) {
  // Below h - rollback, a window may have dropped what the next token needs.
  const bool rewinds = high_water_ > rollback_ && size < high_water_ - rollback_;
  for (const auto& l : layers_)
    if (rewinds && !l->state->can_truncate(size)) return kv_errc::outside_window;
  for (const auto& l : layers_)
    if (error_code ec = l->state->prepare_truncate(size)) return ec;  // changes nothing visible
  for (const auto& l : layers_) l->state->cut(size);
  // h becomes the size, or more where a window dropped positions that a
  // later truncate within rollback_tokens of it would need: every truncate
  // to h - rollback or more must then still find its window.
  if (rewinds) high_water_ = least_high_water(size);
  if (observed_.load(std::memory_order_acquire))
    if (const auto o = observed()) o->truncated(size);
  return {};
}

error_code actor::fork(request& r) noexcept {
  if (error_code ec = truncate(r.size())) return ec;  // a sequence's step positions its end could not cut
  try {
    std::vector<std::unique_ptr<working_state>> children;
    children.reserve(layers_.size());
    for (const auto& l : layers_) children.push_back(l->state->fork());
    r.forked = std::make_shared<actor>(executor_, std::move(children));
    r.forked->high_water_ = high_water_;
    r.forked->rollback_ = rollback_;
    return {};
  } catch (const std::bad_alloc&) {
    return kv_errc::capacity_exhausted;  // the layers forked so far go with `children`
  }
}

error_code actor::begin_step(group_request& r) {
  // Every layer opens the step's positions; the last (the token ids) takes
  // its tokens at once, the model's layers take theirs from the step's
  // writers. Then every layer's epoch is staged for the step, in the
  // memory prepared for this request.
  const std::size_t index = r.size();
  try {
    r.staged.reserve(layers_.size());
  } catch (const std::bad_alloc&) {
    return kv_errc::capacity_exhausted;
  }
  if (error_code ec = open_all(index, r.tokens())) return ec;
  const kv_write& ids = r.writes().front();
  layers_.back()->state->store(index, ids.keys, ids.values);
  for (const auto& l : layers_) r.staged.push_back(l->state->publish());
  return {};
}

void actor::publish() {
  bool any = false;
  for (const auto& l : layers_) {
    ref_ptr<epoch> next = std::move(l->staged);
    if (!next && l->state->has_changes()) next = l->state->publish();
    if (!next) continue;
    const kv_event event{
        .what = kv_event::kind::epoch_published, .cache = l->id, .epoch = next->number, .size = next->size};
    const std::size_t size = next->size;
    if (group_) l->latest = next;  // what the group's next state holds
    l->current.publish(std::move(next));
    l->published_size.store(size, std::memory_order_release);
    pool_->emit(event);
    any = true;
  }
  if (!any || !group_) return;
  // next_group_ was prepared before the request that changed a layer.
  auto next = ref_ptr<group_epoch>::adopt(next_group_.release());
  for (const auto& l : layers_) next->layers.push_back(l->latest);
  group_->publish(std::move(next));
}

void actor::drain(std::shared_ptr<actor> self, request* carried, queueing how) {
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): the first n are filled, the rest is never read
  std::array<request*, drain_capacity> batch;
  // Raw storage: apply() constructs the first n results (filling all of
  // them each drain cost more than applying a one-token write).
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): as above
  alignas(error_code) std::array<std::byte, drain_capacity * sizeof(error_code)> raw_results;
  error_code* const results = reinterpret_cast<error_code*>(raw_results.data());
  std::size_t n = 0;
  if (carried) {
    mailbox_->release_carried();
    batch[n++] = carried;
  }
  // Requests counted in pending_ beyond the carried one are in the mailbox;
  // with none, skip it: one enqueued and not yet counted brings pending_
  // up from zero afterwards (or finds it above zero, so that this drain
  // defers the next) and is drained then.
  if (!carried || pending_.load(std::memory_order_acquire) > 1) n += mailbox_->take(batch.data() + n, batch.size() - n);

  apply(batch.data(), results, n);
  publish();
  std::uint64_t applied = 0, cancelled = 0;
  for (std::size_t i = 0; i < n; ++i) {
    applied += results[i] ? 0 : 1;
    cancelled += results[i] == asio::error::operation_aborted ? 1 : 0;
  }
  add(drains_, 1);
  if (n > 0) add(drain_sizes_[std::min<std::size_t>(std::bit_width(n) - 1, drain_sizes_.size() - 1)], 1);
  add(applied_, applied);
  if (n != applied) {
    add(failed_, n - applied - cancelled);
    add(cancelled_, cancelled);
  }

  const auto taken = static_cast<std::int64_t>(n);
  if (pending_.fetch_sub(taken, std::memory_order_acq_rel) - taken > 0)
    asio::defer(strand_, drain_op(self, nullptr));  // runs right after this drain, on the strand
  // The last use of this actor: a completion may let its user destroy the
  // cache and then its execution context, so nothing of either is touched
  // once a handler is queued (this drain may run outside the context's
  // threads, see schedule()), and no submitter outside the context may
  // still be posting to it (post_from_outside: a few instructions). The
  // actor may be destroyed here.
  while (posting_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  self.reset();

  // Handlers are queued only now, after the epoch holding their results is
  // published: that is what makes read-your-writes hold. A completion that
  // throws (an executor that could not allocate) loses that one handler; the
  // rest still complete, then the first exception propagates out of the
  // executor's run(), as in Asio.
  std::exception_ptr first_error;
  for (std::size_t i = 0; i < n; ++i) {
    try {
      batch[i]->complete(results[i], how);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);
}

kv_cache_stats actor::stats(std::size_t layer) const noexcept {
  const layer_slot& l = *layers_[layer];
  kv_cache_stats s;
  ref_ptr<epoch> latest = l.current.pin();
  s.epoch = latest->number;
  s.size = latest->size;
  s.drains = drains_.load(std::memory_order_relaxed);
  s.requests_applied = applied_.load(std::memory_order_relaxed);
  s.requests_failed = failed_.load(std::memory_order_relaxed);
  s.requests_cancelled = cancelled_.load(std::memory_order_relaxed);
  s.requests_queued = mailbox_->queued();
  s.requests_waiting = mailbox_->waiting();
  s.requests_delayed = mailbox_->delayed();
  for (std::size_t i = 0; i < drain_sizes_.size(); ++i)
    s.requests_per_drain[i] = drain_sizes_[i].load(std::memory_order_relaxed);
  const epoch_registry::reading epochs = l.registry->read();
  s.epochs_alive = epochs.epochs_alive;
  s.oldest_epoch_alive = epochs.oldest;
  s.snapshots_alive = l.registry->snapshots();
  s.cache_id = l.id;
  s.blocks_in_use = pool_->blocks_in_use();
  s.bytes_in_use = s.blocks_in_use * pool_->payload_bytes();
  return s;
}

// The untyped interface of detail/layer_interface.hpp.

std::shared_ptr<actor> make_actor(asio::any_io_executor ex, const kv_cache_config& config, element_codec codec,
                                  const kv_block_pool* pool, bool initialized) {
  return actor::make(std::move(ex), config, codec, pool ? pool_access::state(*pool) : ref_ptr<block_pool>(),
                     initialized);
}
void submit(actor& a, request* r, urgency u) noexcept { a.submit(r, u); }
const asio::any_io_executor& io_executor(const actor& a) noexcept { return a.executor(); }
asio::strand<asio::any_io_executor> strand_of(const actor& a) noexcept { return a.strand(); }
const kv_cache_config& config_of(const actor& a) noexcept { return a.config(); }
std::size_t size_of(const actor& a, std::size_t layer) noexcept { return a.size(layer); }
pinned_epoch pin(const actor& a, std::size_t layer) noexcept { return epoch_access::pin(a.pin(layer)); }
kv_cache_stats stats_of(const actor& a, std::size_t layer) noexcept { return a.stats(layer); }
kv_block_pool pool_of(const actor& a) noexcept { return pool_access::handle(ref_ptr<block_pool>::share(&a.pool())); }
std::ostream& print(std::ostream& os, const actor& a, std::size_t layer) {
  return os << "layer_kv_cache{config=" << a.config() << ", size=" << a.size(layer) << '}';
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
