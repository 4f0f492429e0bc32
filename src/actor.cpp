#include "ghostlink/detail/actor.hpp"

#include <array>
#include <exception>

#include <asio/defer.hpp>
#include <asio/dispatch.hpp>
#include <asio/post.hpp>

#include "ghostlink/error.hpp"
#include "mailbox.hpp"
#include "page_writer.hpp"

namespace ghostlink::detail {
namespace {

// Requests one drain takes before it publishes: large enough to commit a
// burst of writers as one epoch, small enough to keep a drain short.
constexpr std::size_t drain_capacity = 128;

ref_ptr<block_pool> make_pool(const kv_cache_config& config) {
  validate(config);
  return ref_ptr<block_pool>::adopt(new block_pool(config.token_width(), config.block_tokens, config.max_blocks));
}

}  // namespace

/// A drain queued on the strand. Run, it drains; destroyed unrun (the
/// execution context shut down with it queued), it discards the mailbox.
class drain_op {
 public:
  explicit drain_op(std::shared_ptr<actor> a) noexcept : actor_(std::move(a)) {}
  drain_op(drain_op&&) noexcept = default;
  drain_op& operator=(drain_op&&) = delete;
  ~drain_op() {
    if (actor_) actor_->discard_mailbox();
  }
  void operator()() {
    const std::shared_ptr<actor> a = std::move(actor_);
    a->drain();
  }

 private:
  std::shared_ptr<actor> actor_;
};

actor::actor(asio::any_io_executor ex, const kv_cache_config& config)
    : config_(config),
      executor_(std::move(ex)),
      strand_(asio::make_strand(executor_)),
      pool_(make_pool(config_)),
      mailbox_(std::make_unique<mailbox>()),
      writer_(std::make_unique<page_writer>(config_, pool_)),
      current_(writer_->initial_epoch()) {}

actor::~actor() { discard_mailbox(); }

void actor::discard_mailbox() noexcept {
  request* r = nullptr;
  while (mailbox_->queue.try_dequeue(r)) r->discard();
}

void actor::submit(request* r, urgency u) noexcept {
  if (!mailbox_->queue.enqueue(r)) {
    r->complete(kv_errc::capacity_exhausted, queueing::post);  // the mailbox could not grow
    return;
  }
  if (pending_.fetch_add(1, std::memory_order_acq_rel) != 0) return;  // a drain is queued or running
  if (u == urgency::now)
    asio::dispatch(strand_, drain_op(shared_from_this()));
  else
    asio::post(strand_, drain_op(shared_from_this()));
}

void actor::apply(request* const* batch, std::error_code* results, std::size_t n) {
  try {
    writer_->reserve_epoch();
  } catch (const std::bad_alloc&) {
    for (std::size_t i = 0; i < n; ++i) results[i] = kv_errc::capacity_exhausted;
    return;
  }
  for (std::size_t i = 0; i < n; ++i) results[i] = writer_->apply(*batch[i]);
}

void actor::drain() {
  std::array<request*, drain_capacity> batch;
  std::array<std::error_code, drain_capacity> results;
  const std::size_t n = mailbox_->queue.try_dequeue_bulk(batch.begin(), batch.size());

  apply(batch.data(), results.data(), n);
  if (writer_->has_changes()) {
    current_.publish(writer_->publish());
    published_length_.store(writer_->length(), std::memory_order_release);
  }
  std::uint64_t applied = 0;
  for (std::size_t i = 0; i < n; ++i) applied += results[i] ? 0 : 1;
  drains_.fetch_add(1, std::memory_order_relaxed);
  applied_.fetch_add(applied, std::memory_order_relaxed);
  failed_.fetch_add(n - applied, std::memory_order_relaxed);

  // Handlers are queued only now, after the epoch holding their results is
  // published: that is what makes read-your-writes hold. A completion that
  // throws (an executor that could not allocate) loses that one handler; the
  // rest of the drain and the mailbox's bookkeeping still happen, then the
  // first exception propagates out of the executor's run(), as in Asio.
  std::exception_ptr first_error;
  for (std::size_t i = 0; i < n; ++i) {
    try {
      batch[i]->complete(results[i], queueing::defer);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }

  const auto taken = static_cast<std::int64_t>(n);
  if (pending_.fetch_sub(taken, std::memory_order_acq_rel) - taken > 0)
    asio::defer(strand_, drain_op(shared_from_this()));  // runs right after this drain
  if (first_error) std::rethrow_exception(first_error);
}

kv_cache_stats actor::stats() const noexcept {
  kv_cache_stats s;
  ref_ptr<epoch> latest = pin();
  s.epoch = latest->number;
  s.size = latest->length;
  s.drains = drains_.load(std::memory_order_relaxed);
  s.requests_applied = applied_.load(std::memory_order_relaxed);
  s.requests_failed = failed_.load(std::memory_order_relaxed);
  s.blocks_in_use = pool_->blocks_in_use();
  s.bytes_in_use = s.blocks_in_use * 2 * pool_->floats_per_half() * sizeof(float);
  return s;
}

}  // namespace ghostlink::detail
