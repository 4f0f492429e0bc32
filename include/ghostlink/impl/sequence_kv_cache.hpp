#pragma once
// Template implementations of basic_sequence_kv_cache: each operation stores
// its handler once and hands the rest to the untyped sequence state (src/sequence/sequence.hpp).

#include <cstdint>
#include <memory>
#include <new>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/detail/cache_access.hpp"
#include "ghostlink/detail/completion.hpp"
#include "ghostlink/detail/layer_interface.hpp"
#include "ghostlink/detail/sequence_interface.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// Which initiation a sequence step's begin and commit are.
struct begin_step_t {};
struct commit_t {};
struct abandon_t {};

/// Starts a sequence operation: stores the handler in a sequence_op and
/// hands it to the sequence state. `MakeResult` (if not void) makes the handler's
/// second argument.
template <class MakeResult = void>
struct initiate_sequence_op {
  std::shared_ptr<sequence_state> target;
  std::shared_ptr<step_state> step = {};  // a step's operations: the step

  /// The executor the sequence was made from, as Asio's initiations expose theirs.
  using executor_type = asio::any_io_executor;
  executor_type get_executor() const noexcept { return io_executor(*target); }

  template <class Handler>
  auto* make(Handler&& handler) const {
    using handler_type = std::decay_t<Handler>;
    using op = handler_op<sequence_op, handler_type, asio::any_io_executor, MakeResult>;
    handler_type h(std::forward<Handler>(handler));
    return op::make(std::move(h), io_executor(*target));
  }

  template <class Handler>
  void operator()(Handler&& handler, std::span<const std::span<const float>> keys,
                  std::span<const std::span<const float>> values, std::span<const token_id> ids) const {
    start_append(target, make(std::forward<Handler>(handler)), keys, values, ids);
  }
  template <class Handler>
  void operator()(Handler&& handler, std::size_t n) const {
    start_truncate(target, make(std::forward<Handler>(handler)), n);
  }
  template <class Handler>
  void operator()(Handler&& handler) const {
    start_fork(target, make(std::forward<Handler>(handler)));
  }
  template <class Handler>
  void operator()(Handler&& handler, begin_step_t, std::size_t tokens, std::span<const token_id> ids) const {
    start_begin_step(target, make(std::forward<Handler>(handler)), tokens, ids);
  }
  template <class Handler>
  void operator()(Handler&& handler, std::size_t layer, std::span<const float> keys,
                  std::span<const float> values) const {
    // As a layer's write: a coroutine's drain is best started at once.
    const urgency u = resumes_coroutine<std::decay_t<Handler>>::value ? urgency::now : urgency::batch;
    start_step_write(step, make(std::forward<Handler>(handler)), layer, keys, values, u);
  }
  template <class Handler>
  void operator()(Handler&& handler, commit_t) const {
    start_commit(step, make(std::forward<Handler>(handler)));
  }
  template <class Handler>
  void operator()(Handler&& handler, abandon_t) const {
    start_abandon(step, make(std::forward<Handler>(handler)));
  }
};

/// Starts a write of one layer across a batch of steps.
struct initiate_write_layer {
  template <class Handler, class Step>
  void operator()(Handler&& handler, std::span<const Step> steps, std::size_t layer,
                  std::span<const std::span<const float>> keys, std::span<const std::span<const float>> values) const {
    using handler_type = std::decay_t<Handler>;
    using op = handler_op<batch_op, handler_type, asio::any_io_executor, take_results>;
    const asio::any_io_executor io_ex = steps.empty() ? asio::any_io_executor(asio::system_executor())
                                                      : io_executor(*sequence_of(*cache_access::state_of(steps[0])));
    handler_type h(std::forward<Handler>(handler));
    batch_op* started = op::make(std::move(h), io_ex);
    std::vector<step_state*> states;
    try {
      states.reserve(steps.size());
    } catch (const std::bad_alloc&) {
      return started->complete(kv_errc::capacity_exhausted, queueing::post);
    }
    for (const Step& s : steps) states.push_back(cache_access::state_of(s).get());
    // Posted, not dispatched: the layers' drains run in parallel on the
    // executor's threads instead of one by one inside this call.
    start_write_layer(states, started, layer, keys, values, urgency::batch);
  }
};

}  // namespace detail

