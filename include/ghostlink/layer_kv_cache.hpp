#pragma once
/// @file
/// `basic_layer_kv_cache<T>` (`layer_kv_cache` for float storage): one
/// transformer layer's key/value cache, written through an actor on an Asio
/// strand and read through lock-free snapshots.

#include <cstddef>
#include <iosfwd>
#include <memory>
#include <span>
#include <system_error>
#include <type_traits>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/block_pool.hpp"
#include "ghostlink/completion_token.hpp"
#include "ghostlink/config.hpp"
#include "ghostlink/detail/cache_access.hpp"
#include "ghostlink/detail/layer_interface.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/error.hpp"
#include "ghostlink/snapshot.hpp"
#include "ghostlink/stats.hpp"
#include "ghostlink/types.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// The key/value cache of one transformer layer for one sequence.
///
/// A handle: copies share one actor and one storage, as copies of a
/// `std::shared_ptr` share one object, so every operation is `const` (a
/// `const` handle still writes to, truncates and forks its cache; only
/// assignment changes a handle). Writes are requests to
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
/// Storage: blocks of `block_tokens` tokens from a `kv_block_pool`, shared
/// with the cache's forks until either side writes into one. `T` is the
/// stored element type (`float`, `half` or `bfloat16`); writes take floats
/// and convert them, `for_each_block` hands out `T`s.
///
/// Cancellation: every write, initialize, truncate and fork honours the
/// handler's associated cancellation slot (any cancellation type). If the
/// slot is emitted before the actor takes the request, the operation
/// completes with `asio::error::operation_aborted` and changes nothing; if
/// the actor has taken it, it completes as if not cancelled. Emit on the
/// handler's executor, as Asio requires of a slot. Reads complete at once
/// and are not cancellable.
///
/// Errors: besides those each operation lists, any write, initialize,
/// truncate or fork completes with `kv_errc::capacity_exhausted`, changing
/// nothing, if the system refuses memory for the epoch it would publish or
/// for room in the mailbox, and with `asio::error::operation_aborted` if
/// cancelled as above. With `asio::use_awaitable` (the default token) and
/// `asio::use_future` an error arrives as a thrown `std::system_error`.
///
/// Thread safety: every member function may be called from any thread, on
/// a valid handle (see `valid()`). Buffers passed in (`std::span`s) must stay
/// valid until the operation completes, as with `asio::async_write`.
template <storage_element T>
class basic_layer_kv_cache {
 public:
  /// The actor's strand, as `get_executor()` returns it.
  using executor_type = asio::strand<asio::any_io_executor>;
  /// The stored element type.
  using value_type = T;
  /// What `snapshot()` returns.
  using snapshot_type = basic_kv_snapshot<T>;

  /// A cache whose actor runs on a new strand of `ex`, with a private pool
  /// whose budget is `config.max_blocks`.
  /// @throws std::system_error with `kv_errc::invalid_config` for a config
  ///         with a zero field or sizes that overflow.
  explicit basic_layer_kv_cache(asio::any_io_executor ex, kv_cache_config config = {})
      : state_(detail::make_actor(std::move(ex), config, detail::codec_of<T>, nullptr, false)) {}

  /// A cache taking its blocks from `pool`, under the pool's budget.
  /// @throws std::system_error with `kv_errc::invalid_config` for a bad
  ///         config, a pool whose `block_bytes()` is not
  ///         `kv_block_pool::block_bytes_for<T>(config)` or whose `kind()`
  ///         is `kv_block_kind::keys_only`, or a config that sets
  ///         `max_blocks` (the pool holds the budget).
  basic_layer_kv_cache(asio::any_io_executor ex, kv_cache_config config, const kv_block_pool& pool)
      : state_(detail::make_actor(std::move(ex), config, detail::codec_of<T>, &pool, false)) {}

