#pragma once
/// @file
/// `basic_sequence_step<T>`: one decode or prefill step of a sequence, layer
/// by layer, as a forward pass produces each layer's keys and values.

#include <cstddef>
#include <memory>
#include <span>
#include <system_error>
#include <utility>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/completion_token.hpp"
#include "ghostlink/detail/cache_access.hpp"
#include "ghostlink/detail/sequence_interface.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/snapshot.hpp"

GHOSTLINK_NAMESPACE_BEGIN

template <storage_element T>
class basic_sequence_kv_cache;

/// An open step of a `basic_sequence_kv_cache<T>`: `size()` tokens at
/// positions `[index(), index() + size())` of every layer, written one layer
/// at a time, as a forward pass computes them, and made part of the
/// sequence all at once by `async_commit()`. Made by
/// `basic_sequence_kv_cache::async_begin_step`, which set aside every
/// layer's blocks for the tokens, so a layer's write cannot fail for want
/// of a block.
///
/// While the step is open the sequence's own appends, truncates, forks and
/// steps fail with `kv_errc::operation_in_progress`, and its snapshots and
/// `size()` do not show the step's tokens. `snapshot(l)` does, for each
/// layer `l` already written: a layer's attention reads its own new tokens
/// (read your writes). A forward pass is then one begin request, per layer
/// a `write` and an attend over `snapshot(l)`, and one commit request.
///
/// A step that ends without a commit is undone: every layer drops its
/// tokens, and the sequence is as before the step. `async_abandon()` does
/// so and completes when the sequence is free for its next operation.
/// Destroying an open step, moving over it, or `abandon()` do so in the
/// background: until the sequence's actor has dropped the tokens (one
/// request), the sequence's operations fail with `operation_in_progress`.
///
/// Move-only. Writes to different layers may run at once, from any threads;
/// `snapshot()` may be called from any thread at any time. Handlers are
/// queued as for the sequence's operations (on their associated executor,
/// else the sequence's), never run inside the initiating call.
template <storage_element T>
class basic_sequence_step {
 public:
  /// The executor of the sequence: where handlers without an associated
  /// executor run.
  using executor_type = asio::any_io_executor;
  /// What `snapshot(l)` returns.
  using snapshot_type = basic_kv_snapshot<T>;

  /// An empty step (as a moved-from one): only `valid()`, assignment and
  /// destruction may be used.
  basic_sequence_step() noexcept = default;
  /// Takes over the other's step; the other is left empty.
  basic_sequence_step(basic_sequence_step&&) noexcept = default;
  /// Ends this step if still open (as `abandon()`), then takes over the
  /// other's.
  basic_sequence_step& operator=(basic_sequence_step&& other) noexcept {
    if (this != &other) {
      abandon();
      state_ = std::move(other.state_);
    }
    return *this;
  }
  /// Not copyable: a step has one owner, which commits or ends it.
  basic_sequence_step(const basic_sequence_step&) = delete;
  /// Not copyable: a step has one owner, which commits or ends it.
  basic_sequence_step& operator=(const basic_sequence_step&) = delete;
  /// Ends the step if still open (as `abandon()`).
  ~basic_sequence_step() { abandon(); }

  /// False for an empty step (default-constructed, moved-from, `abandon()`ed,
  /// or the result of a failed begin). A committed step stays valid; its
  /// writes and commits then fail with `kv_errc::step_closed`.
  bool valid() const noexcept { return state_ != nullptr; }
  /// As `valid()`.
  explicit operator bool() const noexcept { return valid(); }
  /// The position of the step's first token: the sequence's `size()` when
  /// the step began.
  std::size_t index() const noexcept { return detail::step_index(*state_); }
  /// Tokens the step adds to every layer.
  std::size_t size() const noexcept { return detail::step_tokens(*state_); }
  /// The sequence's layers.
  std::size_t num_layers() const noexcept { return detail::num_layers(*detail::sequence_of(*state_)); }
  /// The sequence's executor.
  executor_type get_executor() const noexcept { return detail::io_executor(*detail::sequence_of(*state_)); }

