#pragma once
// The fan-out of a sequence operation: one request per layer, handed to
// each layer's actor, and the operation completed once, when the last
// layer's request has completed (sequence.cpp decides each stage's end).
//
// Threads: a layer's request completes on that layer's strand, inside its
// drain (or inside submit() when the mailbox could not grow), so the parts
// of one operation complete on as many threads as there are layers. The
// countdown `remaining_` decides which one goes on: its acq_rel makes every
// part's result visible to it. The initiating call holds one count of its
// own while it submits, so no part can end the stage (and free the fan-out)
// before the last submission has returned.

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <system_error>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "core/actor.hpp"
#include "ghostlink/error.hpp"
#include "sequence/sequence.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// Layer `layer`'s `tokens` writes in `writes`, which holds them layer by
/// layer (an append's or a step's).
inline std::span<const kv_write> layer_writes(const std::vector<kv_write>& writes, std::size_t layer,
                                              std::size_t tokens) noexcept {
  return std::span<const kv_write>(writes).subspan(layer * tokens, tokens);
}

class fan_out;
class step_state;

/// One layer's request of a sequence operation: its completion reports to
/// the fan-out instead of running a handler.
class layer_part final : public request {
 public:
  template <class Arg>
  layer_part(fan_out& fan, const Arg& arg) noexcept : request(&finish, arg), fan_(fan) {}

  /// The layer's result, once finished.
  error_code result;
  /// True if the layer's actor destroyed the request unapplied.
  bool discarded = false;

 private:
  static void finish(operation* base, const error_code* ec, queueing how);
  fan_out& fan_;
};

/// What an operation is doing now, and so what its last part decides.
enum class stage : unsigned char {
  append,
  undo_append,
  truncate,
  fork,
  begin_step,       // every layer sets aside the step's blocks
  undo_begin_step,  // a begin failed: the layers that set blocks aside free them
  end_step,         // an abandoned step: every layer drops its tokens (no operation to complete)
};

class fan_out {
 public:
  /// `op` may be null (an abandoned step's end: nothing to complete). An
  /// append or a step's begin of `tokens` tokens passes their `ids` (none:
  /// no_token_id for each), which the token-id layer stores.
  /// Throws std::bad_alloc.
  fan_out(std::shared_ptr<sequence_state> seq, sequence_op* op, stage s, std::size_t index, std::size_t tokens,
          std::vector<kv_write> writes = {}, std::shared_ptr<step_state> step = {}, std::span<const token_id> ids = {})
      : seq_(std::move(seq)),
        op_(op),
        parts_(seq_->layers.size()),
        writes_(std::move(writes)),
        step_(std::move(step)),
        stage_(s),
        index_(index),
        tokens_(tokens) {
    if (s != stage::append && s != stage::begin_step) return;
    ids_.resize(tokens);
    id_writes_.resize(tokens);
    for (std::size_t t = 0; t < tokens; ++t) {
      ids_[t] = std::bit_cast<float>(ids.empty() ? no_token_id : ids[t]);
      id_writes_[t] = {index + t, std::span<const float>(&ids_[t], 1), std::span<const float>(&ids_[t], 1)};
    }
  }

  /// The writes of the token-id layer: one id per token.
  std::span<const kv_write> id_writes() const noexcept { return id_writes_; }
  /// The token-id layer's index among the parts (after the model's layers).
  std::size_t ids_layer() const noexcept { return seq_->ids_layer(); }

  /// An append of several tokens: layer `i`'s writes (its part's entries,
  /// which live as long as the fan-out).
  std::span<const kv_write> writes_of(std::size_t i) const noexcept { return layer_writes(writes_, i, tokens_); }

