#include "ghostlink/error.hpp"
#include "ghostlink/detail/flavour.hpp"

#include <string>

GHOSTLINK_NAMESPACE_BEGIN
namespace {

#if GHOSTLINK_ASIO_BOOST
// A Boost.System category, of which kv_category() is the std view. Its id
// makes two copies of it (two shared objects) compare equal.
using category_base = boost::system::error_category;
#else
using category_base = std::error_category;
#endif

class kv_category_impl final : public category_base {
 public:
#if GHOSTLINK_ASIO_BOOST
  constexpr kv_category_impl() noexcept : category_base(0x9a1f3c5e7b2d4086ULL) {}
#endif
  const char* name() const noexcept override { return "ghostlink.kv"; }

  std::string message(int ev) const override {
    switch (static_cast<kv_errc>(ev)) {
      case kv_errc::zero_length: return "sequence length must be greater than zero";
      case kv_errc::length_mismatch: return "keys/values length mismatch";
      case kv_errc::width_mismatch: return "keys/values must hold token_width() = num_heads * head_dim elements";
      case kv_errc::index_out_of_range: return "token index out of bounds";
      case kv_errc::not_initialized: return "cache not initialized: call initialize() first";
      case kv_errc::invalid_range: return "range begin must be <= end";
      case kv_errc::range_out_of_bounds: return "range end exceeds the current length";
      case kv_errc::buffer_too_small: return "output buffer is shorter than the data";
      case kv_errc::invalid_config:
        return "invalid configuration: every field must be non-zero, sizes must fit, a pool's blocks must fit the "
               "cache";
      case kv_errc::capacity_exhausted: return "no storage left under the configured block budget";
      case kv_errc::layer_mismatch: return "keys and values must be given for exactly num_layers() layers";
      case kv_errc::operation_in_progress:
        return "another append, truncate, fork or step of this sequence (or write of this step's layer) is in progress";
      case kv_errc::step_incomplete: return "a step can only commit once every layer has been written";
      case kv_errc::step_closed: return "the step has already been committed or ended";
      case kv_errc::invalid_shape:
        return "invalid attention shape: every field must be non-zero and query heads a multiple of KV heads";
      case kv_errc::file_corrupt: return "the file is not a saved sequence, or a checksum or size in it is wrong";
      case kv_errc::file_truncated: return "the saved sequence's file is shorter than its header says";
      case kv_errc::file_version_unsupported: return "the saved sequence's format version is not supported";
      case kv_errc::geometry_mismatch:
        return "the saved sequence has other layers, heads, head size or block size than expected";
      case kv_errc::element_type_mismatch: return "the saved sequence stores another element type";
      case kv_errc::model_mismatch: return "the saved sequence is of another model";
      case kv_errc::store_auth_failed: return "the store's server refused its credentials or database";
      case kv_errc::store_tls_failed: return "the store's TLS handshake failed";
      case kv_errc::store_unavailable: return "the store's server did not answer";
      case kv_errc::outside_window: return "the position is outside what the layer's window keeps";
      case kv_errc::layout_mismatch: return "the saved sequence has another model layout";
      case kv_errc::invalid_retention:
        return "the retention has a priority above 100, a range whose first is past its last, or a negative duration";
    }
    return "unknown ghostlink.kv error " + std::to_string(ev);
  }
};

}  // namespace

#if GHOSTLINK_ASIO_BOOST
const boost::system::error_category& kv_boost_category() noexcept {
  static const kv_category_impl category;
  return category;
}

const std::error_category& kv_category() noexcept { return kv_boost_category(); }
#else
const std::error_category& kv_category() noexcept {
  static const kv_category_impl category;
  return category;
}
#endif

std::error_code make_error_code(kv_errc e) noexcept { return {static_cast<int>(e), kv_category()}; }

GHOSTLINK_NAMESPACE_END