  /// Pins layer `layer` (`layer < num_layers()`) with the step's tokens once
  /// that layer's `write` has stored them (`index() + size()` tokens), else
  /// as the sequence last published it (`index()` tokens). Lock-free, as
  /// `basic_layer_kv_cache::snapshot()`.
  snapshot_type snapshot(std::size_t layer) const noexcept {
    return detail::cache_access::adopt<snapshot_type>(detail::pin_step(*state_, layer)).prefix(index() + size());
  }
  /// Layer `layer`'s tokens before the step (`layer < num_layers()`),
  /// whether or not the layer is written: what a forward pass attends with
  /// the step's tokens pending (`ghostlink::attend`). Lock-free, as
  /// `snapshot()`.
  snapshot_type snapshot_before(std::size_t layer) const noexcept { return snapshot(layer).prefix(index()); }
  /// Writes layer `layer`'s `size()` tokens on the calling thread: copies
  /// (converting to `T`) `keys` and `values`, `size() * token_width()`
  /// floats each, token-major (token `index()` first), into the positions
  /// the begin set aside. No actor, no lock, no allocation. Each layer is
  /// written once per step; different layers may be written at once from
  /// different threads.
  ///
  /// It ends with a release store of the layer's "written" state, which
  /// `snapshot(layer)` and the commit acquire: a `snapshot(layer)` that
  /// sees the layer written shows its tokens, on any thread.
  ///
  /// Errors: `layer_mismatch` (`layer >= num_layers()`), `length_mismatch`
  /// (keys and values differ in size), `width_mismatch` (not `size() *
  /// token_width()` floats), `operation_in_progress` (the layer is written
  /// or being written, or a commit waits), `step_closed` (committed or
  /// ended). On error the layer is as before. Destroying or abandoning the
  /// step while a `write` runs on another thread is the caller's error (as
  /// destroying any object during a member call).
  ///
  /// @param layer  the layer, below `num_layers()`.
  /// @param keys   `size() * token_width()` floats.
  /// @param values `size() * token_width()` floats.
  std::error_code write(std::size_t layer, std::span<const float> keys, std::span<const float> values) const noexcept {
    return detail::write_step(*state_, layer, keys, values);
  }
  /// `write(layer, keys, values)`, then a completion with its result, for
  /// callers that want one. Completion signature: `void(std::error_code)`,
  /// queued as the sequence's handlers are, never run inside this call.
  /// Errors: as `write`. The spans are read before this call returns.
  ///
  /// @param layer  the layer, below `num_layers()`.
  /// @param keys   `size() * token_width()` floats.
  /// @param values `size() * token_width()` floats.
  /// @param token  the completion token; none is needed to `co_await`.
  template <class CompletionToken = default_completion_token>
  auto async_write(std::size_t layer, std::span<const float> keys, std::span<const float> values,
                   CompletionToken&& token = default_completion_token()) const;
  /// Makes the step's tokens part of the sequence: one request to the
  /// sequence's actor, which publishes every layer's tokens at once, so
  /// that `size()` grows by `size()` and sequence snapshots show them. A
  /// commit while a `write` runs on another thread waits for it to return.
  /// Completion signature: `void(std::error_code)`. Errors:
  /// `step_incomplete` (a layer is unwritten once the writes in progress
  /// have returned; the step stays open), `operation_in_progress` (another
  /// commit is waiting), `step_closed` (committed or ended before). While
  /// it waits, the step's writes and `async_abandon()` fail with
  /// `operation_in_progress`; destroying the handle meanwhile ends the step
  /// if the commit then fails.
  ///
  /// @param token  the completion token; none is needed to `co_await`.
  template <class CompletionToken = default_completion_token>
  auto async_commit(CompletionToken&& token = default_completion_token()) const;

  /// Ends the step unless committed: every layer drops its tokens and the
  /// sequence is as before the step. Completion signature:
  /// `void(std::error_code)`, once the sequence is free for its next
  /// operation. Errors: `step_closed` (committed or ended before),
  /// `operation_in_progress` (a commit is waiting for the writes). Not
  /// cancellable. The handle stays valid; its writes and commits then fail
  /// with `step_closed`.
  ///
  /// @param token  the completion token; none is needed to `co_await`.
  template <class CompletionToken = default_completion_token>
  auto async_abandon(CompletionToken&& token = default_completion_token()) const;

  /// Writes layer `layer` of every step of `steps`, one open step per
  /// sequence of a decode batch: step `i`'s tokens from `keys[i]` and
  /// `values[i]`, as `steps[i].write(layer, keys[i], values[i])` does, on
  /// the calling thread, and completes once.
  ///
  /// Completion signature: `void(std::error_code, std::vector<std::error_code>)`:
  /// the first step's error in order (none if every write succeeded), then
  /// every step's own result, in the order of `steps`. Errors: as `write`
  /// for each step; `length_mismatch` (and no write) if `keys` or `values`
  /// do not hold one span per step, `capacity_exhausted` if the results
  /// cannot be allocated. The spans are read before this call returns. An
  /// empty batch completes with no error and no result.
  ///
  /// @param steps  open steps, of different sequences.
  /// @param layer  the layer, below each step's `num_layers()`.
  /// @param keys   one span of `size() * token_width()` floats per step.
  /// @param values one span of `size() * token_width()` floats per step.
  /// @param token  the completion token; none is needed to `co_await`.
  template <class CompletionToken = default_completion_token>
  static auto async_write_layer(std::span<const basic_sequence_step> steps, std::size_t layer,
                                std::span<const std::span<const float>> keys,
                                std::span<const std::span<const float>> values,
                                CompletionToken&& token = default_completion_token());

  /// Commits every step of `steps` (as `async_commit` each), one request
  /// per step's sequence and one completion for the batch. Completion
  /// signature: `void(std::error_code, std::vector<std::error_code>)`: the
  /// first failure in order, then each commit's result in the order of
  /// `steps` (an empty handle's: `step_closed`). `capacity_exhausted` (and
  /// no commit) if the batch's state cannot be allocated.
  ///
  /// @param steps  steps of different sequences.
  /// @param token  the completion token; none is needed to `co_await`.
  template <class CompletionToken = default_completion_token>
  static auto async_commit_all(std::span<const basic_sequence_step> steps,
                               CompletionToken&& token = default_completion_token());
  /// As `async_abandon()`, in the background, and the handle is left empty.
  void abandon() noexcept {
    if (state_) detail::abandon(*state_);
    state_.reset();
  }

 private:
  friend struct detail::cache_access;
  explicit basic_sequence_step(std::shared_ptr<detail::step_state> state) noexcept : state_(std::move(state)) {}

  std::shared_ptr<detail::step_state> state_;
};

GHOSTLINK_NAMESPACE_END
