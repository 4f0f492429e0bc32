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
/// (read your writes).
///
/// A step that ends without a commit is undone: every layer drops its
/// tokens, and the sequence is as before the step. `async_abandon()` does
/// so and completes when the sequence is free for its next operation.
/// Destroying an open step, moving over it, or `abandon()` do so in the
/// background: until every layer has dropped the tokens (one drain of each
/// layer), the sequence's operations fail with `operation_in_progress`.
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

  /// Pins layer `layer`'s latest epoch (`layer < num_layers()`), narrowed to
  /// the sequence's tokens plus the step's, once that layer's write has
  /// published them: `index()` tokens before, `index() + size()` after.
  /// Lock-free, as `basic_layer_kv_cache::snapshot()`.
  snapshot_type snapshot(std::size_t layer) const noexcept {
    const auto& seq = *detail::sequence_of(*state_);
    return detail::cache_access::adopt<snapshot_type>(detail::pin(*detail::layer_of(seq, layer)))
        .prefix(index() + size());
  }

  /// Layer `layer`'s tokens before the step (`layer < num_layers()`): its
  /// latest epoch narrowed to `index()` tokens, whether or not the layer's
  /// write has published the step's. What a forward pass attends with the
  /// step's tokens pending (`ghostlink::attend`), so that it need not wait
  /// for the write. Lock-free, as `snapshot()`.
  snapshot_type snapshot_before(std::size_t layer) const noexcept { return snapshot(layer).prefix(index()); }

  /// Writes layer `layer`'s `size()` tokens: `keys` and `values` hold
  /// `size() * token_width()` floats each, token-major (token `index()`
  /// first). Each layer is written once per step, as one request to its
  /// actor; writes to different layers run in parallel. The spans must stay
  /// valid until completion. Completion signature: `void(std::error_code)`,
  /// once the layer has published the tokens (`snapshot(layer)` then shows
  /// them). Errors: `layer_mismatch` (`layer >= num_layers()`),
  /// `length_mismatch`, `width_mismatch`, `operation_in_progress` (the
  /// layer's write is in progress or done, or a commit is waiting),
  /// `step_closed` (after the commit),
  /// `capacity_exhausted` only if memory for a page table was refused;
  /// `asio::error::operation_aborted` if cancelled before the layer's actor
  /// took it. On error the layer is as before, and may be written again.
  ///
  /// @param layer  the layer, below `num_layers()`.
  /// @param keys   `size() * token_width()` floats.
  /// @param values `size() * token_width()` floats.
  /// @param token  the completion token; none is needed to `co_await`.
  template <class CompletionToken = default_completion_token>
  auto async_write(std::size_t layer, std::span<const float> keys, std::span<const float> values,
                   CompletionToken&& token = default_completion_token()) const;

  /// Makes the step's tokens part of the sequence: `size()` grows by
  /// `size()` and sequence snapshots show them, all at once. The commit
  /// first waits for every layer's write still in flight, so a forward pass
  /// may start its writes without awaiting them (with `asio::detached`, say)
  /// and await them all at once, here: when the commit completes, every
  /// write started before it has finished with its spans (which may then
  /// be released) and has its handler queued.
  /// Completion signature: `void(std::error_code)`. Errors:
  /// `step_incomplete` (a layer is unwritten once those writes have
  /// settled: never written, or its write failed; the step stays open),
  /// `operation_in_progress` (another commit is waiting), `step_closed`
  /// (committed or ended before). While it waits, the step's writes and
  /// `async_abandon()` fail with `operation_in_progress`; destroying the
  /// handle meanwhile ends the step if the commit then fails. No layer's
  /// actor is involved: the commit needs no round trip through the layers.
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
  /// `values[i]`, as `steps[i].async_write(layer, keys[i], values[i])`
  /// would, all started at once, and completes once when every write has
  /// completed. The steps may belong to any sequences (each once); their
  /// layers' actors apply the writes in parallel.
  ///
  /// Completion signature: `void(std::error_code, std::vector<std::error_code>)`:
  /// the first step's error in order (none if every write succeeded), then
  /// every step's own result, in the order of `steps`. Errors: as
  /// `async_write` for each step; `length_mismatch` (and no write) if `keys`
  /// or `values` do not hold one span per step, `capacity_exhausted` if the
  /// results cannot be allocated. Cancellable: the handler's slot reaches
  /// every write. The spans must stay valid until completion. An empty batch
  /// completes with no error and no result.
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
