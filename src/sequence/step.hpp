#pragma once
// A sequence's open step (detail/sequence_interface.hpp): the writes of its
// layers, one at a time per layer, and its end, set aside when it begins.
//
// Invariants:
// - While the step is open its sequence is busy (sequence_state::busy) and
//   its bound is `index`: no other append, truncate or fork runs, and no
//   sequence snapshot shows the step's tokens.
// - `written_[l]` goes unwritten -> writing (one write's request in layer
//   l's mailbox or drain) -> written (layer l published the tokens), or back
//   to unwritten if that write failed. Written is final: a layer is written
//   once per step, so a commit that saw every layer written cannot race a
//   write.
// - `phase_` goes open -> committing (a commit waits for the writes in
//   flight) -> closed, or open -> closed by the step's end (abandon). A
//   commit that finds a layer unwritten once no write is in flight puts it
//   back to open. Only the closer touches `end_`.
// - `in_flight_` counts the writes between their first check and their
//   settling (counted before a layer can show `writing`, so a commit that
//   sees `writing` sees the count), plus `parked` while a commit waits in
//   `parked_`. Whoever moves it from exactly `parked` to 0 concludes that
//   commit: the commit itself if nothing was in flight, else the last write
//   to settle.
// - `abandon_requested_`: the handle went away while a commit waited; if
//   that commit puts the step back to open, the step is ended instead.

#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "sequence/fan_out.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// One layer's write of a step: its completion records the layer's state,
/// then completes the user's operation.
class step_part final : public request {
 public:
  step_part(std::shared_ptr<step_state> step, std::size_t layer, sequence_op* op) noexcept;

 private:
  static void finish(operation* base, const error_code* ec, queueing how);
  std::shared_ptr<step_state> step_;  // kept alive until the part has finished
  std::size_t layer_;
  sequence_op* op_;
};

class step_state : public std::enable_shared_from_this<step_state> {
 public:
  enum class layer_state : unsigned char { unwritten, writing, written };
  enum class phase : unsigned char { open, committing, closed };

  /// Allocates everything the step will need, its end included. Throws
  /// std::bad_alloc.
  step_state(std::shared_ptr<sequence_state> sequence, std::size_t first, std::size_t n);
  ~step_state();
  step_state(const step_state&) = delete;
  step_state& operator=(const step_state&) = delete;

  /// Layer `layer`'s writes (its part's entries).
  std::span<const kv_write> writes_of(std::size_t layer) const noexcept;

  void write(sequence_op* op, std::size_t layer, std::span<const float> keys, std::span<const float> values, urgency u);
  /// Commits once every write in flight has settled: step_incomplete (and
  /// the step open again) if a layer is then unwritten.
  void commit(sequence_op* op);
  /// Ends an open step unchanged: every layer drops the step's tokens, then
  /// the sequence is free again and `op` (if any) completes. Once closed,
  /// `op` fails with step_closed; while a commit waits, with
  /// operation_in_progress (and without `op`, the step is ended if that
  /// commit fails).
  void abandon(sequence_op* op) noexcept;

  const std::shared_ptr<sequence_state> seq;
  const std::size_t index;   // the step's first token
  const std::size_t tokens;  // tokens per layer

 private:
  friend class step_part;
  static constexpr std::size_t parked = std::size_t{1} << (sizeof(std::size_t) * 8 - 1);

  /// A write has settled (finished, or failed before its request).
  void settle() noexcept;
  /// Concludes the parked commit if no write is in flight (the count is
  /// exactly `parked`).
  void conclude_if_idle() noexcept;
  /// The waiting commit's outcome, once no write is in flight.
  void conclude(sequence_op* op) noexcept;
  /// Starts the end of an open step; false if it is not open.
  bool end(sequence_op* op) noexcept;

  std::vector<kv_write> writes_;  // tokens per layer, layer by layer
  std::vector<std::optional<step_part>> parts_;
  std::unique_ptr<std::atomic<layer_state>[]> written_;
  std::atomic<phase> phase_{phase::open};
  std::atomic<std::size_t> in_flight_{0};
  sequence_op* parked_ = nullptr;  // the waiting commit (published through in_flight_)
  std::atomic<bool> abandon_requested_{false};
  fan_out* end_;  // the step's end, started by abandon(); freed unstarted after a commit
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
