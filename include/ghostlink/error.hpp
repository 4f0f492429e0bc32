#pragma once
/// @file
/// Errors of ghostlink: `kv_errc` values in `kv_category()`.

#include <system_error>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// Why a cache operation failed. A failed operation leaves the stored data
/// unchanged (the one documented exception: a sequence truncate that only
/// some layers could apply).
///
/// Asynchronous operations pass them to their handler as its first argument,
/// a `ghostlink::error_code` (`std::error_code` standalone,
/// `boost::system::error_code` in the Boost flavour) of `kv_category()` (with
/// `asio::use_awaitable` and `asio::use_future` they arrive as a thrown
/// `std::system_error`, or `boost::system::system_error` with Boost); snapshot
/// reads return them as a `std::error_code` in both flavours; constructors throw `std::system_error` with
/// `invalid_config`. `capacity_exhausted` also stands for memory the system
/// refused (a block, a page table, an epoch, room in the mailbox). A
/// cancelled operation completes with `asio::error::operation_aborted`,
/// which is not a `kv_errc`. Saving and loading (persist.hpp) also report
/// the operating system's errors (`errno`) in the generic category.
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
  layer_mismatch,  ///< a sequence append given keys or values for a number of layers other than `num_layers()`,
                   ///< or a step's write to a layer past them.
  operation_in_progress,  ///< a sequence append, truncate, fork or step started while another is in progress
                          ///< (or a step's layer written a second time).
  step_incomplete,        ///< a step committed before every layer was written.
  step_closed,            ///< a step written or committed after its commit or its end.
  invalid_shape,          ///< an `attention_shape` with a zero field, or query heads not a multiple of KV heads.
  file_corrupt,           ///< a saved sequence's file whose checksum or structure is wrong, or not such a file.
  file_truncated,         ///< a saved sequence's file shorter than its header says.
  file_version_unsupported,  ///< a saved sequence's file of a format version this build cannot read.
  geometry_mismatch,         ///< a saved sequence of other layers, heads, head size or block size than expected.
  element_type_mismatch,     ///< a saved sequence of another element type than the one loaded.
  model_mismatch,            ///< a saved sequence of another model id than expected.
  store_auth_failed,  ///< a store's server refused its credentials or its database (`AUTH`, `SELECT`, an ACL
                      ///< that forbids a command or key the store uses, or a server that wants a password).
  store_tls_failed,  ///< a store's TLS handshake failed: a certificate not verified, a name not matched, no
                     ///< TLS spoken by the server, or the CA, certificate or key files unreadable.
  store_unavailable,  ///< a store's server did not answer in time (nothing listening, refused, unreachable).
  outside_window,  ///< a read of a position a windowed layer no longer keeps, or a truncate that would need one.
  layout_mismatch,  ///< a saved sequence of another model layout than expected.
  invalid_retention,  ///< a `kv_retention` with a priority above 100, a range whose `first > last`, or a
                      ///< negative duration.
};

/// The category of `kv_errc`; its name is `"ghostlink.kv"`. In the Boost
/// flavour it is the `std::error_category` of `kv_boost_category()`, so a
/// code converted between `std::error_code` and `boost::system::error_code`
/// keeps its category.
const std::error_category& kv_category() noexcept;

/// Makes `kv_errc` usable wherever a `std::error_code` (and, in the Boost
/// flavour, a `boost::system::error_code`) is expected.
std::error_code make_error_code(kv_errc e) noexcept;

#if GHOSTLINK_ASIO_BOOST
/// The category of `kv_errc` as Boost.System sees it (Boost flavour only):
/// a `boost::system::error_code` made from a `kv_errc` has this category.
const boost::system::error_category& kv_boost_category() noexcept;
#endif

GHOSTLINK_NAMESPACE_END

/// Lets a `ghostlink::kv_errc` convert to, and compare with, a `std::error_code`.
template <>
struct std::is_error_code_enum<ghostlink::kv_errc> : std::true_type {};

#if GHOSTLINK_ASIO_BOOST
/// Lets a `ghostlink::kv_errc` convert to, and compare with, a
/// `boost::system::error_code` (Boost flavour only).
template <>
struct boost::system::is_error_code_enum<ghostlink::kv_errc> : std::true_type {};
#endif
