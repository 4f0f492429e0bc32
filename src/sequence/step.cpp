// A sequence's step: its begin (a fan-out stage, decided in sequence.cpp),
// its writes (one request to one layer each), its commit (no request at
// all: every layer already holds the tokens) and its end.

#include "sequence/step.hpp"
#include "ghostlink/detail/flavour.hpp"

#include <new>
#include <system_error>
#include <utility>

#include "ghostlink/error.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

step_part::step_part(std::shared_ptr<step_state> step, std::size_t layer, sequence_op* op) noexcept
    : request(&finish, step->writes_of(layer)), step_(std::move(step)), layer_(layer), op_(op) {}

void step_part::finish(operation* base, const error_code* ec, queueing how) {
  auto* self = static_cast<step_part*>(base);
  sequence_op* const op = self->op_;
  std::shared_ptr<step_state> step = std::move(self->step_);  // the part dies below; the step lives on to here
  const bool written = ec && !*ec;
  step->written_[self->layer_].store(written ? step_state::layer_state::written : step_state::layer_state::unwritten,
                                     std::memory_order_release);
  step->parts_[self->layer_].reset();  // self is gone
  if (ec)
    op->complete(*ec, how);
  else
    op->discard();
  step->settle();
}

step_state::step_state(std::shared_ptr<sequence_state> sequence, std::size_t first, std::size_t n)
    : seq(std::move(sequence)),
      index(first),
      tokens(n),
      writes_(seq->model_layers() * n),
      parts_(seq->model_layers()),
      written_(new std::atomic<layer_state>[seq->model_layers()]),
      end_(new fan_out(seq, nullptr, stage::end_step, first, 0)) {
  for (std::size_t l = 0; l < seq->model_layers(); ++l) written_[l].store(layer_state::unwritten);
}

step_state::~step_state() { delete end_; }

std::span<const kv_write> step_state::writes_of(std::size_t layer) const noexcept {
  return layer_writes(writes_, layer, tokens);
}

void step_state::write(sequence_op* op, std::size_t layer, std::span<const float> keys, std::span<const float> values,
                       urgency u) {
  const std::size_t width = seq->config.token_width();
  switch (phase_.load(std::memory_order_acquire)) {
    case phase::open: break;
    case phase::committing: return op->complete(kv_errc::operation_in_progress, queueing::post);
    case phase::closed: return op->complete(kv_errc::step_closed, queueing::post);
  }
  if (layer >= seq->model_layers()) return op->complete(kv_errc::layer_mismatch, queueing::post);
  if (keys.size() != values.size()) return op->complete(kv_errc::length_mismatch, queueing::post);
  if (keys.size() != tokens * width) return op->complete(kv_errc::width_mismatch, queueing::post);
  in_flight_.fetch_add(1, std::memory_order_acq_rel);
  auto unwritten = layer_state::unwritten;
  if (!written_[layer].compare_exchange_strong(unwritten, layer_state::writing, std::memory_order_acq_rel)) {
    op->complete(kv_errc::operation_in_progress, queueing::post);
    return settle();
  }
  for (std::size_t t = 0; t < tokens; ++t)
    writes_[layer * tokens + t] = {index + t, keys.subspan(t * width, width), values.subspan(t * width, width)};
  step_part& part = parts_[layer].emplace(shared_from_this(), layer, op);
  part.watch(op->cancellation());
  submit(*seq->layers[layer], &part, u);
}

void step_state::commit(sequence_op* op) {
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
  // Every layer published the tokens (acquire above): they are the
  // sequence's now. No layer needs a request: their reservations went with
  // their writes.
  phase_.store(phase::closed, std::memory_order_release);
  seq->size.store(index + tokens, std::memory_order_release);
  seq->bound.store(sequence_state::no_bound, std::memory_order_release);
  seq->end();
  op->complete({}, queueing::post);
}

