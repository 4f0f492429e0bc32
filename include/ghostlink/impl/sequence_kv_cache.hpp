#pragma once
// Template implementations of basic_sequence_kv_cache: each operation stores
// its handler once and hands the rest to the untyped sequence state (src/sequence/sequence.hpp).

#include <cstdint>
#include <memory>
#include <new>
#include <optional>
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
    start_step_write(*step, make(std::forward<Handler>(handler)), layer, keys, values);
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

/// The executor of the first step's (or sequence's) sequence, or the system
/// executor for an empty batch.
template <class Get, class Item>
asio::any_io_executor batch_executor(std::span<const Item> items, Get get) {
  return items.empty() ? asio::any_io_executor(asio::system_executor()) : io_executor(*get(items[0]));
}

/// Starts an operation across a batch: stores the handler once in a
/// batch_op, whose result `MakeResult` makes, and hands it to `start`.
template <class MakeResult, class Handler, class Start>
void start_batch_op(Handler&& handler, const asio::any_io_executor& ex, Start start) {
  using handler_type = std::decay_t<Handler>;
  using op = handler_op<batch_op, handler_type, asio::any_io_executor, MakeResult>;
  handler_type h(std::forward<Handler>(handler));
  start(op::make(std::move(h), ex));
}

/// The step states of a batch of step handles (null for an empty handle),
/// or, failing `op` with capacity_exhausted, nothing.
template <class Step>
std::optional<std::vector<step_state*>> step_states(std::span<const Step> steps, batch_op* op) {
  std::vector<step_state*> states;
  try {
    states.reserve(steps.size());
  } catch (const std::bad_alloc&) {
    op->complete(kv_errc::capacity_exhausted, queueing::post);
    return std::nullopt;
  }
  for (const Step& s : steps) states.push_back(cache_access::state_of(s).get());
  return states;
}

/// Starts a write of one layer across a batch of steps.
struct initiate_write_layer {
  template <class Handler, class Step>
  void operator()(Handler&& handler, std::span<const Step> steps, std::size_t layer,
                  std::span<const std::span<const float>> keys, std::span<const std::span<const float>> values) const {
    auto seq_of = [](const Step& s) { return sequence_of(*cache_access::state_of(s)); };
    start_batch_op<take_results>(std::forward<Handler>(handler), batch_executor(steps, seq_of), [&](batch_op* op) {
      if (auto states = step_states(steps, op)) start_write_layer(*states, op, layer, keys, values);
    });
  }
};

/// Starts a commit of every step of a batch.
struct initiate_commit_all {
  template <class Handler, class Step>
  void operator()(Handler&& handler, std::span<const Step> steps) const {
    auto seq_of = [](const Step& s) { return s ? sequence_of(*cache_access::state_of(s)) : nullptr; };
    asio::any_io_executor ex = asio::system_executor();
    for (const Step& s : steps)
      if (s) {
        ex = io_executor(*seq_of(s));
        break;
      }
    start_batch_op<take_results>(std::forward<Handler>(handler), ex, [&](batch_op* op) {
      if (auto states = step_states(steps, op)) start_commit_all(*states, op);
    });
  }
};

/// Turns a finished batch of begins into the handler's step handles.
template <class Step>
struct take_steps {
  std::vector<Step> operator()(batch_op& op) const noexcept {
    std::vector<Step> out;
    try {
      out.reserve(op.steps.size());
    } catch (const std::bad_alloc&) {
      return out;  // the steps end with the operation
    }
    for (auto& s : op.steps) out.push_back(cache_access::adopt<Step>(std::move(s)));
    return out;
  }
};

/// Starts a step on each sequence of a batch.
template <class Step>
struct initiate_begin_steps {
  template <class Handler, class Sequence>
  void operator()(Handler&& handler, std::span<const Sequence> seqs, std::size_t n,
                  std::span<const std::span<const token_id>> ids) const {
    auto state = [](const Sequence& s) { return cache_access::state_of(s); };
    start_batch_op<take_steps<Step>>(std::forward<Handler>(handler), batch_executor(seqs, state), [&](batch_op* op) {
      std::vector<std::shared_ptr<sequence_state>> states;
      try {
        states.reserve(seqs.size());
        for (const Sequence& s : seqs) states.push_back(state(s));
      } catch (const std::bad_alloc&) {
        return op->complete(kv_errc::capacity_exhausted, queueing::post);
      }
      start_begin_steps(states, op, n, ids);
    });
  }
};

}  // namespace detail

template <storage_element T>
basic_sequence_kv_cache<T>::basic_sequence_kv_cache(asio::any_io_executor ex, std::size_t num_layers,
                                                    kv_cache_config config, const kv_block_pool& pool)
    : basic_sequence_kv_cache(std::move(ex), kv_model_layout::full(num_layers), config, pool) {}

template <storage_element T>
basic_sequence_kv_cache<T>::basic_sequence_kv_cache(asio::any_io_executor ex, std::size_t num_layers,
                                                    kv_cache_config config)
    : basic_sequence_kv_cache(std::move(ex), kv_model_layout::full(num_layers), config) {}

template <storage_element T>
basic_sequence_kv_cache<T>::basic_sequence_kv_cache(asio::any_io_executor ex, const kv_model_layout& layout,
                                                    kv_cache_config config, const kv_block_pool& pool)
    : state_(detail::make_sequence(std::move(ex), layout, config, detail::codec_of<T>, &pool)) {}

template <storage_element T>
basic_sequence_kv_cache<T>::basic_sequence_kv_cache(asio::any_io_executor ex, const kv_model_layout& layout,
                                                    kv_cache_config config)
    : state_(detail::make_sequence(std::move(ex), layout, config, detail::codec_of<T>, nullptr)) {}

template <storage_element T>
auto basic_sequence_kv_cache<T>::snapshot() const -> snapshot_type {
  // One pin of the sequence's latest state: every layer shows its tokens.
  std::vector<detail::pinned_epoch> pins = detail::pin_all(*state_);
  std::vector<basic_kv_snapshot<T>> layers;
  layers.reserve(pins.size() - 1);
  for (std::size_t i = 0; i + 1 < pins.size(); ++i)
    layers.push_back(detail::cache_access::adopt<basic_kv_snapshot<T>>(std::move(pins[i])));
  auto ids = detail::cache_access::adopt<basic_kv_snapshot<float>>(std::move(pins.back()));
  return snapshot_type(std::move(layers), static_cast<std::size_t>(-1), std::move(ids),
                       detail::layout_of(*state_).rollback_tokens);
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
auto basic_sequence_kv_cache<T>::async_begin_steps(std::span<const basic_sequence_kv_cache> seqs, std::size_t n,
                                                   CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(error_code, std::vector<step_type>)>(
      detail::initiate_begin_steps<step_type>{}, token, seqs, n, std::span<const std::span<const token_id>>());
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_kv_cache<T>::async_begin_steps(std::span<const basic_sequence_kv_cache> seqs,
                                                   std::span<const std::span<const token_id>> ids,
                                                   CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(error_code, std::vector<step_type>)>(
      detail::initiate_begin_steps<step_type>{}, token, seqs, std::size_t{0}, ids);
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_step<T>::async_commit_all(std::span<const basic_sequence_step> steps, CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(error_code, std::vector<error_code>)>(detail::initiate_commit_all{},
                                                                                          token, steps);
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
