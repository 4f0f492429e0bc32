// A sequence's step: its begin (one request staging every layer's epoch),
// its writes (on the callers' threads, into the positions the begin made
// the step's), its commit (one request publishing the staged epochs) and
// its end (one request cutting the step's tokens off).

#include "sequence/step.hpp"
#include "ghostlink/detail/flavour.hpp"

#include <new>
#include <system_error>
#include <utility>

#include "base/fault_countdown.hpp"
#include "core/working_state.hpp"
#include "ghostlink/error.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

step_state::step_state(std::shared_ptr<sequence_state> sequence, std::size_t first, std::size_t n)
    : seq(std::move(sequence)),
      index(first),
      tokens(n),
      readable_(new std::optional<epoch_cell>[seq->model_layers()]),
      written_(new std::atomic<layer_state>[seq->model_layers()]),
      commit_(std::make_unique<sequence_request>(seq)),
      end_(std::make_unique<sequence_request>(seq, nullptr, stage::end_step, truncate_args{first})) {
  for (std::size_t l = 0; l < seq->model_layers(); ++l) written_[l].store(layer_state::unwritten);
  commit_->staged.reserve(seq->group->layers());  // so that the commit's copy cannot fail
}

error_code step_state::write(std::size_t layer, std::span<const float> keys, std::span<const float> values) noexcept {
  switch (phase_.load(std::memory_order_acquire)) {
    case phase::open: break;
    case phase::committing: return kv_errc::operation_in_progress;
    case phase::closed: return kv_errc::step_closed;
  }
  if (layer >= seq->model_layers()) return kv_errc::layer_mismatch;
  if (values.size() != (seq->layout.keys_only ? 0 : keys.size())) return kv_errc::length_mismatch;
  if (keys.size() != tokens * seq->config.token_width()) return kv_errc::width_mismatch;
  in_flight_.fetch_add(1, std::memory_order_acq_rel);
  auto unwritten = layer_state::unwritten;
  if (!written_[layer].compare_exchange_strong(unwritten, layer_state::writing, std::memory_order_acq_rel)) {
    settle();
    return kv_errc::operation_in_progress;
  }
  if (void (*hook)() = step_write_hook.load(std::memory_order_relaxed)) hook();  // tests only
  working_state::store_step(*staged_[layer], index, keys, values);
  // release: whoever sees `written` (pin(), the commit) sees the tokens.
  written_[layer].store(layer_state::written, std::memory_order_release);
  settle();
  return {};
}

void step_state::stage(std::vector<ref_ptr<epoch>> staged) noexcept {
  staged_ = std::move(staged);
  for (std::size_t l = 0; l < seq->model_layers(); ++l) readable_[l].emplace(staged_[l]);
}

ref_ptr<epoch> step_state::pin(std::size_t layer) const noexcept {
  // A written layer's cell was made by stage(), before the step was handed out.
  if (written_[layer].load(std::memory_order_acquire) == layer_state::written)
    return readable_[layer]->pin();  // NOLINT(bugprone-unchecked-optional-access): see above
  return seq->group->pin(layer);
}

void step_state::commit(sequence_op* op) noexcept {
  auto expected = phase::open;
  if (!phase_.compare_exchange_strong(expected, phase::committing, std::memory_order_acq_rel))
    return op->complete(expected == phase::committing ? kv_errc::operation_in_progress : kv_errc::step_closed,
                        queueing::post);
  parked_ = op;
  // With writes in flight, the last to settle concludes.
  if ((in_flight_.fetch_or(parked, std::memory_order_acq_rel) & ~parked) == 0) conclude_if_idle();
}

void step_state::settle() noexcept {
  if (in_flight_.fetch_sub(1, std::memory_order_acq_rel) == (parked | 1)) conclude_if_idle();
}

void step_state::conclude_if_idle() noexcept {
  // Exactly one caller moves the count from `parked` to 0; a write that
  // began meanwhile makes the move fail here, and concludes when it settles.
  std::size_t idle = parked;
  if (in_flight_.compare_exchange_strong(idle, 0, std::memory_order_acq_rel)) conclude(parked_);
}

