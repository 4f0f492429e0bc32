#pragma once
// Template implementations of layer_kv_cache's asynchronous operations.

#include <memory>
#include <type_traits>
#include <utility>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/detail/cache_access.hpp"
#include "ghostlink/detail/completion.hpp"
#include "ghostlink/detail/layer_interface.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// Starts a request: stores the handler in a request and mails it to the
/// actor. Owns the actor so that a deferred operation may start later.
/// `MakeResult` (if not void) makes the handler's second argument.
template <class MakeResult = void>
struct initiate_request_with {
  std::shared_ptr<actor> target;

  /// The executor the cache was made from, as Asio's initiations expose theirs.
  using executor_type = asio::any_io_executor;
  executor_type get_executor() const noexcept { return io_executor(*target); }

  template <class Handler, class Arg>
  void operator()(Handler&& handler, const Arg& arg) const {
    using handler_type = std::decay_t<Handler>;
    using op = handler_op<request, handler_type, asio::any_io_executor, MakeResult>;
    handler_type h(std::forward<Handler>(handler));
    submit(*target, op::make(std::move(h), io_executor(*target), arg),
           resumes_coroutine<handler_type>::value ? urgency::now : urgency::batch);
  }
};

using initiate_request = initiate_request_with<>;

/// Starts a read: pins the latest epoch, copies out, posts the result.
template <class Snapshot>
struct initiate_read {
  std::shared_ptr<actor> target;
  std::size_t layer = 0;

  /// The executor the cache was made from, as Asio's initiations expose theirs.
  using executor_type = asio::any_io_executor;
  executor_type get_executor() const noexcept { return io_executor(*target); }

  template <class Handler>
  void operator()(Handler&& handler, std::size_t index) const {
    kv_entry entry;
    const error_code ec = to_error_code(cache_access::adopt<Snapshot>(pin(*target, layer)).read_kv(index, entry));
    post_completion(queueing::post, std::decay_t<Handler>(std::forward<Handler>(handler)), io_executor(*target), ec,
                    std::move(entry));
  }

  template <class Handler>
  void operator()(Handler&& handler, std::size_t begin, std::size_t end) const {
    kv_range range;
    const error_code ec =
        to_error_code(cache_access::adopt<Snapshot>(pin(*target, layer)).read_range(begin, end, range));
    post_completion(queueing::post, std::decay_t<Handler>(std::forward<Handler>(handler)), io_executor(*target), ec,
                    std::move(range));
  }
};

}  // namespace detail

template <storage_element T>
template <class CompletionToken>
auto basic_layer_kv_cache<T>::async_initialize(std::size_t seq_len, CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code)>(detail::initiate_request{state_}, token,
                                                                 detail::initialize_args{seq_len});
}

template <storage_element T>
template <class CompletionToken>
auto basic_layer_kv_cache<T>::async_write(std::size_t index, std::span<const float> keys, std::span<const float> values,
                                          CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code)>(detail::initiate_request{state_}, token,
                                                                 kv_write{index, keys, values});
}

template <storage_element T>
template <class CompletionToken>
auto basic_layer_kv_cache<T>::async_write_batch(std::span<const kv_write> writes, CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code)>(detail::initiate_request{state_}, token, writes);
}

template <storage_element T>
template <class CompletionToken>
auto basic_layer_kv_cache<T>::async_truncate(std::size_t n, CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code)>(detail::initiate_request{state_}, token,
                                                                 detail::truncate_args{n});
}

template <storage_element T>
template <class CompletionToken>
auto basic_layer_kv_cache<T>::async_fork(CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code, basic_layer_kv_cache)>(
      detail::initiate_request_with<detail::adopt_forked<basic_layer_kv_cache>>{state_}, token, detail::fork_args{});
}

template <storage_element T>
template <class CompletionToken>
auto basic_layer_kv_cache<T>::async_read_kv(std::size_t index, CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code, kv_entry)>(
      detail::initiate_read<snapshot_type>{state_, layer_}, token, index);
}

template <storage_element T>
template <class CompletionToken>
auto basic_layer_kv_cache<T>::async_read_range(std::size_t begin, std::size_t end, CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code, kv_range)>(
      detail::initiate_read<snapshot_type>{state_, layer_}, token, begin, end);
}

GHOSTLINK_NAMESPACE_END