template <storage_element T>
basic_sequence_kv_cache<T>::basic_sequence_kv_cache(asio::any_io_executor ex, std::size_t num_layers,
                                                    kv_cache_config config, const kv_block_pool& pool)
    : state_(detail::make_sequence(std::move(ex), num_layers, config, detail::codec_of<T>, &pool)) {}

template <storage_element T>
basic_sequence_kv_cache<T>::basic_sequence_kv_cache(asio::any_io_executor ex, std::size_t num_layers,
                                                    kv_cache_config config)
    : state_(detail::make_sequence(std::move(ex), num_layers, config, detail::codec_of<T>, nullptr)) {}

template <storage_element T>
auto basic_sequence_kv_cache<T>::snapshot() const -> snapshot_type {
  const std::size_t n = detail::num_layers(*state_);
  std::vector<basic_kv_snapshot<T>> layers;
  layers.reserve(n);
  std::size_t bound = 0;
  basic_kv_snapshot<float> ids;
  // Lock-free: a retry means a removal completed meanwhile (see removals()).
  for (std::uint64_t removals = detail::removals(*state_);;) {
    for (std::size_t i = 0; i < n; ++i)
      layers.push_back(detail::cache_access::adopt<basic_kv_snapshot<T>>(detail::pin(*detail::layer_of(*state_, i))));
    ids = detail::cache_access::adopt<basic_kv_snapshot<float>>(detail::pin(*detail::ids_of(*state_)));
    bound = detail::visible_bound(*state_);
    const std::uint64_t now = detail::removals(*state_);
    if (now == removals) break;
    removals = now;
    layers.clear();
  }
  return snapshot_type(std::move(layers), bound, std::move(ids));
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_kv_cache<T>::async_append(std::span<const std::span<const float>> keys_per_layer,
                                              std::span<const std::span<const float>> values_per_layer,
                                              CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code)>(
      detail::initiate_sequence_op<>{state_}, token, keys_per_layer, values_per_layer, std::span<const token_id>());
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_kv_cache<T>::async_append(std::span<const token_id> ids,
                                              std::span<const std::span<const float>> keys_per_layer,
                                              std::span<const std::span<const float>> values_per_layer,
                                              CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code)>(detail::initiate_sequence_op<>{state_}, token,
                                                                 keys_per_layer, values_per_layer, ids);
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_kv_cache<T>::async_truncate(std::size_t n, CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code)>(detail::initiate_sequence_op<>{state_}, token, n);
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_kv_cache<T>::async_fork(CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code, basic_sequence_kv_cache)>(
      detail::initiate_sequence_op<detail::adopt_forked<basic_sequence_kv_cache>>{state_}, token);
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_kv_cache<T>::async_begin_step(std::size_t n, CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code, step_type)>(
      detail::initiate_sequence_op<detail::adopt_step<step_type>>{state_}, token, detail::begin_step_t{}, n,
      std::span<const token_id>());
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_kv_cache<T>::async_begin_step(std::span<const token_id> ids, CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code, step_type)>(
      detail::initiate_sequence_op<detail::adopt_step<step_type>>{state_}, token, detail::begin_step_t{}, ids.size(),
      ids);
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_step<T>::async_write(std::size_t layer, std::span<const float> keys, std::span<const float> values,
                                         CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code)>(
      detail::initiate_sequence_op<>{detail::sequence_of(*state_), state_}, token, layer, keys, values);
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_step<T>::async_commit(CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code)>(
      detail::initiate_sequence_op<>{detail::sequence_of(*state_), state_}, token, detail::commit_t{});
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_step<T>::async_write_layer(std::span<const basic_sequence_step> steps, std::size_t layer,
                                               std::span<const std::span<const float>> keys,
                                               std::span<const std::span<const float>> values,
                                               CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(error_code, std::vector<error_code>)>(
      detail::initiate_write_layer{}, token, steps, layer, keys, values);
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_step<T>::async_abandon(CompletionToken&& token) const {
  return asio::async_initiate<CompletionToken, void(error_code)>(
      detail::initiate_sequence_op<>{detail::sequence_of(*state_), state_}, token, detail::abandon_t{});
}

GHOSTLINK_NAMESPACE_END