  /// Submits the current stage's part `arg_of(i)` to model layer `i` and
  /// `id_arg` to the token-id layer, for every `i` that `wanted(i)` accepts,
  /// cancellable through `cancel`, then ends the stage if every part already
  /// finished.
  template <class ArgOf, class IdArg, class Wanted>
  void start(ArgOf arg_of, const IdArg& id_arg, const ref_ptr<cancel_state>& cancel, Wanted wanted) {
    std::size_t count = 0;
    for (std::size_t i = 0; i < parts_.size(); ++i) {
      if (!wanted(i)) continue;
      if (i == ids_layer())
        parts_[i].emplace(*this, id_arg).watch(cancel);
      else
        parts_[i].emplace(*this, arg_of(i)).watch(cancel);
      ++count;
    }
    remaining_.store(count + 1, std::memory_order_relaxed);  // + 1: ours, while submitting
    for (std::size_t i = 0; i < parts_.size(); ++i)
      // NOLINTNEXTLINE(bugprone-unchecked-optional-access): checked on the same line
      if (parts_[i].has_value()) submit(*seq_->layers[i], &*parts_[i], urgency::batch);
    arrive(queueing::post);
  }

  /// Sets the operation to complete, for a fan-out made before it (a
  /// step's end).
  void set_operation(sequence_op* op) noexcept { op_ = op; }

  /// One part (or the submitter) is done; the last one ends the stage.
  void arrive(queueing how) {
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) end_stage(how);
  }

 private:
  error_code first_error() const noexcept {
    for (const auto& p : parts_)
      if (p && p->result) return p->result;
    return {};
  }
  bool any_discarded() const noexcept {
    return std::any_of(parts_.begin(), parts_.end(), [](const auto& p) { return p && p->discarded; });
  }
  /// Whether a part of this stage applied (took its layer's part).
  bool any_applied() const noexcept {
    return std::any_of(parts_.begin(), parts_.end(), [](const auto& p) { return p && !p->result; });
  }
  /// Starts the undo stage `s` (a truncate to `index_`, as `drop`) on the
  /// layers whose part applied, failing with `ec` once it ends.
  template <class Arg>
  void undo(stage s, error_code ec, const Arg& drop);

  void end_stage(queueing how);
  /// Frees the fan-out, then completes the operation: the last thing done.
  void complete(error_code ec, queueing how);

  const std::shared_ptr<sequence_state> seq_;
  sequence_op* op_;
  std::vector<std::optional<layer_part>> parts_;  // engaged: submitted in the current stage
  const std::vector<kv_write> writes_;             // an append of several tokens: tokens_ per layer, layer by layer
  std::vector<float> ids_;                          // an append or begin: its token ids, bit for bit
  std::vector<kv_write> id_writes_;                 // the token-id layer's writes of ids_
  std::shared_ptr<step_state> step_;                // begin_step: the step begun
  stage stage_;
  const std::size_t index_;   // append, step: the first token's index; truncate: the size kept
  const std::size_t tokens_;  // append, step: tokens appended
  error_code failure_;   // an undo stage: why the operation failed
  std::atomic<std::size_t> remaining_{0};
};

/// Starts stage `s` of `op` on every layer, layer `i` given `arg_of(*fan,
/// i)`, or fails `op` with capacity_exhausted if the fan-out cannot be
/// allocated. `busy` is set. An append of `tokens` tokens passes their
/// writes (`writes`, when more than one) for the fan-out to keep; a step's
/// begin passes its step.
template <class ArgOf, class IdArgOf>
void fan_out_to_layers(const std::shared_ptr<sequence_state>& seq, sequence_op* op, stage s, std::size_t index,
                       ArgOf arg_of, IdArgOf id_arg_of, std::size_t tokens = 0, std::vector<kv_write> writes = {},
                       std::shared_ptr<step_state> step = {}, std::span<const token_id> ids = {}) {
  fan_out* fan = nullptr;
  try {
    fan = new fan_out(seq, op, s, index, tokens, std::move(writes), std::move(step), ids);
  } catch (const std::bad_alloc&) {
    seq->end();
    return op->complete(kv_errc::capacity_exhausted, queueing::post);
  }
  fan->start([&](std::size_t i) { return arg_of(*fan, i); }, id_arg_of(*fan), op->cancellation(),
             [](std::size_t) { return true; });
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
