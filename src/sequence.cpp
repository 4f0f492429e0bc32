// A sequence's operations: one fan-out per operation hands each layer's
// actor a request of its own and completes the user's operation once, when
// the last layer's request has completed.
//
// Threads: a layer's request completes on that layer's strand, inside its
// drain (or inside submit() when the mailbox could not grow), so the parts
// of one operation complete on as many threads as there are layers. The
// countdown `remaining` decides which one goes on: its acq_rel makes every
// part's result visible to it. The initiating call holds one count of its
// own while it submits, so no part can end the stage (and free the fan-out)
// before the last submission has returned.

#include "sequence.hpp"

#include <algorithm>
#include <new>
#include <optional>
#include <system_error>
#include <utility>
#include <vector>

#include "actor.hpp"
#include "block.hpp"
#include "block_pool.hpp"
#include "ghostlink/error.hpp"

namespace ghostlink::detail {
namespace {

class fan_out;

/// One layer's request of a sequence operation: its completion reports to
/// the fan-out instead of running a handler.
class layer_part final : public request {
 public:
  template <class Arg>
  layer_part(fan_out& fan, const Arg& arg) noexcept : request(&finish, arg), fan_(fan) {}

  /// The layer's result, once finished.
  std::error_code result;
  /// True if the layer's actor destroyed the request unapplied.
  bool discarded = false;

 private:
  static void finish(operation* base, const std::error_code* ec, queueing how);
  fan_out& fan_;
};

/// What an operation is doing now, and so what its last part decides.
enum class stage : unsigned char { append, undo_append, truncate, fork };

class fan_out {
 public:
  fan_out(std::shared_ptr<sequence_core> seq, sequence_op* op, stage s, std::size_t index, std::size_t tokens,
          std::vector<kv_write> writes)
      : seq_(std::move(seq)),
        op_(op),
        parts_(seq_->layers.size()),
        writes_(std::move(writes)),
        stage_(s),
        index_(index),
        tokens_(tokens) {}

  /// An append of several tokens: layer `i`'s writes (its part's entries,
  /// which live as long as the fan-out).
  std::span<const kv_write> writes_of(std::size_t i) const noexcept {
    return std::span<const kv_write>(writes_).subspan(i * tokens_, tokens_);
  }

  /// Submits the current stage's part `arg_of(i)` to layer `i` for every
  /// `i` that `wanted(i)` accepts, cancellable through `cancel`, then ends
  /// the stage if every part already finished.
  template <class ArgOf, class Wanted>
  void start(ArgOf arg_of, const ref_ptr<cancel_state>& cancel, Wanted wanted) {
    std::size_t count = 0;
    for (std::size_t i = 0; i < parts_.size(); ++i) {
      if (!wanted(i)) continue;
      parts_[i].emplace(*this, arg_of(i)).watch(cancel);
      ++count;
    }
    remaining_.store(count + 1, std::memory_order_relaxed);  // + 1: ours, while submitting
    for (std::size_t i = 0; i < parts_.size(); ++i)
      // NOLINTNEXTLINE(bugprone-unchecked-optional-access): checked on the same line
      if (parts_[i].has_value()) submit(*seq_->layers[i], &*parts_[i], urgency::batch);
    arrive(queueing::post);
  }

  /// One part (or the submitter) is done; the last one ends the stage.
  void arrive(queueing how) {
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) end_stage(how);
  }

 private:
  std::error_code first_error() const noexcept {
    for (const auto& p : parts_)
      if (p && p->result) return p->result;
    return {};
  }
  bool any_discarded() const noexcept {
    return std::any_of(parts_.begin(), parts_.end(), [](const auto& p) { return p && p->discarded; });
  }

  void end_stage(queueing how);
  /// Frees the fan-out, then completes the operation: the last thing done.
  void complete(std::error_code ec, queueing how);

