#pragma once
/// @file
/// `basic_sequence_kv_cache<T>` (`sequence_kv_cache` for float storage): one
/// sequence's key/value cache across every layer of a model.

#include <bit>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <system_error>
#include <type_traits>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/block_pool.hpp"
#include "ghostlink/completion_token.hpp"
#include "ghostlink/config.hpp"
#include "ghostlink/detail/cache_access.hpp"
#include "ghostlink/detail/sequence_interface.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/layer_kv_view.hpp"
#include "ghostlink/layout.hpp"
#include "ghostlink/sequence_step.hpp"
#include "ghostlink/snapshot.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// Per-layer snapshots of one sequence, all of one length.
///
/// A sequence's `snapshot()` is one published state, so every layer shows
/// `size()` tokens (and no open step's). Made from layer snapshots by hand,
/// each is narrowed to the shortest. Move-only; safe to read from many
/// threads.
template <storage_element T>
class basic_sequence_snapshot {
 public:
  /// An empty snapshot: no layers, size 0 (as a moved-from one).
  basic_sequence_snapshot() = default;
  /// Narrows `layers` (and the token ids' snapshot, if any: one float per
  /// token, an id's bits) to the shortest of them, and to at most `bound`
  /// tokens. `rollback_tokens`: the sequence layout's (what a save records).
  explicit basic_sequence_snapshot(std::vector<basic_kv_snapshot<T>> layers,
                                   std::size_t bound = static_cast<std::size_t>(-1),
                                   std::optional<basic_kv_snapshot<float>> ids = std::nullopt,
                                   std::size_t rollback_tokens = 0) noexcept
      : layers_(std::move(layers)), ids_(std::move(ids)), rollback_(rollback_tokens) {
    if (layers_.empty()) return;
    size_ = bound;
    for (const auto& l : layers_) size_ = std::min(size_, l.size());
    if (ids_) size_ = std::min(size_, ids_->size());
    for (auto& l : layers_) l = std::move(l).prefix(size_);
    if (ids_) ids_ = std::move(*ids_).prefix(size_);
  }

  /// Tokens every layer's snapshot shows.
  std::size_t size() const noexcept { return layers_.empty() ? 0 : size_; }
  /// True when `size() == 0`.
  bool empty() const noexcept { return size() == 0; }
  /// The layers pinned: the sequence's `num_layers()`, or 0 for an empty
  /// (default-constructed or moved-from) snapshot.
  std::size_t num_layers() const noexcept { return layers_.size(); }
  /// Layer `i`'s snapshot (`i < num_layers()`), narrowed to `size()`; a
  /// windowed layer's says what it holds (`kept_from()`).
  const basic_kv_snapshot<T>& layer(std::size_t i) const noexcept { return layers_[i]; }
  /// The `kv_model_layout::rollback_tokens` of the sequence it was taken
  /// from (0 for one made by hand): with each layer's `window()` and
  /// `sink_tokens()`, its layout.
  std::size_t rollback_tokens() const noexcept { return rollback_; }

  /// Token `i`'s id (`i < size()`): the one its append or step was given,
  /// else `no_token_id`. `no_token_id` too past `size()`.
  token_id token_id_at(std::size_t i) const noexcept {
    float bits[1] = {};
    if (!ids_ || ids_->read_kv(i, bits, bits)) return no_token_id;
    return std::bit_cast<token_id>(bits[0]);
  }
  /// Every token's id, token 0 first: `size()` of them (see `token_id_at`).
  std::vector<token_id> token_ids() const {
    std::vector<token_id> out(size(), no_token_id);
    if (ids_)
      (void)ids_->for_each_block(0, size(), [&](std::size_t first, std::size_t n, auto keys, auto) {
        for (std::size_t t = 0; t < n; ++t) out[first + t] = std::bit_cast<token_id>(keys[t]);
      });
    return out;
  }

 private:
  std::vector<basic_kv_snapshot<T>> layers_;
  std::optional<basic_kv_snapshot<float>> ids_;  // the token ids (a sequence's snapshots have them)
  std::size_t size_ = 0;  // meaningful while layers_ is not empty
  std::size_t rollback_ = 0;
};

