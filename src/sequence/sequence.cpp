// A sequence's operations: each is one request (sequence_request) to the
// sequence's group, whose completion updates the sequence and completes
// the user's operation. Steps are in step.cpp.

#include "sequence/sequence.hpp"
#include "ghostlink/detail/flavour.hpp"

#include <algorithm>
#include <bit>
#include <new>
#include <optional>
#include <system_error>
#include <utility>
#include <vector>

#include "core/actor.hpp"
#include "core/working_state.hpp"
#include "ghostlink/error.hpp"
#include "memory/block.hpp"
#include "memory/block_pool.hpp"
#include "sequence/step.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

sequence_request::sequence_request(std::shared_ptr<sequence_state> seq, sequence_op* op, std::size_t tokens,
                                   std::vector<kv_write> writes, std::vector<float> ids) noexcept
    : group_request(&finish, append_args{tokens}, std::span<const kv_write>(writes)),  // buffers move with vectors
      op(op),
      seq_(std::move(seq)),
      stage_(stage::append),
      writes_(std::move(writes)),
      ids_(std::move(ids)) {}

sequence_request::sequence_request(std::shared_ptr<sequence_state> seq, sequence_op* op, begin_step_args a,
                                   const kv_write& ids_write, std::vector<float> ids,
                                   std::shared_ptr<step_state> step) noexcept
    : group_request(&finish, a, ids_write),  // its spans point into `ids`, whose buffer moves with it
      op(op),
      seq_(std::move(seq)),
      stage_(stage::begin_step),
      ids_(std::move(ids)),
      step_(std::move(step)) {}

sequence_request::sequence_request(std::shared_ptr<sequence_state> seq, sequence_op* op, stage s,
                                   truncate_args a) noexcept
    : group_request(&finish, a), op(op), seq_(std::move(seq)), stage_(s) {}

sequence_request::sequence_request(std::shared_ptr<sequence_state> seq, sequence_op* op, fork_args a) noexcept
    : group_request(&finish, a), op(op), seq_(std::move(seq)), stage_(stage::fork) {}

sequence_request::sequence_request(std::shared_ptr<sequence_state> seq) noexcept
    : group_request(&finish, commit_step_args{}), op(nullptr), seq_(std::move(seq)), stage_(stage::commit_step) {}

void sequence_request::finish(operation* base, const error_code* ec, queueing how) {
  std::unique_ptr<sequence_request> self(static_cast<sequence_request*>(base));
  sequence_state& seq = *self->seq_;
  sequence_op* const op = self->op;
  if (!ec) {  // the group shut down with the request in its mailbox
    seq.end();
    if (op) op->discard();
    return;
  }
  error_code result = *ec;
  switch (self->stage_) {
    case stage::append:
    case stage::commit_step:
    case stage::truncate: seq.end(); break;
    case stage::fork:
      seq.end();
      if (!result) {
        try {
          op->forked = std::make_shared<sequence_state>(seq.executor, seq.config, seq.layout, std::move(self->forked));
        } catch (const std::bad_alloc&) {
          result = kv_errc::capacity_exhausted;  // the forked group goes with the request
        }
      }
      break;
    case stage::begin_step:
      // The sequence stays busy until the step ends.
      if (result) {
        seq.end();
        break;
      }
      self->step_->stage(std::move(self->staged));
      op->step = std::move(self->step_);
      break;
    case stage::end_step:
      // Cut off, or (without memory for a page table) left past `size` for
      // the next operation to cut: either way no published state shows them.
      result = {};
      seq.end();
      break;
  }
  self.reset();
  if (op) op->complete(result, how);
}

namespace {

/// The tokens an append carries per layer (at least one, the same for
/// every layer), or its error. A keys-only layout's values are empty.
std::pair<error_code, std::size_t> check_append(std::size_t layers, std::size_t width, bool keys_only,
                                                std::span<const std::span<const float>> keys,
                                                std::span<const std::span<const float>> values) noexcept {
  if (keys.size() != layers || values.size() != layers) return {kv_errc::layer_mismatch, 0};
  const std::size_t floats = keys[0].size();
  for (std::size_t i = 0; i < layers; ++i) {
    if (values[i].size() != (keys_only ? 0 : keys[i].size())) return {kv_errc::length_mismatch, 0};
    if (keys[i].size() != floats || floats == 0 || floats % width != 0) return {kv_errc::width_mismatch, 0};
  }
  return {{}, floats / width};
}

}  // namespace