void step_state::conclude(sequence_op* op) noexcept {
  for (std::size_t l = 0; l < seq->model_layers(); ++l) {
    if (written_[l].load(std::memory_order_acquire) != layer_state::written) {
      phase_.store(phase::open);
      if (abandon_requested_.load()) end(nullptr);
      return op->complete(kv_errc::step_incomplete, queueing::post);
    }
  }
  // Every layer's tokens are stored (acquire above); the commit's drain
  // publishes the staged epochs (release), so readers of the cells see them.
  phase_.store(phase::closed, std::memory_order_release);
  sequence_request* r = commit_.release();
  r->op = op;
  r->staged = staged_;  // into the capacity reserved when the step was made
  submit(*seq->group, r, urgency::here);
}

bool step_state::end(sequence_op* op) noexcept {
  auto open = phase::open;
  if (!phase_.compare_exchange_strong(open, phase::closed, std::memory_order_acq_rel)) return false;
  // Readers of written layers see them as published from now on; the
  // step's blocks go once the group has cut them off.
  for (std::size_t l = 0; l < seq->model_layers(); ++l) {
    std::optional<epoch_cell>& cell = readable_[l];
    if (cell.has_value()) cell->publish(seq->group->pin(l));
  }
  staged_.clear();
  sequence_request* r = end_.release();
  r->op = op;
  submit(*seq->group, r, urgency::here);
  return true;
}

void step_state::abandon(sequence_op* op) noexcept {
  // Bounded: each retry follows a change of phase, which goes one way but
  // for a failed commit's return to open.
  for (;;) {
    switch (phase_.load()) {
      case phase::open:
        if (end(op)) return;
        continue;
      case phase::committing:
        if (op) return op->complete(kv_errc::operation_in_progress, queueing::post);
        abandon_requested_.store(true);
        if (phase_.load() != phase::open) return;  // that commit's failure ends the step, or it commits
        continue;
      case phase::closed:
        if (op) op->complete(kv_errc::step_closed, queueing::post);
        return;
    }
  }
}

namespace {

class batch;

/// One sequence's begin or commit within a batch: its completion reports
/// to the batch.
class batch_member final : public sequence_op {
 public:
  batch_member() noexcept : sequence_op(&finish) {}
  batch* owner = nullptr;
  std::size_t index = 0;

 private:
  static void finish(operation* base, const error_code* ec, queueing how);
};

/// A begin or a commit across a batch of sequences: one member per
/// sequence, and the user's operation completed once, by the last member
/// to finish (the initiating call holds one count of its own while it
/// starts them, so no member can end the batch before the last has
/// started).
class batch {
 public:
  batch(batch_op* op, std::size_t size) : op_(op), members_(new batch_member[size]), remaining_(size + 1) {
    op_->results.assign(size, {});
    op_->steps.assign(size, {});
    for (std::size_t i = 0; i < size; ++i) {
      members_[i].owner = this;
      members_[i].index = i;
    }
  }
  batch_member* member(std::size_t i) noexcept { return &members_[i]; }

  void finished(std::size_t i, const error_code* ec, queueing how) {
    if (ec) {
      op_->results[i] = *ec;
      op_->steps[i] = std::move(members_[i].step);
    } else {
      discarded_.store(true, std::memory_order_relaxed);
    }
    arrive(how);
  }

  /// The starter, or one member, is done; the last ends the batch.
  void arrive(queueing how) {
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    batch_op* const op = op_;
    const bool discard = discarded_.load(std::memory_order_relaxed);
    delete this;
    if (discard) return op->discard();
    op->complete(first_error(op->results), how);
  }

 private:
  batch_op* const op_;
  std::unique_ptr<batch_member[]> members_;
  std::atomic<std::size_t> remaining_;
  std::atomic<bool> discarded_{false};
};

void batch_member::finish(operation* base, const error_code* ec, queueing how) {
  auto* self = static_cast<batch_member*>(base);
  self->owner->finished(self->index, ec, how);
}

/// Starts `start(i, member)` for every i < size as one batch completing `op`.
template <class Start>
void start_batch(batch_op* op, std::size_t size, Start start) {
  batch* b = nullptr;
  try {
    b = new batch(op, size);
  } catch (const std::bad_alloc&) {
    return op->complete(kv_errc::capacity_exhausted, queueing::post);
  }
  for (std::size_t i = 0; i < size; ++i) start(i, b->member(i));
  b->arrive(queueing::post);
}

}  // namespace

