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

#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <utility>
#include <vector>
#include "ghostlink/detail/asio_config.hpp"
#include GHOSTLINK_ASIO_HEADER(steady_timer.hpp)

#include "block.hpp"
#include "block_pool.hpp"
#include "ghostlink/error.hpp"
#include "ghostlink/prefix_cache.hpp"
#include "persist_file.hpp"
#include "prefix_index.hpp"
#include "sequence.hpp"
#include "store_entry.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

/// The tokens an attached sequence can hold (as attach() takes them).
std::span<const token_id> within_max(const prefix_index& p, std::span<const token_id> tokens) noexcept {
  return tokens.first(std::min(tokens.size(), p.config().max_tokens_per_seq));
}

/// Completes `op` now (posted) with a sequence of `blocks`, the first
/// `attached` blocks of `tokens`.
void complete_with(prefix_index& p, persist_op* op, const asio::any_io_executor& ex, error_code ec,
                   std::vector<std::vector<ref_ptr<block>>> blocks, std::span<const token_id> tokens,
                   std::size_t attached) {
  try {
    op->loaded = make_attached_sequence(ex, p.config(), p.codec(), p.pool(), std::move(blocks),
                                        tokens.first(attached * p.config().block_tokens));
  } catch (const std::bad_alloc&) {
    ec = kv_errc::capacity_exhausted;
  }
  op->complete(ec, queueing::post);
}

class attach_job : public std::enable_shared_from_this<attach_job> {
 public:
  attach_job(std::shared_ptr<prefix_index> p, asio::any_io_executor ex, std::vector<token_id> tokens,
             std::vector<kv_block_hash> hashes, std::size_t in_ram, std::vector<std::vector<ref_ptr<block>>> blocks,
             persist_op* op)
      : index_(std::move(p)),
        ex_(std::move(ex)),
        tokens_(std::move(tokens)),
        hashes_(std::move(hashes)),
        in_ram_(in_ram),
        next_(in_ram),
        blocks_(std::move(blocks)),
        arrived_(hashes_.size() - in_ram),
        present_(hashes_.size() - in_ram, false),
        owner_(block_pool::new_owner_id()),
        op_(op) {}

  /// Arms the deadline and asks the store for the blocks after the RAM
  /// hits. Memory refused ends the operation with capacity_exhausted.
  void start(const kv_attach_options& options) {
    try {
      {
        std::lock_guard lock(mutex_);
        if (options.timeout) {
          timer_.emplace(ex_, *options.timeout);
          timer_->async_wait([self = shared_from_this()](const error_code& ec) {
            if (!ec) self->expire();
          });
        }
      }
      // Not under mutex_: a store may answer inside fetch().
      std::vector<kv_block_hash> wanted(hashes_.begin() + static_cast<std::ptrdiff_t>(in_ram_), hashes_.end());
      index_->store()->fetch(std::move(wanted),
                             [self = shared_from_this()](std::size_t i, std::vector<std::byte> bytes) {
                               return self->deliver(i, std::move(bytes));
                             });
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!done_) finish(kv_errc::capacity_exhausted);
    }
  }

 private:
  /// A value for block `in_ram_ + i`; false once no more are wanted.
  bool deliver(std::size_t i, std::vector<std::byte> bytes) {
    std::lock_guard lock(mutex_);
    if (done_) return false;
    if (!op_->claim()) {
      finish(asio::error::operation_aborted);
      return false;
    }
    arrived_[i] = std::move(bytes);
    present_[i] = true;
    while (!done_ && present_[next_ - in_ram_]) {
      std::vector<std::byte> value = std::move(arrived_[next_ - in_ram_]);
      if (!attach_one(value)) {
        finish({});
        break;
      }
      if (++next_ == hashes_.size()) finish({});
    }
    return !done_;
  }

  /// Checks block `next_`'s value and appends it in new blocks; false if
  /// the match ends here.
  bool attach_one(std::span<const std::byte> value) noexcept {
    prefix_index& p = *index_;
    const entry_geometry& g = p.geometry();
    if (value.empty()) return false;
    if (!check_entry(g, hashes_[next_], value)) {
      p.count_store_reject();
      return false;
    }
    std::vector<ref_ptr<block>> fresh;
    try {
      fresh.reserve(g.num_layers);
      for (std::size_t l = 0; l < g.num_layers; ++l) {
        ref_ptr<block> b = block::make(*p.pool(), owner_);
        if (!b) return false;  // the pool has no room: a miss from here on
        std::memcpy(b->payload(), entry_layer(g, value, l), g.block_bytes());
        b->set_materialized(g.block_tokens);
        b->set_readable(g.block_tokens);
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
    if (!done_) finish({});
  }

  /// Ends the operation (under mutex_, once): the fetched entries go into
  /// the index, the handler gets the sequence.
  void finish(error_code ec) {
    done_ = true;
    if (timer_) timer_->cancel();
    prefix_index& p = *index_;
    const std::size_t fetched = next_ - in_ram_;
    if (fetched != 0) {
      p.count_store_hits(fetched * p.config().block_tokens);
      try {
        std::vector<std::vector<const block*>> per_block(next_);
        for (std::size_t b = 0; b < next_; ++b) {
          per_block[b].reserve(blocks_.size());
          for (const auto& layer : blocks_) per_block[b].push_back(layer[b].get());
        }
        p.insert(std::span(hashes_).first(next_), per_block, nullptr, true);
      } catch (const std::bad_alloc&) {  // not cached for the next attach; this one has them
      }
    }
    complete_with(p, op_, ex_, ec, std::move(blocks_), tokens_, next_);
  }

  std::mutex mutex_;
  const std::shared_ptr<prefix_index> index_;
  const asio::any_io_executor ex_;
  const std::vector<token_id> tokens_;
  const std::vector<kv_block_hash> hashes_;
  const std::size_t in_ram_;                         // blocks attached from RAM
  std::size_t next_;                                 // the first block not attached yet
  std::vector<std::vector<ref_ptr<block>>> blocks_;  // per layer, blocks [0, next_)
  std::vector<std::vector<std::byte>> arrived_;      // values of blocks in_ram_ + i not yet taken
  std::vector<bool> present_;                        // whether arrived_[i] came
  const std::uint64_t owner_;                        // of the blocks made here, which no one writes
  persist_op* op_;
  std::optional<asio::steady_timer> timer_;
  bool done_ = false;
};

}  // namespace

void start_attach(const std::shared_ptr<prefix_index>& p, const asio::any_io_executor& ex,
                  std::span<const token_id> tokens, std::string_view salt, const kv_attach_options& options,
                  persist_op* op) {
  unstarted_op started(op);
  const std::span<const token_id> usable = within_max(*p, tokens);
  std::vector<kv_block_hash> hashes = p->hashes(usable, salt);
  std::vector<std::vector<ref_ptr<block>>> blocks;
  const std::size_t in_ram = p->take(hashes, blocks);
  const bool cancelled = !op->claim();
  if (!p->store() || in_ram == hashes.size() || cancelled) {
    const error_code ec = cancelled ? error_code(asio::error::operation_aborted) : error_code();
    complete_with(*p, started.take(), ex, ec, std::move(blocks), tokens, in_ram);
    return;
  }
  auto job = std::make_shared<attach_job>(p, ex, std::vector<token_id>(usable.begin(), usable.end()), std::move(hashes),
                                          in_ram, std::move(blocks), op);
  started.take();  // the job's now
  job->start(options);
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
