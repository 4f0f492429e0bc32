#pragma once
/// @file
/// Errors of ghostlink: `kv_errc` values in `kv_category()`.

#include <system_error>

namespace ghostlink {

/// Why a cache operation failed. A failed operation leaves the stored data
/// unchanged (the one documented exception: a sequence truncate that only
/// some layers could apply).
enum class kv_errc {
  zero_length = 1,      ///< `initialize(0)`.
  length_mismatch,      ///< `keys.size() != values.size()`.
  width_mismatch,       ///< `keys.size() != token_width()`.
  index_out_of_range,   ///< write: index >= max_tokens_per_seq; read: index >= size().
  not_initialized,      ///< a non-empty write before the first initialize.
  invalid_range,        ///< `begin > end`.
  range_out_of_bounds,  ///< `end > size()`.
  buffer_too_small,     ///< an output span shorter than the data.
  invalid_config,       ///< a zero field in `kv_cache_config`.
  capacity_exhausted,   ///< no storage left under the configured budget.
  layer_mismatch,       ///< a sequence append given keys or values for a number of layers other than `num_layers()`.
  operation_in_progress,  ///< a sequence append, truncate or fork started while another is in progress.
};

/// The category of `kv_errc`; its name is `"ghostlink.kv"`.
const std::error_category& kv_category() noexcept;

/// Makes `kv_errc` usable wherever a `std::error_code` is expected.
std::error_code make_error_code(kv_errc e) noexcept;

}  // namespace ghostlink

template <>
struct std::is_error_code_enum<ghostlink::kv_errc> : std::true_type {};