error_code first_error(std::span<const error_code> results) noexcept {
  for (const error_code& ec : results)
    if (ec) return ec;
  return {};
}

// The step's part of the untyped interface of detail/sequence_interface.hpp.

void start_write_layer(std::span<step_state* const> steps, batch_op* op, std::size_t layer,
                       std::span<const std::span<const float>> keys, std::span<const std::span<const float>> values) {
  if (keys.size() != steps.size() || values.size() != steps.size())
    return op->complete(kv_errc::length_mismatch, queueing::post);
  try {
    op->results.assign(steps.size(), {});
  } catch (const std::bad_alloc&) {
    return op->complete(kv_errc::capacity_exhausted, queueing::post);
  }
  for (std::size_t i = 0; i < steps.size(); ++i) op->results[i] = steps[i]->write(layer, keys[i], values[i]);
  op->complete(first_error(op->results), queueing::post);
}

void start_begin_step(const std::shared_ptr<sequence_state>& s, sequence_op* op, std::size_t tokens,
                      std::span<const token_id> ids) {
  sequence_state& seq = *s;
  if (tokens == 0) return op->complete(kv_errc::zero_length, queueing::post);
  const std::optional<std::size_t> first = begin_adding(seq, op, tokens, ids);
  if (!first) return;
  const std::size_t index = *first;
  // The model's layers open the step's positions; the token-id layer
  // stores the ids at once (published with the step's commit).
  submit_to_group(s, op, op->cancellation() ? urgency::now : urgency::here, [&] {
    auto step = std::make_shared<step_state>(s, index, tokens);
    std::vector<float> bits;
    const kv_write ids_write = id_write(index, tokens, ids, bits);
    return new sequence_request(s, op, begin_step_args{index, tokens}, ids_write, std::move(bits), std::move(step));
  });
}

void start_begin_steps(std::span<const std::shared_ptr<sequence_state>> seqs, batch_op* op, std::size_t tokens,
                       std::span<const std::span<const token_id>> ids) {
  if (!ids.empty() && ids.size() != seqs.size()) return op->complete(kv_errc::length_mismatch, queueing::post);
  start_batch(op, seqs.size(), [&](std::size_t i, batch_member* m) {
    start_begin_step(seqs[i], m, ids.empty() ? tokens : ids[i].size(),
                     ids.empty() ? std::span<const token_id>() : ids[i]);
  });
}

void start_commit_all(std::span<step_state* const> steps, batch_op* op) {
  start_batch(op, steps.size(), [&](std::size_t i, batch_member* m) {
    if (steps[i])
      steps[i]->commit(m);
    else
      m->complete(kv_errc::step_closed, queueing::post);
  });
}

void start_step_write(step_state& step, sequence_op* op, std::size_t layer, std::span<const float> keys,
                      std::span<const float> values) {
  op->complete(step.write(layer, keys, values), queueing::post);
}
error_code write_step(step_state& step, std::size_t layer, std::span<const float> keys,
                      std::span<const float> values) noexcept {
  return step.write(layer, keys, values);
}
pinned_epoch pin_step(const step_state& step, std::size_t layer) noexcept { return epoch_access::pin(step.pin(layer)); }
void start_commit(const std::shared_ptr<step_state>& step, sequence_op* op) { step->commit(op); }
void abandon(step_state& step) noexcept { step.abandon(nullptr); }
void start_abandon(const std::shared_ptr<step_state>& step, sequence_op* op) { step->abandon(op); }
std::size_t step_index(const step_state& step) noexcept { return step.index; }
std::size_t step_tokens(const step_state& step) noexcept { return step.tokens; }
const std::shared_ptr<sequence_state>& sequence_of(const step_state& step) noexcept { return step.seq; }

}  // namespace detail
GHOSTLINK_NAMESPACE_END