  const std::shared_ptr<sequence_core> seq_;
  sequence_op* const op_;
  std::vector<std::optional<layer_part>> parts_;  // engaged: submitted in the current stage
  const std::vector<kv_write> writes_;             // an append of several tokens: tokens_ per layer, layer by layer
  stage stage_;
  const std::size_t index_;   // append: the first token's index; truncate: the size kept
  const std::size_t tokens_;  // append: tokens appended
  std::error_code failure_;  // undo_append: why the append failed
  std::atomic<std::size_t> remaining_{0};
};

void layer_part::finish(operation* base, const std::error_code* ec, queueing how) {
  auto* self = static_cast<layer_part*>(base);
  if (ec)
    self->result = *ec;
  else
    self->discarded = true;
  self->fan_.arrive(how);
}

void fan_out::complete(std::error_code ec, queueing how) {
  sequence_op* const op = op_;
  const bool discard = any_discarded();
  delete this;
  if (discard)
    op->discard();
  else
    op->complete(ec, how);
}

void fan_out::end_stage(queueing how) {
  sequence_core& seq = *seq_;
  if (any_discarded()) {  // an actor shut down with the operation in its mailbox
    seq.end();
    return complete({}, how);
  }
  switch (stage_) {
    case stage::append:
      if (std::error_code ec = first_error()) {
        // Drop the token again from the layers that took it. Without memory
        // to, it stays where it was stored, hidden (other layers lack it)
        // until the next append overwrites it.
        std::vector<bool> took(parts_.size());
        // NOLINTNEXTLINE(bugprone-unchecked-optional-access): every layer had a part in this stage
        for (std::size_t i = 0; i < parts_.size(); ++i) took[i] = !parts_[i]->result;
        for (auto& p : parts_) p.reset();
        stage_ = stage::undo_append;
        failure_ = ec;
        const truncate_args drop{index_};
        return start([&](std::size_t) { return drop; }, {}, [&](std::size_t i) { return took[i]; });
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
      const bool any = std::any_of(parts_.begin(), parts_.end(), [](const auto& p) { return !p->result; });
      if (any) {
        seq.size.store(index_, std::memory_order_release);
        seq.dropped();
      }
      seq.end();
      return complete(any ? std::error_code() : first_error(), how);
    }
    case stage::fork: {
      seq.end();
      std::error_code ec = first_error();
      if (!ec) {
        try {
          std::vector<std::shared_ptr<actor>> layers;
          layers.reserve(parts_.size());
          // NOLINTNEXTLINE(bugprone-unchecked-optional-access): every layer had a part in this stage
          for (auto& p : parts_) layers.push_back(std::move(p->forked));
          op_->forked = std::make_shared<sequence_core>(seq.executor, seq.config, std::move(layers), index_);
        } catch (const std::bad_alloc&) {
          ec = kv_errc::capacity_exhausted;
        }
      }
      return complete(ec, how);  // the forks of layers that did fork go with the fan-out
    }
  }
}

/// Starts stage `s` of `op` on every layer, layer `i` given `arg_of(*fan,
/// i)`, or fails `op` with capacity_exhausted if the fan-out cannot be
/// allocated. `busy` is set. An append of `tokens` tokens passes their
/// writes (`writes`, when more than one) for the fan-out to keep.
template <class ArgOf>
void fan_out_to_layers(const std::shared_ptr<sequence_core>& seq, sequence_op* op, stage s, std::size_t index,
                       ArgOf arg_of, std::size_t tokens = 0, std::vector<kv_write> writes = {}) {
  fan_out* fan = nullptr;
  try {
    fan = new fan_out(seq, op, s, index, tokens, std::move(writes));
  } catch (const std::bad_alloc&) {
    seq->end();
    return op->complete(kv_errc::capacity_exhausted, queueing::post);
  }
  fan->start([&](std::size_t i) { return arg_of(*fan, i); }, op->cancellation(), [](std::size_t) { return true; });
}

/// The tokens an append carries per layer (at least one, the same for
/// every layer), or its error.
std::pair<std::error_code, std::size_t> check_append(std::size_t layers, std::size_t width,
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

void start_append(const std::shared_ptr<sequence_core>& s, sequence_op* op,
                  std::span<const std::span<const float>> keys, std::span<const std::span<const float>> values) {
  sequence_core& seq = *s;
  const std::size_t width = seq.config.token_width();
  const auto [ec, tokens] = check_append(seq.layers.size(), width, keys, values);
  if (ec) return op->complete(ec, queueing::post);
  if (!seq.try_begin()) return op->complete(kv_errc::operation_in_progress, queueing::post);
  const std::size_t index = seq.size.load(std::memory_order_relaxed);
  if (tokens > seq.config.max_tokens_per_seq - index) {  // size() never passes max_tokens_per_seq
    seq.end();
    return op->complete(kv_errc::index_out_of_range, queueing::post);
  }
  if (tokens == 1) {  // a decode step: the request holds its single write
    fan_out_to_layers(
        s, op, stage::append, index,
        [&](const fan_out&, std::size_t i) {
          return kv_write{index, keys[i], values[i]};
        },
        1);
    return;
  }
  // A prefill chunk: each layer's part is one batch of the tokens, kept by
  // the fan-out until the parts complete.
  std::vector<kv_write> writes;
  try {
    writes.reserve(seq.layers.size() * tokens);
  } catch (const std::bad_alloc&) {
    seq.end();
    return op->complete(kv_errc::capacity_exhausted, queueing::post);
  }
  for (std::size_t i = 0; i < seq.layers.size(); ++i)
    for (std::size_t t = 0; t < tokens; ++t)
      writes.push_back({index + t, keys[i].subspan(t * width, width), values[i].subspan(t * width, width)});
  fan_out_to_layers(
      s, op, stage::append, index, [](const fan_out& fan, std::size_t i) { return fan.writes_of(i); }, tokens,
      std::move(writes));
}

void start_truncate(const std::shared_ptr<sequence_core>& s, sequence_op* op, std::size_t n) {
  sequence_core& seq = *s;
  if (!seq.try_begin()) return op->complete(kv_errc::operation_in_progress, queueing::post);
  if (n >= seq.size.load(std::memory_order_relaxed)) {
    seq.end();
    return op->complete({}, queueing::post);
  }
  fan_out_to_layers(s, op, stage::truncate, n, [n](const fan_out&, std::size_t) { return truncate_args{n}; });
}

void start_fork(const std::shared_ptr<sequence_core>& s, sequence_op* op) {
  sequence_core& seq = *s;
  if (!seq.try_begin()) return op->complete(kv_errc::operation_in_progress, queueing::post);
  fan_out_to_layers(s, op, stage::fork, seq.size.load(std::memory_order_relaxed),
                    [](const fan_out&, std::size_t) { return fork_args{}; });
}

// The rest of the untyped interface of detail/sequence_core.hpp.

std::shared_ptr<sequence_core> make_sequence(asio::any_io_executor ex, std::size_t num_layers,
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
  layers.reserve(num_layers);
  for (std::size_t i = 0; i < num_layers; ++i) layers.push_back(actor::make(ex, layer_config, codec, shared, true));
  return std::make_shared<sequence_core>(std::move(ex), config, std::move(layers), 0);
}

std::size_t num_layers(const sequence_core& s) noexcept { return s.layers.size(); }
const kv_cache_config& config_of(const sequence_core& s) noexcept { return s.config; }
const asio::any_io_executor& io_executor(const sequence_core& s) noexcept { return s.executor; }
std::size_t size_of(const sequence_core& s) noexcept { return s.size.load(std::memory_order_acquire); }
const std::shared_ptr<actor>& layer_of(const sequence_core& s, std::size_t i) noexcept { return s.layers[i]; }
std::uint64_t removals(const sequence_core& s) noexcept { return s.drops.load(std::memory_order_acquire); }

}  // namespace ghostlink::detail