kv_write id_write(std::size_t index, std::size_t tokens, std::span<const token_id> ids, std::vector<float>& bits) {
  bits.resize(tokens);
  for (std::size_t t = 0; t < tokens; ++t) bits[t] = std::bit_cast<float>(ids.empty() ? no_token_id : ids[t]);
  return {index, bits, bits};
}

std::optional<std::size_t> begin_adding(sequence_state& seq, sequence_op* op, std::size_t tokens,
                                        std::span<const token_id> ids) {
  if (!ids.empty() && ids.size() != tokens) {
    op->complete(kv_errc::length_mismatch, queueing::post);
    return std::nullopt;
  }
  if (!seq.try_begin()) {
    op->complete(kv_errc::operation_in_progress, queueing::post);
    return std::nullopt;
  }
  const std::size_t index = seq.size();
  if (tokens > seq.config.max_tokens_per_seq - index) {  // size() never passes max_tokens_per_seq
    seq.end();
    op->complete(kv_errc::index_out_of_range, queueing::post);
    return std::nullopt;
  }
  return index;
}

void start_append(const std::shared_ptr<sequence_state>& s, sequence_op* op,
                  std::span<const std::span<const float>> keys, std::span<const std::span<const float>> values,
                  std::span<const token_id> ids) {
  sequence_state& seq = *s;
  const std::size_t width = seq.config.token_width();
  const auto [ec, tokens] = check_append(seq.model_layers(), width, seq.layout.keys_only, keys, values);
  if (ec) return op->complete(ec, queueing::post);
  const std::optional<std::size_t> first = begin_adding(seq, op, tokens, ids);
  if (!first) return;
  const std::size_t index = *first;
  submit_to_group(s, op, urgency::now, [&] {
    // Every layer's tokens, then the token ids'.
    std::vector<float> bits;
    std::vector<kv_write> writes;
    writes.reserve(seq.model_layers() + 1);
    for (std::size_t i = 0; i < seq.model_layers(); ++i) writes.push_back({index, keys[i], values[i]});
    writes.push_back(id_write(index, tokens, ids, bits));
    return new sequence_request(s, op, tokens, std::move(writes), std::move(bits));
  });
}

void start_truncate(const std::shared_ptr<sequence_state>& s, sequence_op* op, std::size_t n) {
  sequence_state& seq = *s;
  if (!seq.try_begin()) return op->complete(kv_errc::operation_in_progress, queueing::post);
  if (n >= seq.size()) {
    seq.end();
    return op->complete({}, queueing::post);
  }
  submit_to_group(s, op, urgency::now, [&] { return new sequence_request(s, op, stage::truncate, truncate_args{n}); });
}

void start_fork(const std::shared_ptr<sequence_state>& s, sequence_op* op) {
  sequence_state& seq = *s;
  if (!seq.try_begin()) return op->complete(kv_errc::operation_in_progress, queueing::post);
  const std::size_t size = seq.size();
  submit_to_group(s, op, urgency::now, [&] { return new sequence_request(s, op, fork_args{size}); });
}

// The rest of the untyped interface of detail/sequence_interface.hpp.

sequence_state::sequence_state(asio::any_io_executor ex, const kv_cache_config& config, kv_model_layout layout,
                               std::shared_ptr<actor> group)
    : executor(std::move(ex)),
      config(config),
      layout(std::move(layout)),
      group(std::move(group)),
      account(ref_ptr<block_account>::adopt(new block_account(ref_ptr<block_pool>::share(&this->group->pool())))) {
  for (std::size_t i = 0; i < model_layers(); ++i) this->group->use_account(i, account);
}

