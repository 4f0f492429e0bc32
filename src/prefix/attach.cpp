// async_attach: a prefix cache's RAM hits, then the following blocks from
// its store (ghostlink/prefix_cache.hpp says what it promises).
//
// One attach_job per operation that reaches the store, shared by the
// store's callbacks and the deadline timer; everything in it is under
// mutex_. The store delivers values in any order, from its threads; the job
// takes them in block order: `next_` is the first block not yet attached,
// and each value arriving at `next_` is checked, copied into new blocks and
// appended, then any later ones already arrived. The first value that is
// missing, refused, or that the pool has no room for ends the match, as do
// the deadline and a cancellation; finish() then runs once, inserting what
// was fetched and completing the operation with the blocks so far.
//
// Lock order: mutex_, then the pool's and the prefix index's (a block
// allocation may evict; the insert). Nothing under those takes mutex_.

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <utility>
#include <vector>
#include "ghostlink/detail/asio_config.hpp"
#include GHOSTLINK_ASIO_HEADER(steady_timer.hpp)

#include "ghostlink/error.hpp"
#include "ghostlink/prefix_cache.hpp"
#include "io/file.hpp"
#include "memory/block.hpp"
#include "memory/block_pool.hpp"
#include "prefix/index.hpp"
#include "sequence/sequence.hpp"
#include "store/entry.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

/// Puts in `op` a sequence of `blocks`, the first `attached` blocks of
/// `tokens`; returns `ec`, or capacity_exhausted if memory is refused.
error_code make_result(const prefix_index& p, io_op* op, const asio::any_io_executor& ex, error_code ec,
                       std::vector<std::vector<ref_ptr<block>>> blocks, std::span<const token_id> tokens,
                       std::size_t attached) {
  try {
    op->loaded = attached_sequence(p, ex, std::move(blocks), tokens, attached);
  } catch (const std::bad_alloc&) {
    ec = kv_errc::capacity_exhausted;
  }
  return ec;
}

/// Blocks asked of the store at once: enough to keep its reads pipelined,
/// few enough that values arriving out of order hold little memory.
constexpr std::size_t fetch_window = 16;

class attach_job : public std::enable_shared_from_this<attach_job> {
 public:
  attach_job(std::shared_ptr<prefix_index> p, asio::any_io_executor ex, std::vector<token_id> tokens,
             std::vector<kv_block_hash> hashes, std::size_t in_ram, std::vector<std::vector<ref_ptr<block>>> blocks,
             io_op* op)
      : index_(std::move(p)),
        ex_(std::move(ex)),
        tokens_(std::move(tokens)),
        hashes_(std::move(hashes)),
        in_ram_(in_ram),
        next_(in_ram),
        window_start_(in_ram),
        geometry_(index_->geometry()),
        blocks_(std::move(blocks)),
        owner_(block_pool::new_owner_id()),
        op_(op) {}
  attach_job(const attach_job&) = delete;
  attach_job& operator=(const attach_job&) = delete;
  /// A store that let go of the job without answering (its context
  /// stopped, a connection dropped): the operation ends with what came.
  ~attach_job() {
    if (done_) return;
    try {
      finish({});
    } catch (...) {  // queueing the handler failed: it is gone, as with any completion that throws
    }
  }