/// One sequence's key/value cache across `num_layers` layers of a model:
/// one actor owns every layer and the token ids (one strand, one mailbox,
/// one drain), all layers taking blocks from one `kv_block_pool`. Each
/// operation (an append, a truncate, a fork, a step's begin, commit and
/// end) is one request, applied to every layer in one drain, all or
/// nothing, and published once; `snapshot()` pins that one state. The
/// requests, executor hops and completions of an operation do not grow
/// with the number of layers.
///
/// A handle: copies share one sequence, as copies of a `std::shared_ptr`
/// share one object, so every operation is `const`. Appends, truncates and forks of one
/// sequence run one at a time, as writes to one Asio stream do: start the
/// next when the previous has completed (a decode loop does). One started
/// while another is in progress fails with `kv_errc::operation_in_progress`
/// and changes nothing. Snapshots, `size()` and reads may be used from any
/// thread at any time.
///
/// Cancellation: appends, truncates, forks and a step's begin honour the
/// handler's associated cancellation slot (any type), passing it on to the
/// operation's one request. Cancelled before the sequence's actor took the
/// request, the operation completes with `asio::error::operation_aborted`
/// and changes nothing (a fork's handle is empty); cancelled once the actor
/// took it, the operation completes normally.
///
/// Layers accept writes from the start (no initialize is needed), and only
/// through the sequence: `layer(i)` is a read-only view.
///
/// The forward pass: a model computes layer l+1's keys and values only after
/// layer l's attention has read layer l's cache, new token included. A step
/// (`async_begin_step`) serves it: begin, then for each layer write its
/// tokens and attend over `step.snapshot(l)`, then commit. See
/// `basic_sequence_step`.
///
/// Completion: as for `basic_layer_kv_cache`, every handler is queued on its
/// associated executor (without one, the executor the sequence was made
/// from), never run inside the initiating call, and a coroutine resumes on
/// its own executor. An operation's intermediate state (one per operation,
/// holding the handler) is allocated with the handler's associated
/// allocator. With `asio::use_awaitable` (the default token) and
/// `asio::use_future` an error arrives as a thrown `std::system_error`.
template <storage_element T>
class basic_sequence_kv_cache {
 public:
  /// The executor the sequence was made from (not a strand).
  using executor_type = asio::any_io_executor;
  /// The stored element type.
  using value_type = T;
  /// The read-only view of one layer, as `layer()` returns it.
  using layer_type = basic_layer_kv_view<T>;
  /// What `snapshot()` returns.
  using snapshot_type = basic_sequence_snapshot<T>;
  /// What `async_begin_step()` hands out.
  using step_type = basic_sequence_step<T>;

  /// `num_layers` empty layers of `config` whose actors run on strands of
  /// `ex`, taking blocks from `pool` under its budget.
  /// @throws std::system_error with `kv_errc::invalid_config` if
  ///         `num_layers` is 0 or as `basic_layer_kv_cache`'s constructor.
  basic_sequence_kv_cache(asio::any_io_executor ex, std::size_t num_layers, kv_cache_config config,
                          const kv_block_pool& pool);

  /// As above, with a pool of its own whose budget is `config.max_blocks`
  /// for all layers together.
  basic_sequence_kv_cache(asio::any_io_executor ex, std::size_t num_layers, kv_cache_config config = {});

  /// As above, on `ctx.get_executor()`.
  template <class ExecutionContext, class... Pool>
    requires std::is_convertible_v<ExecutionContext&, asio::execution_context&>
  basic_sequence_kv_cache(ExecutionContext& ctx, std::size_t num_layers, kv_cache_config config = {},
                          const Pool&... pool)
      : basic_sequence_kv_cache(asio::any_io_executor(ctx.get_executor()), num_layers, config, pool...) {}

