#pragma once
/// @file
/// `layer_kv_cache`: one transformer layer's key/value cache, written through
/// an actor on an Asio strand and read through lock-free snapshots.

#include <cstddef>
#include <iosfwd>
#include <memory>
#include <span>
#include <system_error>
#include <type_traits>

#include "ghostlink/detail/asio_config.hpp"

#include <asio/any_io_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/execution_context.hpp>
#include <asio/strand.hpp>

#include "ghostlink/config.hpp"
#include "ghostlink/detail/actor.hpp"
#include "ghostlink/error.hpp"
#include "ghostlink/snapshot.hpp"
#include "ghostlink/stats.hpp"
#include "ghostlink/types.hpp"

namespace ghostlink {

/// The key/value cache of one transformer layer for one sequence.
///
/// A handle: copies share one actor and one storage. Writes are requests to
/// the actor, which runs on a strand of the executor the cache was made from,
/// applies each request all-or-nothing and publishes everything applied in
/// one mailbox drain as one new immutable epoch. Reads pin the latest epoch
/// without a lock and without waiting for the actor.
///
/// Completion: every handler runs on its associated executor, queued (by
/// `asio::post` or `asio::defer`), never inside the initiating call. A
/// handler without an associated executor runs on the executor the cache was
/// made from (not on the strand); a coroutine resumes on its own executor.
///
/// Scheduling: a write `co_await`ed with `asio::use_awaitable` dispatches the
/// actor's drain, so when the coroutine already runs on the cache's executor
/// and the strand is idle the write is applied and published on the strand
/// inside the initiating call, without a thread hop (the coroutine still
/// resumes only through its executor's queue). Writes with any other token
/// post the drain, so requests arriving together commit as one epoch.
///
/// Thread safety: every member function may be called from any thread.
class layer_kv_cache {
 public:
  using executor_type = asio::strand<asio::any_io_executor>;

  /// A cache whose actor runs on a new strand of `ex`.
  /// @throws std::system_error with `kv_errc::invalid_config` for a config
  ///         with a zero field or sizes that overflow.
  explicit layer_kv_cache(asio::any_io_executor ex, kv_cache_config config = {});

  /// A cache whose actor runs on a new strand of `ctx.get_executor()`
  /// (an `io_context`, a `thread_pool`, ...).
  template <class ExecutionContext>
    requires std::is_convertible_v<ExecutionContext&, asio::execution_context&>
  explicit layer_kv_cache(ExecutionContext& ctx, kv_cache_config config = {})
      : layer_kv_cache(asio::any_io_executor(ctx.get_executor()), config) {}

  const kv_cache_config& config() const noexcept { return actor_->config(); }
  /// The actor's strand. Bind a handler to it only to serialise it with the
  /// actor; it is not where handlers run by default.
  executor_type get_executor() const noexcept { return actor_->strand(); }

  /// Tokens in the latest published epoch. Lock-free; includes every write
  /// whose handler has run. Never ahead of a snapshot taken after it: after
  /// `n = size(); s = snapshot();`, `s.size() >= n`.
  std::size_t size() const noexcept { return actor_->size(); }
  bool empty() const noexcept { return size() == 0; }

  /// Pins the latest published epoch. Never blocks and never waits for the
  /// actor; includes every write whose handler has run.
  kv_snapshot snapshot() const noexcept { return kv_snapshot(actor_->pin()); }

  /// The cache's counters.
  kv_cache_stats stats() const noexcept { return actor_->stats(); }

  /// Makes the first `min(seq_len, max_tokens_per_seq)` tokens valid (zeros
  /// where never written). Size never shrinks; calling it again keeps data.
  ///
  /// Completion signature: `void(std::error_code)`, after the result is
  /// published. Errors: `zero_length` if `seq_len == 0`;
  /// `capacity_exhausted` if the block budget is spent.
  template <class CompletionToken>
  auto async_initialize(std::size_t seq_len, CompletionToken&& token);

  /// Writes one token's keys and values at `index`; size becomes
  /// `max(size, index + 1)` and skipped tokens read as zeros.
  ///
  /// `keys` and `values` are read by the actor: they must stay valid until
  /// the operation completes. Completion signature: `void(std::error_code)`,
  /// after the result is published. Errors, checked in this order:
  /// `length_mismatch`, `width_mismatch`, `index_out_of_range`
  /// (`index >= max_tokens_per_seq`), `not_initialized`, then
  /// `capacity_exhausted`. On error nothing is stored.
  template <class CompletionToken>
  auto async_write(std::size_t index, std::span<const float> keys, std::span<const float> values,
                   CompletionToken&& token);

  /// Writes every entry, in order (a later entry for an index wins), as one
  /// atomic request: every entry is validated first and a snapshot sees all
  /// of the batch or none of it. An empty batch succeeds and does nothing.
  ///
  /// The span and every span inside it must stay valid until completion.
  /// Completion signature: `void(std::error_code)`; errors as `async_write`,
  /// for the first bad entry. On error nothing of the batch is stored.
  template <class CompletionToken>
  auto async_write_batch(std::span<const kv_write> entries, CompletionToken&& token);

  /// Reads token `index` from the latest published epoch (not through the
  /// actor). Completion signature: `void(std::error_code, kv_entry)`;
  /// `index_out_of_range` if `index >= size()`.
  template <class CompletionToken>
  auto async_read_kv(std::size_t index, CompletionToken&& token);

  /// Reads tokens `[begin, end)` token-major from the latest published epoch.
  /// Completion signature: `void(std::error_code, kv_range)`; errors
  /// `invalid_range` (`begin > end`), `range_out_of_bounds` (`end > size()`).
  template <class CompletionToken>
  auto async_read_range(std::size_t begin, std::size_t end, CompletionToken&& token);

  /// Prints the config and the length, never the buffers.
  friend std::ostream& operator<<(std::ostream& os, const layer_kv_cache& cache);

 private:
  std::shared_ptr<detail::actor> actor_;
};

}  // namespace ghostlink

#include "ghostlink/impl/layer_kv_cache.hpp"