  /// Arms the deadline and asks the store for the first window. Memory
  /// refused ends the operation with capacity_exhausted.
  void start(const kv_attach_options& options) {
    try {
      std::lock_guard lock(mutex_);
      if (!op_->claim()) {  // emitted before the job could be woken
        finish(asio::error::operation_aborted);
        return;
      }
      if (options.timeout) {
        timer_.emplace(ex_, *options.timeout);
        timer_->async_wait([self = shared_from_this()](const error_code& ec) {
          if (!ec) self->expire();
        });
      }
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!done_) finish(kv_errc::capacity_exhausted);
      return;
    }
    request(in_ram_);
  }

  const asio::any_io_executor& executor() const noexcept { return ex_; }

  /// The handler's slot was emitted: ends the operation, with what came.
  void cancel() {
    std::lock_guard lock(mutex_);
    if (!done_) finish(asio::error::operation_aborted);
  }

 private:
  /// Asks the store for the window of blocks from `start`. Not under
  /// mutex_: a store may answer inside fetch().
  void request(std::size_t start) {
    try {
      std::vector<kv_block_hash> wanted(hashes_.begin() + static_cast<std::ptrdiff_t>(start),
                                        hashes_.begin() + static_cast<std::ptrdiff_t>(window_end(start)));
      std::shared_ptr<kv_block_store> store;
      {
        std::lock_guard lock(mutex_);
        if (done_) return;
        store = index_->store();
      }
      store->fetch(std::move(wanted), [self = shared_from_this(), start](std::size_t i, std::vector<std::byte> bytes) {
        return self->deliver(start, i, std::move(bytes));
      });
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!done_) finish(kv_errc::capacity_exhausted);
    }
  }

  std::size_t window_end(std::size_t start) const noexcept { return std::min(start + fetch_window, hashes_.size()); }

  /// Value `i` of the window from `start`; false once no more of it are wanted.
  bool deliver(std::size_t start, std::size_t i, std::vector<std::byte> bytes) {
    // Checked before the lock: the store's threads check values in parallel.
    const bool asked = start + i < window_end(start);
    const bool rejected = asked && !bytes.empty() && !check_entry(geometry_, hashes_[start + i], bytes);
    if (rejected) bytes.clear();
    bool next_window = false;
    {
      std::lock_guard lock(mutex_);
      if (done_ || start != window_start_) return false;
      if (!op_->claim()) {
        finish(asio::error::operation_aborted);
        return false;
      }
      if (!asked || arrived_[i]) return true;  // not a value asked for: ignored
      arrived_[i] = std::move(bytes);
      rejected_[i] = rejected;
      while (!done_ && arrived_[next_ - window_start_]) {
        const std::size_t at = next_ - window_start_;
        const std::vector<std::byte> value =
            std::exchange(arrived_[at], std::nullopt).value_or(std::vector<std::byte>{});
        if (rejected_[at]) index_->count_store_reject();
        if (!attach_one(value) || ++next_ == hashes_.size()) {  // the match ends, or is whole
          finish({});
        } else if (next_ == window_end(window_start_)) {
          window_start_ = next_;
          arrived_ = {};
          rejected_ = {};
          next_window = true;
          break;
        }
      }
      if (done_) return false;
    }
    if (next_window) request(window_start_);
    return !next_window;
  }

  /// Appends block `next_`'s checked value in new blocks; false if the
  /// match ends here (no value, or no room).
  bool attach_one(std::span<const std::byte> value) noexcept {
    prefix_index& p = *index_;
    const entry_geometry& g = geometry_;
    if (value.empty()) {  // not there, or not valid: the store tier has it no more
      p.store_missed(hashes_[next_]);
      return false;
    }
    std::vector<ref_ptr<block>> fresh;
    try {
      fresh.reserve(g.num_layers);
      if (cursors_.empty()) {
        cursors_.reserve(g.num_layers);
        for (std::size_t l = 0; l < g.num_layers; ++l) cursors_.emplace_back(*p.pool());
      }
      for (std::size_t l = 0; l < g.num_layers; ++l) {
        const std::byte* const layer = entry_layer(g, value, l);
        if (!layer) {  // a windowed layer the entry holds no block for
          fresh.emplace_back();
          continue;
        }
        ref_ptr<block> b = block::make(*p.pool(), cursors_[l], owner_);
        if (!b) return false;  // the pool has no room: a miss from here on
        std::memcpy(b->keys(), layer, g.half_bytes());
        if (!g.keys_only) std::memcpy(b->values(), layer + g.half_bytes(), g.half_bytes());
        b->set_filled(g.block_tokens);
        fresh.push_back(std::move(b));
      }
      for (std::size_t l = 0; l < g.num_layers; ++l) blocks_[l].push_back(std::move(fresh[l]));
    } catch (const std::bad_alloc&) {
      return false;
    }
    return true;
  }

  void expire() {
    std::lock_guard lock(mutex_);
    if (!done_) finish(op_->claim() ? error_code() : error_code(asio::error::operation_aborted));
  }

  /// Ends the operation (under mutex_, once): the fetched entries go into
  /// the index, the handler gets the sequence, and the job lets go of the
  /// index (values still in flight only find it done).
  void finish(error_code ec) {
    done_ = true;
    if (timer_) timer_->cancel();
    {
      // Let go of before the handler can run: the index holds the pool,
      // which the caller may expect gone once it has let go of its own.
      const std::shared_ptr<prefix_index> p = std::move(index_);
      cursors_.clear();  // before the pool may go
      // The longest match over RAM's blocks and the fetched ones (a
      // fetched entry may lack a windowed layer's block); RAM's hold every
      // block the windows of a longer match need (they start later).
      const std::size_t matched =
          p->rule().longest(next_, [&](std::size_t l, std::size_t j) { return blocks_[l][j].get() != nullptr; });
      const std::size_t fetched = next_ - in_ram_;
      if (fetched != 0) {
        p->count_store_hits((std::max(matched, in_ram_) - in_ram_) * p->config().block_tokens);
        try {
          std::vector<std::vector<const block*>> per_block(fetched);
          for (std::size_t b = 0; b < fetched; ++b) {
            per_block[b].reserve(blocks_.size());
            for (const auto& layer : blocks_) per_block[b].push_back(layer[in_ram_ + b].get());
          }
          p->insert(std::span(hashes_).first(next_), tokens_, in_ram_, per_block, nullptr, nullptr, true);
        } catch (const std::bad_alloc&) {  // not cached for the next attach; this one has them
        }
      }
      ec = make_result(*p, op_, ex_, ec, std::move(blocks_), tokens_, std::max(matched, in_ram_));
    }
    op_->complete(ec, queueing::post);
  }

  std::mutex mutex_;
  std::shared_ptr<prefix_index> index_;  // null once done
  const asio::any_io_executor ex_;
  const std::vector<token_id> tokens_;
  const std::vector<kv_block_hash> hashes_;
  const std::size_t in_ram_;                         // blocks attached from RAM
  std::size_t next_;                                 // the first block not attached yet
  std::size_t window_start_;                         // the first block of the window asked of the store
  const entry_geometry geometry_;                    // of the entries, as the index's
  std::vector<std::vector<ref_ptr<block>>> blocks_;  // per layer, blocks [0, next_)
  std::vector<block_cursor> cursors_;                // per layer, once a block is fetched; none once done
  std::array<std::optional<std::vector<std::byte>>, fetch_window> arrived_{};  // the window's values not yet taken
  std::array<bool, fetch_window> rejected_{};  // arrived_[i] was a value that failed its checks
  const std::uint64_t owner_;  // of the blocks made here, which no one writes
  io_op* op_;
  std::optional<asio::steady_timer> timer_;
  bool done_ = false;
};

}  // namespace