  /// The layers of `layout` (`kv_model_layout::full(n)` is what the
  /// constructors above make): windowed layers keep and attend only their
  /// window and sinks, a `keys_only` layout stores keys alone (see
  /// `kv_model_layout`), taking blocks from `pool` under its budget.
  /// @throws std::system_error with `kv_errc::invalid_config` for a layout
  ///         without layers or with sink tokens on a layer without a
  ///         window, a `pool` of the other `kv_block_kind` than the layout
  ///         stores; or as `basic_layer_kv_cache`'s constructor.
  basic_sequence_kv_cache(asio::any_io_executor ex, const kv_model_layout& layout, kv_cache_config config,
                          const kv_block_pool& pool);
  /// As above, with a pool of its own whose budget is `config.max_blocks`
  /// for all layers together.
  basic_sequence_kv_cache(asio::any_io_executor ex, const kv_model_layout& layout, kv_cache_config config = {});
  /// As above, on `ctx.get_executor()`.
  template <class ExecutionContext, class... Pool>
    requires std::is_convertible_v<ExecutionContext&, asio::execution_context&>
  basic_sequence_kv_cache(ExecutionContext& ctx, const kv_model_layout& layout, kv_cache_config config = {},
                          const Pool&... pool)
      : basic_sequence_kv_cache(asio::any_io_executor(ctx.get_executor()), layout, config, pool...) {}

  /// An empty handle, as a failed `async_fork` hands out: only `valid()`,
  /// assignment and destruction may be used on it.
  basic_sequence_kv_cache() noexcept = default;
  /// False for an empty handle (default-constructed, moved-from, or the
  /// result of a failed fork).
  bool valid() const noexcept { return state_ != nullptr; }
  /// As `valid()`.
  explicit operator bool() const noexcept { return valid(); }

  /// The layers of the sequence, each a `layer_type` with its own actor.
  std::size_t num_layers() const noexcept { return detail::num_layers(*state_); }
  /// The config the sequence was made with (for every layer).
  const kv_cache_config& config() const noexcept { return detail::config_of(*state_); }
  /// The layout the sequence was made with (`kv_model_layout::full(num_layers())`
  /// unless one was given); a fork's is its parent's.
  const kv_model_layout& layout() const noexcept { return detail::layout_of(*state_); }
  /// The pool every layer takes its blocks from.
  kv_block_pool pool() const noexcept { return detail::pool_of(*detail::group_of(*state_)); }
  /// The executor the sequence was made from: where handlers without an
  /// associated executor run. Unlike a layer's `get_executor()`, which is
  /// that layer's strand, it is no strand: a sequence's operations run on
  /// every layer's strand, and its handler on this executor.
  executor_type get_executor() const noexcept { return detail::io_executor(*state_); }
  /// Tokens the sequence holds (windows never narrow it: it counts every
  /// token, dropped or not): those of its latest published state (its
  /// last append, truncate or step commit applied, possibly just before
  /// that operation's handler runs; or its fork). Lock-free. A snapshot
  /// never shows fewer tokens than `size()` read before it, nor (while
  /// tokens are only added) more than `size()` read after it.
  std::size_t size() const noexcept { return detail::size_of(*state_); }
  /// True when `size() == 0`.
  bool empty() const noexcept { return size() == 0; }
  /// Makes `reservation`'s blocks the sequence's: its layers' block
  /// allocations (appends, steps, copies on write) draw on them before the
  /// pool's budget, so an admitted request cannot run out for want of a
  /// block that another request took meanwhile. What is left goes back to
  /// the pool once the sequence (and every layer view of it) is gone.
  /// `reservation` is empty afterwards.
  /// @throws std::system_error with `kv_errc::invalid_config` if the
  ///         reservation is from another pool (it is unchanged then).
  void use_reservation(kv_block_reservation&& reservation) const { detail::use_reservation(*state_, reservation); }

  /// A read-only view of layer `i` (`i < num_layers()`).
  layer_type layer(std::size_t i) const noexcept {
    return layer_type(detail::cache_access::adopt<basic_layer_kv_cache<T>>(detail::group_of(*state_), i));
  }

  /// Pins the sequence's latest published state: one state in which every
  /// layer (and the token ids) shows the same tokens, each layer as one
  /// drain of the sequence's actor left it. An operation shows once its
  /// drain published it (possibly just before its handler runs); an open
  /// step's tokens show from its commit. Lock-free: one pin, no retry,
  /// never blocks or waits for the actor.
  snapshot_type snapshot() const;