  /// A cache whose actor runs on a new strand of `ctx.get_executor()`
  /// (an `io_context`, a `thread_pool`, ...), with a private pool.
  template <class ExecutionContext>
    requires std::is_convertible_v<ExecutionContext&, asio::execution_context&>
  explicit basic_layer_kv_cache(ExecutionContext& ctx, kv_cache_config config = {})
      : basic_layer_kv_cache(asio::any_io_executor(ctx.get_executor()), config) {}

  /// As above, with blocks from `pool`.
  template <class ExecutionContext>
    requires std::is_convertible_v<ExecutionContext&, asio::execution_context&>
  basic_layer_kv_cache(ExecutionContext& ctx, kv_cache_config config, const kv_block_pool& pool)
      : basic_layer_kv_cache(asio::any_io_executor(ctx.get_executor()), config, pool) {}

  /// An empty handle, as a failed `async_fork` hands out: only `valid()`,
  /// assignment and destruction may be used on it.
  basic_layer_kv_cache() noexcept = default;

  /// False for an empty handle (default-constructed, moved-from, or the
  /// result of a failed fork).
  bool valid() const noexcept { return state_ != nullptr; }
  /// As `valid()`.
  explicit operator bool() const noexcept { return valid(); }
  /// True when both handles share one cache.
  friend bool operator==(const basic_layer_kv_cache& a, const basic_layer_kv_cache& b) noexcept {
    return a.state_ == b.state_ && a.layer_ == b.layer_;
  }

  /// The config the cache was made with (a fork's: its parent's).
  const kv_cache_config& config() const noexcept { return detail::config_of(*state_); }
  /// The pool the cache takes its blocks from.
  kv_block_pool pool() const noexcept { return detail::pool_of(*state_); }
  /// The actor's strand: the contract's executor of a layer cache. Bind a
  /// handler to it only to serialise it with the actor; it is not where
  /// handlers run by default (that is the executor the cache was made from,
  /// see Completion above).
  executor_type get_executor() const noexcept { return detail::strand_of(*state_); }

  /// Tokens in the latest published epoch. Lock-free; includes every write
  /// whose handler has run. Unless a truncate completes in between, never
  /// ahead of a snapshot taken after it: after `n = size(); s = snapshot();`,
  /// `s.size() >= n`.
  std::size_t size() const noexcept { return detail::size_of(*state_, layer_); }
  /// True when `size() == 0`.
  bool empty() const noexcept { return size() == 0; }

  /// Pins the latest published epoch. Never blocks and never waits for the
  /// actor; includes every write whose handler has run.
  snapshot_type snapshot() const noexcept {
    return detail::cache_access::adopt<snapshot_type>(detail::pin(*state_, layer_));
  }

  /// The cache's counters now (see `kv_cache_stats`). Lock-free but for a
  /// short mutex over the list of epochs alive.
  kv_cache_stats stats() const noexcept { return detail::stats_of(*state_, layer_); }

  /// Makes the first `min(seq_len, max_tokens_per_seq)` tokens valid (zeros
  /// where never written). Size never shrinks; calling it again keeps data.
  ///
  /// Completion signature: `void(std::error_code)`, after the result is
  /// published. Errors: `zero_length` if `seq_len == 0`;
  /// `capacity_exhausted` if memory for the cache's block of zeros cannot be
  /// had (that block is outside the block budget, which initialize never
  /// charges). On error nothing changes.
  ///
  /// Handler: queued on its associated executor (without one, the executor
  /// the cache was made from, not the strand), never run inside this call.
  /// Cancellable until the actor takes it (see Cancellation above).
  ///
  /// @param seq_len tokens to make valid (clamped to `max_tokens_per_seq`).
  /// @param token   the completion token; none is needed to `co_await`.
  /// @return what `asio::async_initiate` makes of `token`: by default an
  ///         `asio::awaitable<void>`.
  template <class CompletionToken = default_completion_token>
  auto async_initialize(std::size_t seq_len, CompletionToken&& token = default_completion_token()) const;

