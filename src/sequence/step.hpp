#pragma once
// A sequence's open step (detail/sequence_interface.hpp): the epochs its
// begin staged, one per layer, the writes that fill them on the callers'
// threads, and its commit and end, each one request to the sequence's
// group, made when the step begins.
//
// Invariants:
// - While the step is open its sequence is busy (sequence_state::busy): no
//   other append, truncate, fork or step runs, and the group's cells show
//   the sequence without the step's tokens. Only the step reaches its
//   positions: staged_[l] covers them (working_state::open).
// - `written_[l]` goes unwritten -> writing (one write() copying on some
//   thread) -> written (release: the tokens are stored), or back to
//   unwritten if the write found an error after claiming the layer (none
//   does today). Written is final: a layer is written once per step, so a
//   commit that saw every layer written cannot race a write.
// - `phase_` goes open -> committing (a commit waits for the writes in
//   flight) -> closed, or open -> closed by the step's end (abandon). A
//   commit that finds a layer unwritten once no write is in flight puts it
//   back to open. Only the closer touches `commit_` and `end_`.
// - `in_flight_` counts the writes between their first check and their
//   settling (counted before a layer can show `writing`, so a commit that
//   sees `writing` sees the count), plus `parked` while a commit waits in
//   `parked_`. Whoever moves it from exactly `parked` to 0 concludes that
//   commit: the commit itself if nothing was in flight, else the last write
//   to settle, on its own thread.
// - `abandon_requested_`: the handle went away while a commit waited; if
//   that commit puts the step back to open, the step is ended instead.

#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "core/epoch_cell.hpp"
#include "sequence/sequence.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class step_state {
 public:
  enum class layer_state : unsigned char { unwritten, writing, written };
  enum class phase : unsigned char { open, committing, closed };

  /// Allocates everything the step will need, its commit and its end
  /// included. Throws std::bad_alloc.
  step_state(std::shared_ptr<sequence_state> sequence, std::size_t first, std::size_t n);
  step_state(const step_state&) = delete;
  step_state& operator=(const step_state&) = delete;

  /// The epochs the begin staged, one per layer of the group (the token
  /// ids' last): called once, before the step is handed out.
  void stage(std::vector<ref_ptr<epoch>> staged) noexcept;

  /// See basic_sequence_step::write.
  error_code write(std::size_t layer, std::span<const float> keys, std::span<const float> values) noexcept;
  /// Layer `layer` with the step's tokens once written, else as published.
  ref_ptr<epoch> pin(std::size_t layer) const noexcept;
  /// Commits once every write in flight has settled: step_incomplete (and
  /// the step open again) if a layer is then unwritten.
  void commit(sequence_op* op) noexcept;
  /// Ends an open step unchanged: the group cuts the step's tokens, then
  /// the sequence is free again and `op` (if any) completes. Once closed,
  /// `op` fails with step_closed; while a commit waits, with
  /// operation_in_progress (and without `op`, the step is ended if that
  /// commit fails).
  void abandon(sequence_op* op) noexcept;

  const std::shared_ptr<sequence_state> seq;
  const std::size_t index;   // the step's first token
  const std::size_t tokens;  // tokens per layer

 private:
  static constexpr std::size_t parked = std::size_t{1} << (sizeof(std::size_t) * 8 - 1);

  /// A write has settled.
  void settle() noexcept;
  /// Concludes the parked commit if no write is in flight (the count is
  /// exactly `parked`).
  void conclude_if_idle() noexcept;
  /// The waiting commit's outcome, once no write is in flight.
  void conclude(sequence_op* op) noexcept;
  /// Starts the end of an open step; false if it is not open.
  bool end(sequence_op* op) noexcept;

  std::vector<ref_ptr<epoch>> staged_;  // the writers' and the closer's (see above), cleared by the end
  // What pin() reads for a written layer: its staged epoch, until the end
  // swaps in the layer's published one (so that an ended step holds no block).
  std::unique_ptr<std::optional<epoch_cell>[]> readable_;
  std::unique_ptr<std::atomic<layer_state>[]> written_;
  std::atomic<phase> phase_{phase::open};
  std::atomic<std::size_t> in_flight_{0};
  sequence_op* parked_ = nullptr;  // the waiting commit (published through in_flight_)
  std::atomic<bool> abandon_requested_{false};
  std::unique_ptr<sequence_request> commit_;  // submitted by the commit (its staged_ copied in)
  std::unique_ptr<sequence_request> end_;     // submitted by the end
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
