#pragma once
// The attention kernel's state for one call: what `attend` over a snapshot
// drives block by block (compiled in src/attend.cpp).

#include <cstddef>
#include <span>
#include <system_error>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/attend.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/snapshot.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// The kernel's state for one call (src/attend.cpp): validated arguments, the
/// running maxima and sums, and the run loops for each element type.
///
/// Runs are attended `runs_behind` behind the one added, so that each is
/// attended while the one that many ahead (a block elsewhere in memory) is
/// prefetched; `finish` attends those still held.
class attention_pass {
 public:
  /// Checks the arguments against `width` (the snapshot's token width, 0
  /// for an empty snapshot), `stored` tokens and the layer's `window`
  /// (`outside_window` if a row attends a position it dropped), whose
  /// tokens are keys alone if `keys_only` (the keys then serve as values),
  /// stored in groups of `group` elements (`invalid_shape` unless a head's
  /// keys and values are whole groups) and read times `scales` (fp8); then
  /// clears `out`.
  std::error_code begin(const attention_shape& shape, std::size_t width, std::size_t stored, pending_tokens pending,
                        std::span<const float> queries, std::span<float> out, const window_view& window = {},
                        bool keys_only = false, element_scales scales = {}, std::size_t group = 1) noexcept;
  /// After begin(): the first stored position past the sinks that a row
  /// attends (0 without a window). Positions in `[sinks, first_attended())`
  /// are attended by no row: they need not be added.
  std::size_t first_attended() const noexcept { return first_attended_; }
  /// Attends `count` stored tokens from position `first`, now or (runs
  /// being held `runs_behind`) by a later `add` or `finish`: the memory must
  /// stay valid until `finish`.
  void add(std::size_t first, std::size_t count, const float* keys, const float* values) noexcept;
  void add(std::size_t first, std::size_t count, const half* keys, const half* values) noexcept;
  void add(std::size_t first, std::size_t count, const bfloat16* keys, const bfloat16* values) noexcept;
  void add(std::size_t first, std::size_t count, const q8_0* keys, const q8_0* values) noexcept;
  void add(std::size_t first, std::size_t count, const q4_0* keys, const q4_0* values) noexcept;
  void add(std::size_t first, std::size_t count, const fp8_e4m3* keys, const fp8_e4m3* values) noexcept;
  /// Attends the pending tokens (rounded to `T` first, as a write to a `T`
  /// cache stores them), then normalises the output.
  template <storage_element T>
  void finish() noexcept;

 private:
  /// Runs held before they are attended.
  static constexpr std::size_t runs_behind = 3;
  /// Larger runs are not prefetched: the hardware's prefetchers keep up
  /// within them, and more would not stay in L2 until used.
  static constexpr std::size_t max_prefetched_run = std::size_t{32} << 10;
  template <class T>
  void hold(std::size_t first, std::size_t count, const T* keys, const T* values) noexcept;
  /// Attends the oldest run held while `ahead` (none if empty) is prefetched.
  template <class T>
  void attend_held(const stored_run& ahead) noexcept;

  attention_shape shape_{};  // value_dim resolved (never 0)
  window_view window_{};
  element_scales scales_{};
  bool keys_only_ = false;
  std::size_t first_attended_ = 0;
  stored_run held_runs_[runs_behind]{};
  std::size_t held_ = 0;
  std::size_t rows_ = 0, stored_ = 0, total_ = 0;
  pending_tokens pending_{};
  const float* queries_ = nullptr;
  float* out_ = nullptr;
};

extern template void attention_pass::finish<float>() noexcept;
extern template void attention_pass::finish<half>() noexcept;
extern template void attention_pass::finish<bfloat16>() noexcept;
extern template void attention_pass::finish<q8_0>() noexcept;
extern template void attention_pass::finish<q4_0>() noexcept;
extern template void attention_pass::finish<fp8_e4m3>() noexcept;

}  // namespace detail
GHOSTLINK_NAMESPACE_END
