// A sequence's operations: one fan-out per operation (fan_out.hpp) hands
// each layer's actor a request of its own and completes the user's
// operation once, when the last layer's request has completed. Steps are in
// step.cpp; their begin and end are fan-out stages decided here.

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
#include "sequence/fan_out.hpp"
#include "sequence/step.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

void layer_part::finish(operation* base, const error_code* ec, queueing how) {
  auto* self = static_cast<layer_part*>(base);
  if (ec)
    self->result = *ec;
  else
    self->discarded = true;
  self->fan_.arrive(how);
}

void fan_out::complete(error_code ec, queueing how) {
  sequence_op* const op = op_;
  const bool discard = any_discarded();
  delete this;
  if (!op) return;
  if (discard)
    op->discard();
  else
    op->complete(ec, how);
}

template <class Arg>
void fan_out::undo(stage s, error_code ec, const Arg& drop) {
  std::vector<bool> took(parts_.size());
  for (std::size_t i = 0; i < parts_.size(); ++i)
    // NOLINTNEXTLINE(bugprone-unchecked-optional-access): checked on the same line
    took[i] = parts_[i].has_value() && !parts_[i]->result;
  for (auto& p : parts_) p.reset();
  stage_ = s;
  failure_ = ec;
  start([&](std::size_t) { return drop; }, drop, {}, [&](std::size_t i) { return took[i]; });
}

void fan_out::end_stage(queueing how) {
  sequence_state& seq = *seq_;
  if (any_discarded()) {  // an actor shut down with the operation in its mailbox
    if (stage_ == stage::end_step) seq.bound.store(sequence_state::no_bound, std::memory_order_release);
    seq.end();
    return complete({}, how);
  }
  switch (stage_) {
    case stage::append:
      if (error_code ec = first_error()) {
        // Drop the token again from the layers that took it. Without memory
        // to, it stays where it was stored, hidden (other layers lack it)
        // until the next append overwrites it.
        return undo(stage::undo_append, ec, truncate_args{index_});
      }
      seq.size.store(index_ + tokens_, std::memory_order_release);
      seq.end();
      return complete({}, how);
    case stage::undo_append:
      seq.dropped();
      seq.end();
      return complete(failure_, how);
    case stage::truncate: {
      // One layer truncated is enough for the sequence to be: a layer that
      // could not keeps its extra tokens hidden (snapshots show the shortest
      // layer) until appends overwrite them.
      const bool any = any_applied();
      if (any) {
        seq.size.store(index_, std::memory_order_release);
        seq.dropped();
      }
      seq.end();
      return complete(any ? error_code() : first_error(), how);
    }
    case stage::fork: {
      seq.end();
      error_code ec = first_error();
      if (!ec) {
        try {
          std::vector<std::shared_ptr<actor>> layers;
          layers.reserve(parts_.size());
          // NOLINTNEXTLINE(bugprone-unchecked-optional-access): every layer had a part in this stage
          for (auto& p : parts_) layers.push_back(std::move(p->forked));
          op_->forked = std::make_shared<sequence_state>(seq.executor, seq.config, std::move(layers), index_);
        } catch (const std::bad_alloc&) {
          ec = kv_errc::capacity_exhausted;
        }
      }
      return complete(ec, how);  // the forks of layers that did fork go with the fan-out
    }
    case stage::begin_step:
      if (error_code ec = first_error()) return undo(stage::undo_begin_step, ec, set_aside_args{index_, 0});
      // The layers dropped any hidden token from index_ on (a snapshot that
      // pinned one before must pin again); the step's tokens stay hidden
      // until its commit. The sequence stays busy until the step ends.
      seq.bound.store(index_, std::memory_order_release);
      seq.dropped();
      op_->step = std::move(step_);
      return complete({}, how);
    case stage::undo_begin_step:
      seq.dropped();
      seq.end();
      return complete(failure_, how);
    case stage::end_step:
      // A layer that could not drop the tokens (no memory for its page
      // table) keeps them hidden behind those that did; if none did, the
      // bound stays, so no snapshot shows them.
      if (any_applied()) {
        seq.dropped();
        seq.bound.store(sequence_state::no_bound, std::memory_order_release);
      }
      seq.end();
      return complete({}, how);
  }
}