  /// Appends one token, or `n` of them (a prefill chunk), to every layer
  /// from index `size()` on: layer `i` gets `keys_per_layer[i]` and
  /// `values_per_layer[i]`, `n * token_width()` floats each, token-major
  /// (token `size()` first), with the same `n >= 1` for every layer. Each
  /// layer applies its part as one request, so a 256-token chunk costs one
  /// request per layer, not 256. All or nothing: if any layer fails, the
  /// layers that took the tokens drop them again before completion, and no
  /// snapshot shows some of the tokens without the rest.
  ///
  /// The spans (outer and inner) must stay valid until completion.
  /// Completion signature: `void(std::error_code)`, once every layer has
  /// published the tokens. Errors: `layer_mismatch`, `length_mismatch`
  /// (keys and values of a layer differ in length), `width_mismatch` (a
  /// layer's length is not a whole, non-zero number of tokens, or not the
  /// same number as layer 0's), checked first, for every layer;
  /// `index_out_of_range` (`size() + n > max_tokens_per_seq`),
  /// `operation_in_progress`, `capacity_exhausted` (no block left in the
  /// pool, or memory refused, in any layer); `asio::error::operation_aborted`
  /// if cancelled before every layer applied it. On error the sequence is as
  /// before: the layers that took the tokens drop them again (without memory
  /// to, they keep them hidden from snapshots until later appends overwrite
  /// them).
  ///
  /// Handler: queued on its associated executor (without one, the executor
  /// the sequence was made from), never run inside this call, even when the
  /// operation fails at once. Cancellable (see Cancellation above).
  ///
  /// @param keys_per_layer   one span of `n * token_width()` floats per layer.
  /// @param values_per_layer one span of `n * token_width()` floats per layer.
  /// @param token            the completion token; none is needed to `co_await`.
  /// @return what `asio::async_initiate` makes of `token`: by default an
  ///         `asio::awaitable<void>`.
  template <class CompletionToken = default_completion_token>
  auto async_append(std::span<const std::span<const float>> keys_per_layer,
                    std::span<const std::span<const float>> values_per_layer,
                    CompletionToken&& token = default_completion_token()) const;

  /// As above, storing `ids` with the tokens, one per token (snapshots
  /// return them: `token_ids()`; forks and truncates keep them with their
  /// tokens). The tokens are `ids.size()`; each layer's keys and values
  /// hold as many. Errors: as above, and `length_mismatch` if the layers'
  /// tokens are not `ids.size()`. The span must stay valid until
  /// completion.
  template <class CompletionToken = default_completion_token>
  auto async_append(std::span<const token_id> ids, std::span<const std::span<const float>> keys_per_layer,
                    std::span<const std::span<const float>> values_per_layer,
                    CompletionToken&& token = default_completion_token()) const;

  /// Drops tokens `[n, size())` from every layer (speculative-decoding
  /// rollback); `n >= size()` changes nothing. Snapshots taken before keep
  /// their data. Completion signature: `void(std::error_code)`. Errors:
  /// `operation_in_progress`; `capacity_exhausted` if no layer could get
  /// memory for its page table (nothing changed then). If only some could,
  /// the truncate succeeds: the others keep their extra tokens hidden
  /// (snapshots show the shortest layer) until appends overwrite them.
  /// `asio::error::operation_aborted` if cancelled before any layer
  /// truncated (nothing changed then).
  ///
  /// Handler: queued on its associated executor (without one, the executor
  /// the sequence was made from), never run inside this call, even when the
  /// operation fails at once. Cancellable (see Cancellation above).
  ///
  /// @param n      the tokens to keep.
  /// @param token  the completion token; none is needed to `co_await`.
  /// @return what `asio::async_initiate` makes of `token`: by default an
  ///         `asio::awaitable<void>`.
  template <class CompletionToken = default_completion_token>
  auto async_truncate(std::size_t n, CompletionToken&& token = default_completion_token()) const;

  /// A new sequence sharing every block of every layer copy-on-write with
  /// this one (see `basic_layer_kv_cache::async_fork`), with the same pool.
  /// Completion signature: `void(std::error_code, basic_sequence_kv_cache)`;
  /// on error the handle is empty and nothing is forked. Errors:
  /// `operation_in_progress`, `capacity_exhausted`;
  /// `asio::error::operation_aborted` if cancelled before every layer forked.
  /// The forks of layers that did fork are released again.
  ///
  /// Handler: queued on its associated executor (without one, the executor
  /// the sequence was made from), never run inside this call, even when the
  /// operation fails at once. Cancellable (see Cancellation above).
  ///
  /// @param token  the completion token; none is needed to `co_await`.
  /// @return what `asio::async_initiate` makes of `token`: by default an
  ///         `asio::awaitable<basic_sequence_kv_cache>`.
  template <class CompletionToken = default_completion_token>
  auto async_fork(CompletionToken&& token = default_completion_token()) const;

