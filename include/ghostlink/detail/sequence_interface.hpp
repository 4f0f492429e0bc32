#pragma once
// The untyped interface between a sequence's templates and its machinery in
// src/sequence/sequence.hpp: a handle holds a `std::shared_ptr<sequence_state>` and
// reaches it only through these functions. Each operation is one
// sequence_op (holding the user's handler, type-erased once) that the state
// hands to the sequence's actor as one request for every layer, and
// completes once.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <system_error>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/block_pool.hpp"
#include "ghostlink/detail/layer_interface.hpp"  // the actor, the pool, the completion piece
#include "ghostlink/layout.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class sequence_state;
class step_state;

/// One append, truncate, fork or step operation of a sequence.
class sequence_op : public operation {
 public:
  /// A fork's new sequence, set by the sequence state when the fork succeeds.
  std::shared_ptr<sequence_state> forked;
  /// A begun step, set by the sequence state when the begin succeeds.
  std::shared_ptr<step_state> step;

 protected:
  explicit sequence_op(finish_fn finish) noexcept : operation(finish) {}
  ~sequence_op() = default;
};

/// One operation across a batch of sequences or steps (a layer's writes,
/// begins, commits): it completes once, with each one's result.
class batch_op : public operation {
 public:
  /// Each one's result, in order.
  std::vector<error_code> results;
  /// A batch of begins: each sequence's step, in order (null where its
  /// begin failed).
  std::vector<std::shared_ptr<step_state>> steps;

 protected:
  explicit batch_op(finish_fn finish) noexcept : operation(finish) {}
  ~batch_op() = default;
};

/// Turns a finished batch_op into the handler's second argument.
struct take_results {
  std::vector<error_code> operator()(batch_op& op) const noexcept { return std::move(op.results); }
};

/// The empty layers of `model`, of `config`, on strands of `ex`, accepting
/// writes without an initialize, with blocks from `pool` (a private pool
/// whose budget is `config.max_blocks` for every layer together if null).
/// @throws std::system_error(kv_errc::invalid_config) for a bad layout
///         (see validate(const kv_model_layout&)) or as make_actor().
std::shared_ptr<sequence_state> make_sequence(asio::any_io_executor ex, const kv_model_layout& model,
                                              const kv_cache_config& config, element_codec codec,
                                              const kv_block_pool* pool);

/// Moves `r`'s blocks into the sequence's budget account.
/// @throws std::system_error(kv_errc::invalid_config) if `r` is of another pool.
void use_reservation(const sequence_state& s, kv_block_reservation& r);

std::size_t num_layers(const sequence_state& s) noexcept;
/// The config the sequence was made with.
const kv_cache_config& config_of(const sequence_state& s) noexcept;
/// The layout the sequence was made with.
const kv_model_layout& layout_of(const sequence_state& s) noexcept;
/// The executor the sequence was made from.
const asio::any_io_executor& io_executor(const sequence_state& s) noexcept;
/// Tokens of the last completed append or truncate (or fork).
std::size_t size_of(const sequence_state& s) noexcept;
/// The sequence's actor: its layer `i` is model layer `i`; one more, last,
/// holds the token ids (one float per token, an id's bits).
const std::shared_ptr<actor>& group_of(const sequence_state& s) noexcept;
/// The sequence's latest published state, every layer of it (the token
/// ids' last), all showing the same tokens: one pin of the group's state.
/// Throws std::bad_alloc.
std::vector<pinned_epoch> pin_all(const sequence_state& s);
/// The first error of `results`, or none.
error_code first_error(std::span<const error_code> results) noexcept;

/// Each takes ownership of `op` and completes it exactly once, never inside
/// this call. They throw only if queueing an early completion does.
void start_append(const std::shared_ptr<sequence_state>& s, sequence_op* op,
                  std::span<const std::span<const float>> keys, std::span<const std::span<const float>> values,
                  std::span<const token_id> ids);
void start_truncate(const std::shared_ptr<sequence_state>& s, sequence_op* op, std::size_t n);
void start_fork(const std::shared_ptr<sequence_state>& s, sequence_op* op);
void start_begin_step(const std::shared_ptr<sequence_state>& s, sequence_op* op, std::size_t tokens,
                      std::span<const token_id> ids);
/// Begins a step of `tokens` tokens on each sequence of `seqs` (or of
/// `ids[i].size()` tokens with those ids, if `ids` is not empty), completing
/// `op` once, with each begin's result and step.
void start_begin_steps(std::span<const std::shared_ptr<sequence_state>> seqs, batch_op* op, std::size_t tokens,
                       std::span<const std::span<const token_id>> ids);
/// Commits every step of `steps` (null: an empty handle, step_closed),
/// completing `op` once, with each commit's result.
void start_commit_all(std::span<step_state* const> steps, batch_op* op);
/// A step's write on the calling thread (see basic_sequence_step::write).
error_code write_step(step_state& step, std::size_t layer, std::span<const float> keys,
                      std::span<const float> values) noexcept;
/// write_step(), then `op` completes with its result.
void start_step_write(step_state& step, sequence_op* op, std::size_t layer, std::span<const float> keys,
                      std::span<const float> values);
/// Layer `layer` with the step's tokens once its write has stored them,
/// else as the sequence last published it.
pinned_epoch pin_step(const step_state& step, std::size_t layer) noexcept;
void start_commit(const std::shared_ptr<step_state>& step, sequence_op* op);
/// Writes layer `layer` of every step of `steps` (step `i` from `keys[i]`,
/// `values[i]`) on the calling thread, completing `op` once.
void start_write_layer(std::span<step_state* const> steps, batch_op* op, std::size_t layer,
                       std::span<const std::span<const float>> keys, std::span<const std::span<const float>> values);
void start_abandon(const std::shared_ptr<step_state>& step, sequence_op* op);

/// Ends an open step unchanged (its tokens dropped from every layer, in the
/// background); nothing once committed or ended.
void abandon(step_state& step) noexcept;
/// The step's first token (its sequence's size when it began).
std::size_t step_index(const step_state& step) noexcept;
/// The step's tokens per layer.
std::size_t step_tokens(const step_state& step) noexcept;
const std::shared_ptr<sequence_state>& sequence_of(const step_state& step) noexcept;

}  // namespace detail
GHOSTLINK_NAMESPACE_END