bool step_state::end(sequence_op* op) noexcept {
  auto open = phase::open;
  if (!phase_.compare_exchange_strong(open, phase::closed, std::memory_order_acq_rel)) return false;
  fan_out* end = std::exchange(end_, nullptr);
  end->set_operation(op);
  const set_aside_args drop{index, 0};
  end->start([drop](std::size_t) { return drop; }, drop, {}, [](std::size_t) { return true; });
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

class batch_write;

/// One step's write within a batch: its completion reports to the batch.
class batch_member final : public sequence_op {
 public:
  batch_member() noexcept : sequence_op(&finish) {}
  batch_write* batch = nullptr;
  std::size_t index = 0;

 private:
  static void finish(operation* base, const error_code* ec, queueing how);
};

/// A write of one layer across a batch of steps: one member per step, and
/// the user's operation completed once, by the last member to finish (the
/// initiating call holds one count of its own while it starts them, as a
/// fan-out does).
class batch_write {
 public:
  batch_write(batch_op* op, std::size_t steps) : op_(op), members_(new batch_member[steps]), remaining_(steps + 1) {
    op_->results.assign(steps, {});
    for (std::size_t i = 0; i < steps; ++i) {
      members_[i].batch = this;
      members_[i].index = i;
      members_[i].watch(op_->cancellation());
    }
  }

  void start(std::span<step_state* const> steps, std::size_t layer, std::span<const std::span<const float>> keys,
             std::span<const std::span<const float>> values, urgency u) {
    for (std::size_t i = 0; i < steps.size(); ++i) steps[i]->write(&members_[i], layer, keys[i], values[i], u);
    arrive(queueing::post);
  }

  void finished(std::size_t i, const error_code* ec, queueing how) {
    if (ec)
      op_->results[i] = *ec;
    else
      discarded_.store(true, std::memory_order_relaxed);
    arrive(how);
  }

 private:
  void arrive(queueing how) {
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    batch_op* const op = op_;
    const bool discard = discarded_.load(std::memory_order_relaxed);
    delete this;
    if (discard) return op->discard();
    error_code first;
    for (const error_code& ec : op->results)
      if (ec) {
        first = ec;
        break;
      }
    op->complete(first, how);
  }

  batch_op* const op_;
  std::unique_ptr<batch_member[]> members_;
  std::atomic<std::size_t> remaining_;
  std::atomic<bool> discarded_{false};
};

void batch_member::finish(operation* base, const error_code* ec, queueing how) {
  auto* self = static_cast<batch_member*>(base);
  self->batch->finished(self->index, ec, how);
}

}  // namespace

// The step's part of the untyped interface of detail/sequence_interface.hpp.

void start_write_layer(std::span<step_state* const> steps, batch_op* op, std::size_t layer,
                       std::span<const std::span<const float>> keys, std::span<const std::span<const float>> values,
                       urgency u) {
  if (keys.size() != steps.size() || values.size() != steps.size())
    return op->complete(kv_errc::length_mismatch, queueing::post);
  batch_write* batch = nullptr;
  try {
    batch = new batch_write(op, steps.size());
  } catch (const std::bad_alloc&) {
    return op->complete(kv_errc::capacity_exhausted, queueing::post);
  }
  batch->start(steps, layer, keys, values, u);
}

void start_begin_step(const std::shared_ptr<sequence_state>& s, sequence_op* op, std::size_t tokens,
                      std::span<const token_id> ids) {
  sequence_state& seq = *s;
  if (tokens == 0) return op->complete(kv_errc::zero_length, queueing::post);
  const std::optional<std::size_t> first = begin_adding(seq, op, tokens, ids);
  if (!first) return;
  const std::size_t index = *first;
  std::shared_ptr<step_state> step;
  try {
    step = std::make_shared<step_state>(s, index, tokens);
  } catch (const std::bad_alloc&) {
    seq.end();
    return op->complete(kv_errc::capacity_exhausted, queueing::post);
  }
  // The model's layers set blocks aside; the token-id layer stores the ids
  // at once (the sequence's snapshots show them with the step's commit).
  fan_out_to_layers(
      s, op, stage::begin_step, index,
      [&](const fan_out&, std::size_t) {
        return set_aside_args{index, tokens};
      },
      [](const fan_out& fan) { return fan.id_writes(); }, tokens, {}, std::move(step), ids);
}

void start_step_write(const std::shared_ptr<step_state>& step, sequence_op* op, std::size_t layer,
                      std::span<const float> keys, std::span<const float> values, urgency u) {
  step->write(op, layer, keys, values, u);
}
void start_commit(const std::shared_ptr<step_state>& step, sequence_op* op) { step->commit(op); }
void abandon(step_state& step) noexcept { step.abandon(nullptr); }
void start_abandon(const std::shared_ptr<step_state>& step, sequence_op* op) { step->abandon(op); }
std::size_t step_index(const step_state& step) noexcept { return step.index; }
std::size_t step_tokens(const step_state& step) noexcept { return step.tokens; }
const std::shared_ptr<sequence_state>& sequence_of(const step_state& step) noexcept { return step.seq; }

}  // namespace detail
GHOSTLINK_NAMESPACE_END