  /// Writes one token's keys and values at `index`; size becomes
  /// `max(size, index + 1)` and skipped tokens read as zeros.
  ///
  /// `keys` and `values` are read by the actor: they must stay valid until
  /// the operation completes. Completion signature: `void(std::error_code)`,
  /// after the result is published. Errors, checked in this order:
  /// `length_mismatch`, `width_mismatch`, `index_out_of_range`
  /// (`index >= max_tokens_per_seq`), `not_initialized`, then
  /// `capacity_exhausted` (no block left under the budget, or memory for a
  /// block or page table refused). On error nothing is stored.
  ///
  /// Handler: queued on its associated executor (without one, the executor
  /// the cache was made from, not the strand), never run inside this call.
  /// Cancellable until the actor takes it (see Cancellation above).
  ///
  /// @param index  the token's position, below `max_tokens_per_seq`.
  /// @param keys   the token's keys: `token_width()` floats.
  /// @param values the token's values: `token_width()` floats.
  /// @param token  the completion token; none is needed to `co_await`.
  /// @return what `asio::async_initiate` makes of `token`: by default an
  ///         `asio::awaitable<void>`.
  template <class CompletionToken = default_completion_token>
  auto async_write(std::size_t index, std::span<const float> keys, std::span<const float> values,
                   CompletionToken&& token = default_completion_token()) const;

  /// Writes every token of `writes`, in order (a later write to an index wins), as one
  /// atomic request: every write is validated first and a snapshot sees all
  /// of the batch or none of it. An empty batch succeeds and does nothing.
  ///
  /// The span and every span inside it must stay valid until completion.
  /// Completion signature: `void(std::error_code)`; errors as `async_write`,
  /// for the first bad write. On error nothing of the batch is stored.
  ///
  /// Handler: queued on its associated executor (without one, the executor
  /// the cache was made from, not the strand), never run inside this call.
  /// Cancellable until the actor takes it (see Cancellation above).
  ///
  /// @param writes the tokens to write, in order.
  /// @param token   the completion token; none is needed to `co_await`.
  /// @return what `asio::async_initiate` makes of `token`: by default an
  ///         `asio::awaitable<void>`.
  template <class CompletionToken = default_completion_token>
  auto async_write_batch(std::span<const kv_write> writes, CompletionToken&& token = default_completion_token()) const;

  /// Drops tokens `[n, size())` (a speculative-decoding rollback): size
  /// becomes `min(size(), n)`. Snapshots taken before keep seeing the old
  /// data; blocks no epoch needs any more return to the pool. `n >= size()`
  /// changes nothing. Tokens written again later read as written, tokens
  /// skipped read as zeros.
  ///
  /// Rewrite in place: once the truncate is published, a write into the
  /// positions it cut off from the block it kept last writes into that block
  /// in place, with no copy and no new block, when the cache has no older
  /// epoch alive (no snapshot pins one) and no one else holds the block (no
  /// fork). Otherwise it copies the block first, as does every overwrite of
  /// a token the cache still holds: a snapshot may pin the latest epoch at
  /// any moment. So a speculative rollback and rewrite costs no copy and
  /// fits a full budget.
  ///
  /// Completion signature: `void(std::error_code)`, after the result is
  /// published. Errors: `capacity_exhausted` if memory for a page table
  /// cannot be had (nothing is dropped then).
  ///
  /// Handler: queued on its associated executor (without one, the executor
  /// the cache was made from, not the strand), never run inside this call.
  /// Cancellable until the actor takes it (see Cancellation above).
  ///
  /// @param n      the tokens to keep.
  /// @param token  the completion token; none is needed to `co_await`.
  /// @return what `asio::async_initiate` makes of `token`: by default an
  ///         `asio::awaitable<void>`.
  template <class CompletionToken = default_completion_token>
  auto async_truncate(std::size_t n, CompletionToken&& token = default_completion_token()) const;

