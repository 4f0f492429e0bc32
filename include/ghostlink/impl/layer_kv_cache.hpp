#pragma once
// Template implementations of layer_kv_cache's asynchronous operations.

#include <memory>
#include <type_traits>
#include <utility>

#include "ghostlink/detail/asio_config.hpp"

#if defined(ASIO_HAS_CO_AWAIT)
#include <asio/use_awaitable.hpp>
#endif

#include "ghostlink/detail/actor.hpp"
#include "ghostlink/detail/request.hpp"

namespace ghostlink {
namespace detail {

/// True for the handler of a `co_await` through `asio::use_awaitable`: the
/// coroutine suspends right after the initiating call and can have no other
/// write of its own in flight, so its drain is best started at once (see
/// actor::submit). Any other handler may belong to a caller that keeps many
/// writes in flight, whose drains should batch them.
template <class Handler>
struct resumes_coroutine : std::false_type {};
#if defined(ASIO_HAS_CO_AWAIT)
template <class Executor, class... Ts>
struct resumes_coroutine<asio::detail::awaitable_handler<Executor, Ts...>> : std::true_type {};
#endif

/// Starts a write request: wraps the handler in a request and mails it to
/// the actor. Owns the actor so a deferred operation may start later.
struct initiate_request {
  std::shared_ptr<actor> target;

  template <class Handler, class Arg>
  void operator()(Handler&& handler, const Arg& arg) const {
    using op = request_op<std::decay_t<Handler>, asio::any_io_executor>;
    std::decay_t<Handler> h(std::forward<Handler>(handler));
    target->submit(op::make(std::move(h), target->completion_executor(), arg),
                   resumes_coroutine<std::decay_t<Handler>>::value ? actor::urgency::now : actor::urgency::batch);
  }
};

/// Starts a read: pins the latest epoch, copies out, posts the result.
struct initiate_read {
  std::shared_ptr<actor> target;

  template <class Handler>
  void operator()(Handler&& handler, std::size_t index) const {
    kv_entry entry;
    std::error_code ec = kv_snapshot(target->pin()).read_kv(index, entry);
    post_completion(queueing::post, std::decay_t<Handler>(std::forward<Handler>(handler)), target->completion_executor(),
                    ec, std::move(entry));
  }

  template <class Handler>
  void operator()(Handler&& handler, std::size_t begin, std::size_t end) const {
    kv_range range;
    std::error_code ec = kv_snapshot(target->pin()).read_range(begin, end, range);
    post_completion(queueing::post, std::decay_t<Handler>(std::forward<Handler>(handler)), target->completion_executor(),
                    ec, std::move(range));
  }
};

}  // namespace detail

template <class CompletionToken>
auto layer_kv_cache::async_initialize(std::size_t seq_len, CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(std::error_code)>(detail::initiate_request{actor_}, token,
                                                                      seq_len);
}

template <class CompletionToken>
auto layer_kv_cache::async_write(std::size_t index, std::span<const float> keys, std::span<const float> values,
                                 CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(std::error_code)>(detail::initiate_request{actor_}, token,
                                                                      kv_write{index, keys, values});
}

template <class CompletionToken>
auto layer_kv_cache::async_write_batch(std::span<const kv_write> entries, CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(std::error_code)>(detail::initiate_request{actor_}, token,
                                                                      entries);
}

template <class CompletionToken>
auto layer_kv_cache::async_read_kv(std::size_t index, CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(std::error_code, kv_entry)>(detail::initiate_read{actor_},
                                                                                token, index);
}

template <class CompletionToken>
auto layer_kv_cache::async_read_range(std::size_t begin, std::size_t end, CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(std::error_code, kv_range)>(detail::initiate_read{actor_},
                                                                                token, begin, end);
}

}  // namespace ghostlink
