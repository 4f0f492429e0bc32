// The private I/O pool: where saves, loads and the file store's I/O run when
// the caller names no executor of its own.

#include "ghostlink/detail/asio_config.hpp"
// A path inside a macro argument: clang-format would space its slashes.
// clang-format off
#include GHOSTLINK_ASIO_HEADER(thread_pool.hpp)
// clang-format on

#include "ghostlink/detail/io_op.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

asio::any_io_executor io_pool_executor(const std::optional<asio::any_io_executor>& given) {
  if (given && *given) return *given;
  // Made at the first call without an executor of its own; joined at exit,
  // when statics are destroyed.
  static asio::thread_pool pool(2);
  return pool.get_executor();
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
