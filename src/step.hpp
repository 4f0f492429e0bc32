#pragma once
// A sequence's open step (detail/sequence_core.hpp): the writes of its
// layers, one at a time per layer, and its end, set aside when it begins.
//
// Invariants:
// - While the step is open its sequence is busy (sequence_core::busy) and
//   its bound is `index`: no other append, truncate or fork runs, and no
//   sequence snapshot shows the step's tokens.
// - `written_[l]` goes unwritten -> writing (one write's request in layer
//   l's mailbox or drain) -> written (layer l published the tokens), or back
//   to unwritten if that write failed. Written is final: a layer is written
//   once per step, so a commit that saw every layer written cannot race a
//   write.
// - `phase_` goes open -> closed once, by the commit that saw every layer
//   written or by the step's end (abandon); a commit that finds a layer
//   unwritten puts it back to open. Only the closer touches `end_`.

#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "fan_out.hpp"

namespace ghostlink::detail {

/// One layer's write of a step: its completion records the layer's state,
/// then completes the user's operation.
class step_part final : public request {
 public:
  step_part(std::shared_ptr<step_core> step, std::size_t layer, sequence_op* op) noexcept;

 private:
  static void finish(operation* base, const std::error_code* ec, queueing how);
  std::shared_ptr<step_core> step_;  // kept alive until the part has finished
  std::size_t layer_;
  sequence_op* op_;
};

class step_core : public std::enable_shared_from_this<step_core> {
 public:
  enum class layer_state : unsigned char { unwritten, writing, written };
  enum class phase : unsigned char { open, closed };

  /// Allocates everything the step will need, its end included. Throws
  /// std::bad_alloc.
  step_core(std::shared_ptr<sequence_core> sequence, std::size_t first, std::size_t n);
  ~step_core();
  step_core(const step_core&) = delete;
  step_core& operator=(const step_core&) = delete;

  /// Layer `layer`'s writes (its part's entries).
  std::span<const kv_write> writes_of(std::size_t layer) const noexcept;

  void write(sequence_op* op, std::size_t layer, std::span<const float> keys, std::span<const float> values, urgency u);
  void commit(sequence_op* op);
  /// Ends an open step unchanged: every layer drops the step's tokens, then
  /// the sequence is free again and `op` (if any) completes. Once closed,
  /// `op` fails with step_closed.
  void abandon(sequence_op* op) noexcept;

  const std::shared_ptr<sequence_core> seq;
  const std::size_t index;   // the step's first token
  const std::size_t tokens;  // tokens per layer

 private:
  friend class step_part;
  std::vector<kv_write> writes_;  // tokens per layer, layer by layer
  std::vector<std::optional<step_part>> parts_;
  std::unique_ptr<std::atomic<layer_state>[]> written_;
  std::atomic<phase> phase_{phase::open};
  fan_out* end_;  // the step's end, started by abandon(); freed unstarted after a commit
};

}  // namespace ghostlink::detail
