#pragma once
// An operation whose work runs on the I/O executor (a save, a load, a layer
// read, a prefix cache's attach from its store): the handler type-erased
// once, completed exactly once by the machinery in src/, never inside the
// initiating call; and the private I/O pool that runs it when the caller
// names no executor.

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/detail/cache_access.hpp"
#include "ghostlink/detail/completion.hpp"
#include "ghostlink/types.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class sequence_state;

/// A save, a load, a layer read or a prefix cache's attach from its store.
class io_op : public operation {
 public:
  /// A load's new sequence, set by the machinery when the load succeeds;
  /// an attach's, always.
  std::shared_ptr<sequence_state> loaded;
  /// A load's token ids.
  std::vector<token_id> ids;
  /// A layer read's tokens.
  kv_range layer;

 protected:
  explicit io_op(finish_fn finish) noexcept : operation(finish) {}
  ~io_op() = default;
};

/// Turns a finished attach into the handler's second argument.
template <class Sequence>
struct take_sequence {
  Sequence operator()(io_op& op) const noexcept { return cache_access::adopt<Sequence>(std::move(op.loaded)); }
};

/// `given`, else the private I/O pool's executor (the pool made at the
/// first call that needs it).
asio::any_io_executor io_pool_executor(const std::optional<asio::any_io_executor>& given);

}  // namespace detail
GHOSTLINK_NAMESPACE_END