namespace {

/// The layer of a sequence's token ids: one float per token (an id's bits),
/// in blocks of a pool of its own, outside the budget of the model's keys
/// and values; holding `ids` from token 0.
std::unique_ptr<working_state> make_ids_layer(const kv_cache_config& config, std::span<const token_id> ids) {
  const kv_cache_config ids_config{
      .max_tokens_per_seq = config.max_tokens_per_seq, .num_heads = 1, .head_dim = 1, .block_tokens = 256};
  auto layout = ref_ptr<const block_layout>::adopt(new block_layout(ids_config, codec_of<float>));
  auto pool = pool_access::state(kv_block_pool(layout->block_bytes));
  auto state = std::make_unique<working_state>(ids_config, std::move(layout), std::move(pool), true);
  std::vector<float> bits;
  const kv_write all = id_write(0, ids.size(), ids, bits);
  // The ids' own pool has no budget: only memory can fail.
  if (!ids.empty() && state->open(0, ids.size())) throw std::bad_alloc();
  state->store(0, all.keys, all.values);
  return state;
}

/// A group of the model layers of `model` (layer `l` starting with
/// `blocks[l]`, or empty without blocks) and the token ids'.
std::shared_ptr<actor> make_group(asio::any_io_executor ex, const kv_cache_config& config, const kv_model_layout& model,
                                  element_codec codec, const ref_ptr<block_pool>& pool,
                                  std::vector<std::vector<ref_ptr<block>>> blocks, std::span<const token_id> ids,
                                  std::span<const std::size_t> kept_from) {
  auto layout = ref_ptr<const block_layout>::adopt(new block_layout(config, codec, model.keys_only));
  std::vector<std::unique_ptr<working_state>> states;
  states.reserve(model.num_layers() + 1);
  for (std::size_t l = 0; l < model.num_layers(); ++l) {
    states.push_back(std::make_unique<working_state>(config, layout, pool, true,
                                                     blocks.empty() ? std::span<ref_ptr<block>>() : blocks[l]));
    states.back()->use_layer_layout(model.layers[l]);  // before the actor publishes its first epochs
    if (!kept_from.empty()) states.back()->restore_kept_from(kept_from[l]);
  }
  states.push_back(make_ids_layer(config, ids));
  auto group = std::make_shared<actor>(std::move(ex), std::move(states));
  group->use_rollback(model.rollback_tokens);
  return group;
}

}  // namespace

std::shared_ptr<sequence_state> make_sequence(asio::any_io_executor ex, const kv_model_layout& model,
                                              const kv_cache_config& config, element_codec codec,
                                              const kv_block_pool* pool) {
  validate(model);
  validate(config, codec);
  // A private pool holds the whole sequence's budget; layers on a pool leave
  // the budget to it.
  ref_ptr<block_pool> shared;
  kv_cache_config layer_config = config;
  const block_layout blocks(config, codec, model.keys_only);
  if (pool) {
    shared = pool_access::state(*pool);
    if (!blocks.fits(*shared) || config.max_blocks != kv_cache_config{}.max_blocks)
      throw std::system_error(make_error_code(kv_errc::invalid_config));
  } else {
    const kv_block_kind kind = model.keys_only ? kv_block_kind::keys_only : kv_block_kind::keys_and_values;
    shared = pool_access::state(kv_block_pool(blocks.block_bytes, {.max_blocks = config.max_blocks}, kind));
    layer_config.max_blocks = kv_cache_config{}.max_blocks;
  }
  auto group = make_group(ex, layer_config, model, codec, shared, {}, {}, {});
  return std::make_shared<sequence_state>(std::move(ex), config, model, std::move(group));
}

std::shared_ptr<sequence_state> make_attached_sequence(asio::any_io_executor ex, const kv_cache_config& config,
                                                       const kv_model_layout& layout, element_codec codec,
                                                       const ref_ptr<block_pool>& pool,
                                                       std::vector<std::vector<ref_ptr<block>>> blocks,
                                                       std::span<const token_id> ids,
                                                       std::span<const std::size_t> kept_from) {
  auto group = make_group(ex, config, layout, codec, pool, std::move(blocks), ids, kept_from);
  return std::make_shared<sequence_state>(std::move(ex), config, layout, std::move(group));
}

void use_reservation(const sequence_state& s, kv_block_reservation& r) {
  if (r.empty()) return;
  if (r.pool() != pool_access::handle(ref_ptr<block_pool>::share(&s.group->pool())))
    throw std::system_error(make_error_code(kv_errc::invalid_config));
  s.account->left.fetch_add(pool_access::release_reservation(r), std::memory_order_relaxed);
}

std::size_t num_layers(const sequence_state& s) noexcept { return s.model_layers(); }
const kv_cache_config& config_of(const sequence_state& s) noexcept { return s.config; }
const kv_model_layout& layout_of(const sequence_state& s) noexcept { return s.layout; }
const asio::any_io_executor& io_executor(const sequence_state& s) noexcept { return s.executor; }
std::size_t size_of(const sequence_state& s) noexcept { return s.size(); }
const std::shared_ptr<actor>& group_of(const sequence_state& s) noexcept { return s.group; }

std::vector<pinned_epoch> pin_all(const sequence_state& s) {
  std::vector<pinned_epoch> pins;
  pins.reserve(s.group->layers());
  const ref_ptr<group_epoch> state = s.group->pin_group();
  for (const ref_ptr<epoch>& e : state->layers) pins.push_back(epoch_access::pin(e));
  return pins;
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