namespace {

/// The tokens an append carries per layer (at least one, the same for
/// every layer), or its error.
std::pair<error_code, std::size_t> check_append(std::size_t layers, std::size_t width,
                                                std::span<const std::span<const float>> keys,
                                                std::span<const std::span<const float>> values) noexcept {
  if (keys.size() != layers || values.size() != layers) return {kv_errc::layer_mismatch, 0};
  const std::size_t floats = keys[0].size();
  for (std::size_t i = 0; i < layers; ++i) {
    if (keys[i].size() != values[i].size()) return {kv_errc::length_mismatch, 0};
    if (keys[i].size() != floats || floats == 0 || floats % width != 0) return {kv_errc::width_mismatch, 0};
  }
  return {{}, floats / width};
}

}  // namespace

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
  const std::size_t index = seq.size.load(std::memory_order_relaxed);
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
  const auto [ec, tokens] = check_append(seq.model_layers(), width, keys, values);
  if (ec) return op->complete(ec, queueing::post);
  const std::optional<std::size_t> first = begin_adding(seq, op, tokens, ids);
  if (!first) return;
  const std::size_t index = *first;
  if (tokens == 1) {  // a decode step: the request holds its single write
    fan_out_to_layers(
        s, op, stage::append, index,
        [&](const fan_out&, std::size_t i) {
          return kv_write{index, keys[i], values[i]};
        },
        [](const fan_out& fan) { return fan.id_writes()[0]; }, 1, {}, {}, ids);
    return;
  }
  // A prefill chunk: each layer's part is one batch of the tokens, kept by
  // the fan-out until the parts complete.
  std::vector<kv_write> writes;
  try {
    writes.reserve(seq.model_layers() * tokens);
  } catch (const std::bad_alloc&) {
    seq.end();
    return op->complete(kv_errc::capacity_exhausted, queueing::post);
  }
  for (std::size_t i = 0; i < seq.model_layers(); ++i)
    for (std::size_t t = 0; t < tokens; ++t)
      writes.push_back({index + t, keys[i].subspan(t * width, width), values[i].subspan(t * width, width)});
  fan_out_to_layers(
      s, op, stage::append, index, [](const fan_out& fan, std::size_t i) { return fan.writes_of(i); },
      [](const fan_out& fan) { return fan.id_writes(); }, tokens, std::move(writes), {}, ids);
}

void start_truncate(const std::shared_ptr<sequence_state>& s, sequence_op* op, std::size_t n) {
  sequence_state& seq = *s;
  if (!seq.try_begin()) return op->complete(kv_errc::operation_in_progress, queueing::post);
  if (n >= seq.size.load(std::memory_order_relaxed)) {
    seq.end();
    return op->complete({}, queueing::post);
  }
  fan_out_to_layers(
      s, op, stage::truncate, n, [n](const fan_out&, std::size_t) { return truncate_args{n}; },
      [n](const fan_out&) { return truncate_args{n}; });
}

void start_fork(const std::shared_ptr<sequence_state>& s, sequence_op* op) {
  sequence_state& seq = *s;
  if (!seq.try_begin()) return op->complete(kv_errc::operation_in_progress, queueing::post);
  fan_out_to_layers(
      s, op, stage::fork, seq.size.load(std::memory_order_relaxed),
      [](const fan_out&, std::size_t) { return fork_args{}; }, [](const fan_out&) { return fork_args{}; });
}

// The rest of the untyped interface of detail/sequence_interface.hpp.

sequence_state::sequence_state(asio::any_io_executor ex, const kv_cache_config& config,
                               std::vector<std::shared_ptr<actor>> layers, std::size_t size)
    : executor(std::move(ex)),
      config(config),
      layers(std::move(layers)),
      size(size),
      account(
          ref_ptr<block_account>::adopt(new block_account(ref_ptr<block_pool>::share(&this->layers.front()->pool())))) {
  for (std::size_t i = 0; i < model_layers(); ++i) this->layers[i]->use_account(account);
}