  /// A new cache holding what this one holds once every request initiated
  /// before it is applied, sharing every block with it copy-on-write (prefix
  /// sharing for parallel sampling and beam search). The two then diverge
  /// independently: a shared block is copied only when one side writes into
  /// it. Costs O(blocks) reference counting and no copy of token data; the
  /// new cache has the same executor, config and pool, its own strand, and
  /// epochs numbered on from this cache's.
  ///
  /// Completion signature: `void(std::error_code, basic_layer_kv_cache<T>)`,
  /// after the fork point is published; on error the handle is empty.
  /// Errors: `capacity_exhausted` if memory for the new cache (its actor,
  /// page table and chunks) cannot be had. Either way this cache is
  /// unchanged.
  ///
  /// Handler: queued on its associated executor (without one, the executor
  /// the cache was made from, not the strand), never run inside this call.
  /// Cancellable until the actor takes it (see Cancellation above): then
  /// `operation_aborted` and an empty handle.
  ///
  /// @param token  the completion token; none is needed to `co_await`.
  /// @return what `asio::async_initiate` makes of `token`: by default an
  ///         `asio::awaitable<basic_layer_kv_cache<T>>`.
  template <class CompletionToken = default_completion_token>
  auto async_fork(CompletionToken&& token = default_completion_token()) const;

  /// Reads token `index` from the latest published epoch (not through the
  /// actor), as `snapshot().read_kv(index, entry)` does: the copy is made
  /// inside this call, and only the handler is queued.
  ///
  /// Completion signature: `void(std::error_code, kv_entry)`; the entry
  /// holds `token_width()` floats of keys and of values, widened from `T`.
  /// Errors: `index_out_of_range` if `index >= size()` (the entry is empty).
  ///
  /// Handler: queued on its associated executor (without one, the executor
  /// the cache was made from, not the strand), never run inside this call.
  /// Not cancellable: the read is done before this call returns.
  ///
  /// @param index  the token to read.
  /// @param token  the completion token; none is needed to `co_await`.
  /// @return what `asio::async_initiate` makes of `token`: by default an
  ///         `asio::awaitable<kv_entry>`.
  template <class CompletionToken = default_completion_token>
  auto async_read_kv(std::size_t index, CompletionToken&& token = default_completion_token()) const;

  /// Reads tokens `[begin, end)` token-major from the latest published epoch
  /// (not through the actor), as `snapshot().read_range(begin, end, range)`
  /// does: the copy is made inside this call, and only the handler is queued.
  ///
  /// Completion signature: `void(std::error_code, kv_range)`. Errors:
  /// `invalid_range` (`begin > end`), `range_out_of_bounds` (`end > size()`);
  /// the range's vectors are empty then. `begin == end` succeeds, empty.
  ///
  /// Handler: queued on its associated executor (without one, the executor
  /// the cache was made from, not the strand), never run inside this call.
  /// Not cancellable: the read is done before this call returns.
  ///
  /// @param begin  the first token to read.
  /// @param end    one past the last token to read.
  /// @param token  the completion token; none is needed to `co_await`.
  /// @return what `asio::async_initiate` makes of `token`: by default an
  ///         `asio::awaitable<kv_range>`.
  template <class CompletionToken = default_completion_token>
  auto async_read_range(std::size_t begin, std::size_t end, CompletionToken&& token = default_completion_token()) const;

  /// Prints the config and the length, never the buffers.
  friend std::ostream& operator<<(std::ostream& os, const basic_layer_kv_cache& cache) {
    return detail::print(os, *cache.state_, cache.layer_);
  }

 private:
  friend struct detail::cache_access;
  /// Layer `layer` of `state` (a sequence's: see basic_sequence_kv_cache::layer).
  explicit basic_layer_kv_cache(std::shared_ptr<detail::actor> state, std::size_t layer = 0) noexcept
      : state_(std::move(state)), layer_(layer) {}

  std::shared_ptr<detail::actor> state_;
  std::size_t layer_ = 0;  // which layer of the actor's (a layer cache's actor has one)
};

/// A layer cache storing floats: the contract's `layer_kv_cache`.
using layer_kv_cache = basic_layer_kv_cache<float>;

GHOSTLINK_NAMESPACE_END

#include "ghostlink/impl/layer_kv_cache.hpp"