/// Wakes an attach waiting on its store when its handler's slot is emitted.
class attach_wakeup {
 public:
  void attach(const std::shared_ptr<attach_job>& job) {
    std::lock_guard lock(mutex_);
    job_ = job;
  }
  void wake() noexcept {
    std::shared_ptr<attach_job> job;
    {
      std::lock_guard lock(mutex_);
      job = job_.lock();
    }
    if (!job) return;
    // Not inside the emit: the completion must not clear the slot while
    // its handler is still running.
    try {
      asio::post(job->executor(), [job] { job->cancel(); });
    } catch (...) {  // memory refused: the job sees the cancellation at its next value or deadline
    }
  }

 private:
  std::mutex mutex_;
  std::weak_ptr<attach_job> job_;
};

std::shared_ptr<attach_wakeup> make_attach_wakeup() { return std::make_shared<attach_wakeup>(); }
void wake(attach_wakeup& w) noexcept { w.wake(); }

void start_attach(const std::shared_ptr<prefix_index>& p, const asio::any_io_executor& ex,
                  std::span<const token_id> tokens, std::string_view salt, const kv_attach_options& options,
                  const std::shared_ptr<attach_wakeup>& wakeup, io_op* op) {
  unstarted_op started(op);
  const std::span<const token_id> usable = p->within_max(tokens);
  std::vector<kv_block_hash> hashes = p->hashes(usable, salt);
  std::vector<std::vector<ref_ptr<block>>> blocks;
  const std::size_t in_ram = p->take(hashes, blocks);
  const bool cancelled = !op->claim();
  if (!p->store() || in_ram == hashes.size() || cancelled) {
    const error_code ec = cancelled ? error_code(asio::error::operation_aborted) : error_code();
    io_op* taken = started.take();
    taken->complete(make_result(*p, taken, ex, ec, std::move(blocks), tokens, in_ram), queueing::post);
    return;
  }
  auto job = std::make_shared<attach_job>(p, ex, std::vector<token_id>(usable.begin(), usable.end()), std::move(hashes),
                                          in_ram, std::move(blocks), op);
  started.take();  // the job's now
  if (wakeup) wakeup->attach(job);
  job->start(options);
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