  /// Begins a step of `n` tokens at positions `[size(), size() + n)`: one
  /// request, in which every layer takes the blocks the step needs (so that
  /// no layer's write in the step can fail for want of a block). The step (`basic_sequence_step`) is then written layer
  /// by layer and committed, or ended unchanged; until then the sequence's
  /// other operations fail with `operation_in_progress`.
  ///
  /// Completion signature: `void(std::error_code, step_type)`; on error the
  /// step is empty and the sequence as before. Errors: `zero_length`
  /// (`n == 0`), `index_out_of_range` (`size() + n > max_tokens_per_seq`),
  /// `operation_in_progress`, `capacity_exhausted` (the pool cannot give
  /// the blocks, in any layer); `asio::error::operation_aborted` if
  /// cancelled before the sequence's actor took the request.
  ///
  /// Handler: queued on its associated executor (without one, the executor
  /// the sequence was made from), never run inside this call. Cancellable
  /// (see Cancellation above).
  ///
  /// @param n      tokens per layer: 1 for a decode step, more for a chunk.
  /// @param token  the completion token; none is needed to `co_await`.
  /// @return what `asio::async_initiate` makes of `token`: by default an
  ///         `asio::awaitable<step_type>`.
  template <class CompletionToken = default_completion_token>
  auto async_begin_step(std::size_t n, CompletionToken&& token = default_completion_token()) const;

  /// As above, for `ids.size()` tokens whose ids are `ids` (stored with the
  /// tokens at the commit, as `async_append` stores them). The span must
  /// stay valid until completion.
  template <class CompletionToken = default_completion_token>
  auto async_begin_step(std::span<const token_id> ids, CompletionToken&& token = default_completion_token()) const;

  /// Begins one step of `n` tokens on each sequence of a decode batch (each
  /// sequence once), as `seqs[i].async_begin_step(n)` would, all started at
  /// once, and completes once when every begin has completed: one request
  /// per sequence, one completion for the batch.
  ///
  /// Completion signature: `void(std::error_code, std::vector<step_type>)`:
  /// one step per sequence, in the order of `seqs`, empty where that
  /// sequence's begin failed; the error is the first failure in that order
  /// (each as `async_begin_step`). `capacity_exhausted` (and no step) if the
  /// batch's state cannot be allocated. An empty batch completes with no
  /// error and no step. The steps of sequences that succeeded are open
  /// whatever the error: commit or end them.
  ///
  /// @param seqs   the sequences, each once.
  /// @param n      tokens per layer of every step.
  /// @param token  the completion token; none is needed to `co_await`.
  template <class CompletionToken = default_completion_token>
  static auto async_begin_steps(std::span<const basic_sequence_kv_cache> seqs, std::size_t n,
                                CompletionToken&& token = default_completion_token());

  /// As above, sequence `i`'s step of `ids[i].size()` tokens whose ids are
  /// `ids[i]` (so that a batch-decoded sequence can be inserted into a
  /// prefix cache from its stored ids). `length_mismatch` (and no step) if
  /// `ids` does not hold one span per sequence. The spans must stay valid
  /// until completion.
  template <class CompletionToken = default_completion_token>
  static auto async_begin_steps(std::span<const basic_sequence_kv_cache> seqs,
                                std::span<const std::span<const token_id>> ids,
                                CompletionToken&& token = default_completion_token());

 private:
  friend struct detail::cache_access;
  explicit basic_sequence_kv_cache(std::shared_ptr<detail::sequence_state> state) noexcept : state_(std::move(state)) {}

  std::shared_ptr<detail::sequence_state> state_;
};

/// A whole-model sequence cache storing floats.
using sequence_kv_cache = basic_sequence_kv_cache<float>;

/// The snapshot of a `sequence_kv_cache` (float storage).
using sequence_snapshot = basic_sequence_snapshot<float>;

GHOSTLINK_NAMESPACE_END

#include "ghostlink/impl/sequence_kv_cache.hpp"
