#pragma once
// What the handles of one sequence share: its layers' actors and its size,
// behind detail/sequence_interface.hpp. The operations (sequence.cpp) fan one
// request out to every layer's actor and complete the user's operation once.
//
// Invariants:
// - `busy` admits one append, truncate, fork or step at a time (a step
//   holds it from its begin until it commits or ends, src/sequence/step.hpp):
//   whoever sets it owns `size` until it clears it (release), and the next
//   owner's setting (acquire) sees what it stored.
// - `drops` counts completed removals of tokens (a truncate, the undo of a
//   failed append, a step's begin and its end without commit), each bumped after every layer has published it and
//   before the next operation can start. A snapshot pins the layers one by
//   one; taking the shortest is enough while tokens are only added (every
//   layer's first `min` tokens are the same tokens), but a removal followed
//   by a new append at the same index between two pins would mix an old and
//   a new token. A snapshot therefore pins again if `drops` changed.
// - `bound` caps what a sequence snapshot shows. It is `no_bound` except
//   while a step is open, when it is the step's first index: a step's
//   tokens show once it commits, though every layer may hold them before.
//   The step's begin sets it before any of its writes is submitted; its
//   commit or end lifts it (release) after `size` is stored or the layers
//   have dropped the tokens.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/config.hpp"
#include "ghostlink/detail/sequence_interface.hpp"
#include "ghostlink/element.hpp"
#include "memory/block.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class sequence_state {
 public:
  /// Gives every model layer the sequence's budget account.
  sequence_state(asio::any_io_executor ex, const kv_cache_config& config, std::vector<std::shared_ptr<actor>> layers,
                 std::size_t size);

  /// The model's layers; `layers` holds one more, last: the token ids'.
  std::size_t model_layers() const noexcept { return layers.size() - 1; }
  /// The token-id layer's index in `layers`.
  std::size_t ids_layer() const noexcept { return model_layers(); }

  bool try_begin() noexcept { return !busy.exchange(true, std::memory_order_acquire); }
  /// Records a completed removal (see `drops`); release: a snapshot that
  /// pins an epoch published after it sees the count.
  void dropped() noexcept { drops.fetch_add(1, std::memory_order_release); }
  void end() noexcept { busy.store(false, std::memory_order_release); }

  static constexpr std::size_t no_bound = static_cast<std::size_t>(-1);

  const asio::any_io_executor executor;
  const kv_cache_config config;  // as the user gave it (the layers' may leave the budget to the pool)
  // The model's layers, then one layer of token ids (one float per token,
  // an id's bits), which every operation treats as one more layer.
  const std::vector<std::shared_ptr<actor>> layers;
  std::atomic<std::size_t> size;  // tokens of the last completed append, truncate or fork
  std::atomic<bool> busy{false};
  std::atomic<std::uint64_t> drops{0};
  std::atomic<std::size_t> bound{no_bound};
  // Budget reserved for the sequence (use_reservation), which its layers'
  // allocations draw on first; the same object for the sequence's life.
  const ref_ptr<block_account> account;
};

/// A sequence of `config` whose layer `l` starts with `blocks[l]` (full
/// blocks of another owner, the same number in every layer) and whose
/// token ids are `ids` (one per token of those blocks). Throws std::bad_alloc.
std::shared_ptr<sequence_state> make_attached_sequence(asio::any_io_executor ex, const kv_cache_config& config,
                                                       element_codec codec, const ref_ptr<block_pool>& pool,
                                                       std::vector<std::vector<ref_ptr<block>>> blocks,
                                                       std::span<const token_id> ids);

/// Starts an operation adding `tokens` tokens (an append, a step's begin)
/// with `ids` (none, or one per token): sets `busy` and returns the index of
/// the first token; or, completing `op` with its error (length_mismatch,
/// operation_in_progress, index_out_of_range) and leaving `busy` as it was,
/// returns nothing.
std::optional<std::size_t> begin_adding(sequence_state& seq, sequence_op* op, std::size_t tokens,
                                        std::span<const token_id> ids);

}  // namespace detail
GHOSTLINK_NAMESPACE_END