namespace {

/// The layer of a sequence's token ids: one float per token (an id's bits),
/// in blocks of a pool of its own, outside the budget of the model's keys
/// and values; holding `ids` from token 0.
std::shared_ptr<actor> make_ids_layer(const asio::any_io_executor& ex, const kv_cache_config& config,
                                      std::span<const token_id> ids) {
  const kv_cache_config ids_config{
      .max_tokens_per_seq = config.max_tokens_per_seq, .num_heads = 1, .head_dim = 1, .block_tokens = 256};
  auto layout = ref_ptr<const block_layout>::adopt(new block_layout(ids_config, codec_of<float>));
  auto pool = pool_access::state(kv_block_pool(layout->block_bytes));
  auto state = std::make_unique<working_state>(ids_config, std::move(layout), std::move(pool), true);
  // In runs of one block's tokens: a buffer of that size, not one per id.
  const std::size_t run = std::min(ids.size(), ids_config.block_tokens);
  std::vector<float> bits(run);
  std::vector<kv_write> writes(run);
  for (std::size_t first = 0; first < ids.size(); first += run) {
    const std::size_t n = std::min(run, ids.size() - first);
    for (std::size_t t = 0; t < n; ++t) {
      bits[t] = std::bit_cast<float>(ids[first + t]);
      writes[t] = {first + t, std::span<const float>(&bits[t], 1), std::span<const float>(&bits[t], 1)};
    }
    // The ids' own pool has no budget: only memory can fail.
    if (state->write(std::span(writes).first(n))) throw std::bad_alloc();
  }
  return std::make_shared<actor>(ex, std::move(state));
}

}  // namespace

std::shared_ptr<sequence_state> make_sequence(asio::any_io_executor ex, std::size_t num_layers,
                                              const kv_cache_config& config, element_codec codec,
                                              const kv_block_pool* pool) {
  if (num_layers == 0) throw std::system_error(make_error_code(kv_errc::invalid_config));
  // A private pool holds the whole sequence's budget; layers on a pool leave
  // the budget to it.
  ref_ptr<block_pool> shared;
  kv_cache_config layer_config = config;
  if (pool) {
    shared = pool_access::state(*pool);
  } else {
    validate(config, codec.size);
    shared =
        pool_access::state(kv_block_pool(block_layout(config, codec).block_bytes, {.max_blocks = config.max_blocks}));
    layer_config.max_blocks = kv_cache_config{}.max_blocks;
  }
  std::vector<std::shared_ptr<actor>> layers;
  layers.reserve(num_layers + 1);
  for (std::size_t i = 0; i < num_layers; ++i) layers.push_back(actor::make(ex, layer_config, codec, shared, true));
  layers.push_back(make_ids_layer(ex, config, {}));
  return std::make_shared<sequence_state>(std::move(ex), config, std::move(layers), 0);
}

std::shared_ptr<sequence_state> make_attached_sequence(asio::any_io_executor ex, const kv_cache_config& config,
                                                       element_codec codec, const ref_ptr<block_pool>& pool,
                                                       std::vector<std::vector<ref_ptr<block>>> blocks,
                                                       std::span<const token_id> ids) {
  std::vector<std::shared_ptr<actor>> layers;
  layers.reserve(blocks.size() + 1);
  for (auto& prefix : blocks) layers.push_back(actor::make(ex, config, codec, pool, true, prefix));
  layers.push_back(make_ids_layer(ex, config, ids));
  return std::make_shared<sequence_state>(std::move(ex), config, std::move(layers), ids.size());
}

void use_reservation(const sequence_state& s, kv_block_reservation& r) {
  if (r.empty()) return;
  if (r.pool() != pool_access::handle(ref_ptr<block_pool>::share(&s.layers.front()->pool())))
    throw std::system_error(make_error_code(kv_errc::invalid_config));
  s.account->left.fetch_add(pool_access::release_reservation(r), std::memory_order_relaxed);
}

std::size_t num_layers(const sequence_state& s) noexcept { return s.model_layers(); }
const kv_cache_config& config_of(const sequence_state& s) noexcept { return s.config; }
const asio::any_io_executor& io_executor(const sequence_state& s) noexcept { return s.executor; }
std::size_t size_of(const sequence_state& s) noexcept { return s.size.load(std::memory_order_acquire); }
const std::shared_ptr<actor>& layer_of(const sequence_state& s, std::size_t i) noexcept { return s.layers[i]; }
std::uint64_t removals(const sequence_state& s) noexcept { return s.drops.load(std::memory_order_acquire); }
const std::shared_ptr<actor>& ids_of(const sequence_state& s) noexcept { return s.layers.back(); }
std::size_t visible_bound(const sequence_state& s) noexcept { return s.bound.load(std::memory_order_acquire); }

}  // namespace detail
GHOSTLINK_NAMESPACE_END
