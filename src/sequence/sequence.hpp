#pragma once
// What the handles of one sequence share: its actor (src/core/actor.hpp),
// which owns every model layer and the layer of token ids as one group,
// and its size, behind detail/sequence_interface.hpp. Each operation
// (sequence.cpp, step.cpp) is one request to that actor, applied to every
// layer in one drain and published once.
//
// Invariants:
// - `busy` admits one append, truncate, fork or step at a time (a step
//   holds it from its begin until it commits or ends, src/sequence/step.hpp):
//   whoever sets it owns `size` until it clears it (release), and the next
//   owner's setting (acquire) sees what it stored.
// - The sequence's size is the size of its group's latest state (size()),
//   the state snapshot() pins: a snapshot shows exactly size() tokens of
//   the same moment, never fewer than size() read before it nor more than
//   size() read after it (while tokens are only added). The
//   layers' working states may hold more only between a step's begin and
//   its end (the step's positions, published by its commit or cut off by
//   its end); an operation that adds tokens cuts anything past size()
//   first (set_aside), and a fork forks size() tokens.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "core/actor.hpp"
#include "ghostlink/config.hpp"
#include "ghostlink/detail/sequence_interface.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/error.hpp"
#include "ghostlink/layout.hpp"
#include "memory/block.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class sequence_state {
 public:
  /// Gives every model layer the sequence's budget account.
  sequence_state(asio::any_io_executor ex, const kv_cache_config& config, kv_model_layout layout,
                 std::shared_ptr<actor> group);

  /// The model's layers; the group holds one more, last: the token ids'.
  std::size_t model_layers() const noexcept { return group->layers() - 1; }
  /// The token-id layer's index in the group.
  std::size_t ids_layer() const noexcept { return model_layers(); }

  /// Tokens the latest published state holds.
  std::size_t size() const noexcept { return group->pin_group()->layers.back()->size; }
  bool try_begin() noexcept { return !busy.exchange(true, std::memory_order_acquire); }
  void end() noexcept { busy.store(false, std::memory_order_release); }

  const asio::any_io_executor executor;
  const kv_cache_config config;  // as the user gave it (the layers' may leave the budget to the pool)
  const kv_model_layout layout;  // one entry per model layer (the group's working states hold their windows)
  // The model's layers, then one layer of token ids (one float per token,
  // an id's bits), which every request treats as one more layer.
  const std::shared_ptr<actor> group;
  std::atomic<bool> busy{false};
  // Budget reserved for the sequence (use_reservation), which its layers'
  // allocations draw on first; the same object for the sequence's life.
  const ref_ptr<block_account> account;
};

/// What a sequence's request is.
enum class stage : unsigned char { append, truncate, fork, begin_step, commit_step, end_step };

/// A sequence operation's one request to its group: its completion updates
/// the sequence (its size, `busy`, the fork or the step it made), then
/// completes the user's operation (if any: a step's end in the background
/// has none). It owns what its writes point into.
class sequence_request final : public group_request {
 public:
  /// An append of `tokens` tokens per layer: `writes` holds one write per
  /// layer of those tokens, the token ids' last, pointing into `ids`.
  sequence_request(std::shared_ptr<sequence_state> seq, sequence_op* op, std::size_t tokens,
                   std::vector<kv_write> writes, std::vector<float> ids) noexcept;
  /// A step's begin, whose token-id write is `ids_write` (into `ids`).
  sequence_request(std::shared_ptr<sequence_state> seq, sequence_op* op, begin_step_args a, const kv_write& ids_write,
                   std::vector<float> ids, std::shared_ptr<step_state> step) noexcept;
  /// A truncate to `size` (or a step's end, `s` end_step, to its index).
  sequence_request(std::shared_ptr<sequence_state> seq, sequence_op* op, stage s, truncate_args a) noexcept;
  sequence_request(std::shared_ptr<sequence_state> seq, sequence_op* op, fork_args a) noexcept;
  /// A step's commit.
  explicit sequence_request(std::shared_ptr<sequence_state> seq) noexcept;

  /// The operation to complete (set later for a step's commit and end).
  sequence_op* op;

 private:
  static void finish(operation* base, const error_code* ec, queueing how);

  const std::shared_ptr<sequence_state> seq_;
  const stage stage_;
  std::vector<kv_write> writes_;
  std::vector<float> ids_;             // the token ids, bit for bit
  std::shared_ptr<step_state> step_;  // begin_step: the step begun
};

/// Hands the request `make` returns (new, owned by the group from then on)
/// to `seq`'s group; `op`'s completion follows from its. Fails `op` with
/// capacity_exhausted (and clears `busy`) if `make` cannot allocate.
///
/// `u`: `here` for a step's begin, which the forward pass awaits (applied
/// on this thread when the actor is idle, as a lock's holder does the work)
/// unless its handler can be cancelled (so that a cancellation may still
/// reach the request before the actor takes it); `now` for the others,
/// whose completion, not their application, frees the sequence for the
/// next operation (they are in progress until their handler is queued).
template <class Make>
void submit_to_group(const std::shared_ptr<sequence_state>& seq, sequence_op* op, urgency u, Make make) {
  sequence_request* r = nullptr;
  try {
    r = make();
  } catch (const std::bad_alloc&) {
    seq->end();
    return op->complete(kv_errc::capacity_exhausted, queueing::post);
  }
  r->watch(op->cancellation());
  submit(*seq->group, r, u);
}

/// A sequence of `config` and `layout` whose layer `l` starts with
/// `blocks[l]` (full blocks of another owner, the same number in every
/// layer; null where a windowed layer holds none, then `kept_from[l]` says
/// from where it holds them) and whose token ids are `ids` (one per token
/// of those blocks). Throws std::bad_alloc.
std::shared_ptr<sequence_state> make_attached_sequence(asio::any_io_executor ex, const kv_cache_config& config,
                                                       const kv_model_layout& layout, element_codec codec,
                                                       const ref_ptr<block_pool>& pool,
                                                       std::vector<std::vector<ref_ptr<block>>> blocks,
                                                       std::span<const token_id> ids,
                                                       std::span<const std::size_t> kept_from = {});

/// Starts an operation adding `tokens` tokens (an append, a step's begin)
/// with `ids` (none, or one per token): sets `busy` and returns the index of
/// the first token; or, completing `op` with its error (length_mismatch,
/// operation_in_progress, index_out_of_range) and leaving `busy` as it was,
/// returns nothing.
std::optional<std::size_t> begin_adding(sequence_state& seq, sequence_op* op, std::size_t tokens,
                                        std::span<const token_id> ids);

/// The token-id layer's write of `tokens` tokens from `index`: their ids
/// (none: no_token_id for each) bit for bit into `bits`, which it points
/// into. Throws std::bad_alloc.
kv_write id_write(std::size_t index, std::size_t tokens, std::span<const token_id> ids, std::vector<float>& bits);

}  // namespace detail
GHOSTLINK_NAMESPACE_END
