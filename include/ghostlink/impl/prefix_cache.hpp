#pragma once
// Template implementation of basic_kv_prefix_cache's asynchronous
// operations: an attach's initiation, and the cancellation handler that
// also wakes a job waiting on the store; a flush's initiation.

#include <memory>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/detail/completion.hpp"
#include "ghostlink/detail/io_op.hpp"
#include "ghostlink/detail/prefix_interface.hpp"
#include "ghostlink/sequence_kv_cache.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// What an attach's cancellation slot holds: the operation's cancel_state
/// (as every operation's), and the wakeup of the job waiting on the store.
struct attach_cancel_handler {
  ref_ptr<cancel_state> state;
  std::shared_ptr<attach_wakeup> wakeup;
  void operator()(asio::cancellation_type type) const noexcept {
    if (type == asio::cancellation_type::none) return;
    state->cancel();
    wake(*wakeup);
  }
};

/// Starts an `async_attach`.
template <storage_element T>
struct initiate_attach {
  template <class Handler>
  void operator()(Handler&& handler, const std::shared_ptr<prefix_index>& p, const asio::any_io_executor& ex,
                  std::span<const token_id> tokens, std::string_view salt, const kv_attach_options& options) const {
    using handler_type = std::decay_t<Handler>;
    using op = handler_op<io_op, handler_type, asio::any_io_executor, take_sequence<basic_sequence_kv_cache<T>>>;
    handler_type h(std::forward<Handler>(handler));
    auto slot = asio::get_associated_cancellation_slot(h);
    io_op* started = op::make(std::move(h), ex);
    std::shared_ptr<attach_wakeup> wakeup;
    if (started->cancellation()) {
      // Not started yet, so nothing else touches the slot: its handler
      // becomes one that also wakes the job waiting on the store.
      try {
        wakeup = make_attach_wakeup();
        slot.template emplace<attach_cancel_handler>(attach_cancel_handler{started->cancellation(), wakeup});
      } catch (...) {
        started->discard();
        throw;
      }
    }
    start_attach(p, ex, tokens, salt, options, wakeup, started);
  }
};

/// Starts an `async_flush`.
template <storage_element T>
struct initiate_flush {
  template <class Handler>
  void operator()(Handler&& handler, const std::shared_ptr<prefix_index>& p) const {
    using handler_type = std::decay_t<Handler>;
    using op = handler_op<io_op, handler_type, asio::any_io_executor>;
    // Whatever may throw (the private pool's threads) before the operation exists.
    asio::any_io_executor io = io_pool_executor({});
    handler_type h(std::forward<Handler>(handler));
    start_flush(p, op::make(std::move(h), io));
  }
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
