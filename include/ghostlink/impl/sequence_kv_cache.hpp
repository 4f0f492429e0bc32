#pragma once
// Template implementations of basic_sequence_kv_cache: each operation runs
// one request on every layer (a fan-out) and completes when the last layer
// has.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <asio/associated_cancellation_slot.hpp>
#include <asio/async_result.hpp>

#include "ghostlink/detail/request.hpp"
#include "ghostlink/error.hpp"

namespace ghostlink {
namespace detail {

/// What the handles of one sequence share.
///
/// `busy` admits one append, truncate or fork at a time: whoever sets it
/// owns `length` until it clears it (release), and the next owner's setting
/// (acquire) sees what it stored.
///
/// `drops` counts completed removals of tokens (a truncate, or the undo of
/// a failed append), each bumped after every layer has published it and
/// before the next operation can start. A snapshot pins the layers one by
/// one; taking the shortest is enough while tokens are only added (every
/// layer's first `min` tokens are the same tokens), but a removal followed
/// by a new append at the same index between two pins would mix an old and
/// a new token. snapshot() therefore pins again if `drops` changed.
template <storage_element T>
struct sequence_state {
  asio::any_io_executor executor;
  kv_cache_config config;  // as the user gave it (the layers' may leave the budget to the pool)
  std::vector<basic_layer_kv_cache<T>> layers;
  std::atomic<std::size_t> length{0};
  std::atomic<bool> busy{false};
  std::atomic<std::uint64_t> drops{0};

  sequence_state(asio::any_io_executor ex, const kv_cache_config& config, std::vector<basic_layer_kv_cache<T>> layers,
                 std::size_t length)
      : executor(std::move(ex)), config(config), layers(std::move(layers)), length(length) {}

  /// A sequence handle on new state (the result of a fork).
  static basic_sequence_kv_cache<T> make_child(asio::any_io_executor ex, const kv_cache_config& config,
                                               std::vector<basic_layer_kv_cache<T>> layers, std::size_t length) {
    return basic_sequence_kv_cache<T>(
        std::make_shared<sequence_state>(std::move(ex), config, std::move(layers), length));
  }

  /// `num_layers` empty layers of `layer_config` on `pool`, accepting writes
  /// without an initialize; `config` is what the user asked for.
  static std::shared_ptr<sequence_state> make(asio::any_io_executor ex, std::size_t num_layers,
                                              const kv_cache_config& config, const kv_cache_config& layer_config,
                                              const kv_block_pool& pool) {
    if (num_layers == 0) throw std::system_error(make_error_code(kv_errc::invalid_config));
    std::vector<basic_layer_kv_cache<T>> layers;
    layers.reserve(num_layers);
    for (std::size_t i = 0; i < num_layers; ++i)
      layers.emplace_back(adopt_actor, actor::make(ex, layer_config, codec_of<T>, pool_access::state(pool), true));
    return std::make_shared<sequence_state>(std::move(ex), config, std::move(layers), 0);
  }

  /// `config` with the default (unbounded) `max_blocks`: layers on a pool
  /// leave the budget to it.
  static kv_cache_config without_budget(kv_cache_config config) noexcept {
    config.max_blocks = kv_cache_config{}.max_blocks;
    return config;
  }

  bool try_begin() noexcept { return !busy.exchange(true, std::memory_order_acquire); }
  /// Records a completed removal (see `drops`); release: a snapshot that
  /// pins an epoch published after it sees the count.
  void dropped() noexcept { drops.fetch_add(1, std::memory_order_release); }
  void end() noexcept { busy.store(false, std::memory_order_release); }
};

/// A handler waiting for a composed operation, with a hold on its
/// executor's work; completes once, always through post (never inline).
template <class Handler>
class pending_handler {
 public:
  pending_handler(Handler handler, const asio::any_io_executor& io_ex)
      : work_(track_work(completion_executor(handler, io_ex))), handler_(std::move(handler)) {}

  /// The handler's associated allocator (Asio's recycling one by default).
  auto allocator() const noexcept { return handler_allocator(handler_); }
  /// The handler's associated cancellation slot.
  auto cancellation_slot() const noexcept { return asio::get_associated_cancellation_slot(handler_); }

  template <class... Args>
  void complete(Args... args) && {
    post_completion(queueing::post, std::move(handler_), executor_of(work_), std::move(args)...);
  }

 private:
  using executor =
      decltype(completion_executor(std::declval<const Handler&>(), std::declval<const asio::any_io_executor&>()));
  decltype(track_work(std::declval<const executor&>())) work_;
  Handler handler_;
};

/// Collects one completion per layer; the last one to arrive runs `finish`
/// with every layer's error code and result. The countdown's acq_rel makes
/// every layer's stores visible to `finish`.
template <class Result, class Finish>
class layer_fan_out : public std::enable_shared_from_this<layer_fan_out<Result, Finish>> {
 public:
  /// `finish` is moved from last, so if allocating fails it is left intact.
  layer_fan_out(std::size_t layers, Finish&& finish)
      : errors_(layers), results_(layers), remaining_(layers), finish_(std::move(finish)) {}

  /// The completion handler for layer `i`.
  auto slot(std::size_t i) {
    return [self = this->shared_from_this(), i](std::error_code ec, auto... result) {
      self->errors_[i] = ec;
      if constexpr (sizeof...(result) > 0) self->results_[i] = (std::move(result), ...);
      if (self->remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1)
        std::move(self->finish_)(self->errors_, self->results_);
    };
  }

 private:
  std::vector<std::error_code> errors_;
  std::vector<Result> results_;
  std::atomic<std::size_t> remaining_;
  Finish finish_;
};

/// A fan-out over `layers` layers, allocated with `alloc` (the handler's);
/// `finish` (an rvalue) is left intact if this throws.
template <class Result, class Finish, class Allocator>
auto make_fan_out(std::size_t layers, Finish&& finish, const Allocator& alloc) {
  static_assert(!std::is_lvalue_reference_v<Finish>);
  return std::allocate_shared<layer_fan_out<Result, Finish>>(alloc, layers, std::forward<Finish>(finish));
}

inline std::error_code first_error(const std::vector<std::error_code>& errors) noexcept {
  for (const std::error_code& ec : errors)
    if (ec) return ec;
  return {};
}

inline std::error_code check_append(std::size_t layers, std::size_t width, std::span<const std::span<const float>> keys,
                                    std::span<const std::span<const float>> values) noexcept {
  if (keys.size() != layers || values.size() != layers) return kv_errc::layer_mismatch;
  for (std::size_t i = 0; i < layers; ++i) {
    if (keys[i].size() != values[i].size()) return kv_errc::length_mismatch;
    if (keys[i].size() != width) return kv_errc::width_mismatch;
  }
  return {};
}

/// Starts `start(i, handler)` on every layer, `handler` being the fan-out's
/// slot `i`, cancellable through `cancel` (by default not at all): one
/// state for every layer's request, which the operation's slot cancels. A
/// layer the actor had claimed applies; the others complete with
/// operation_aborted, and the operation decides from the mix (an append
/// undoes the layers that applied). If
/// starting one throws (no memory for its request), it and the layers not
/// yet started complete with capacity_exhausted, so the fan-out still
/// finishes exactly once.
template <class Fan, class Start>
void start_layers(const std::shared_ptr<Fan>& fan, std::size_t layers, Start start,
                  const ref_ptr<cancel_state>& cancel = {}) noexcept {
  std::size_t i = 0;
  try {
    for (; i < layers; ++i) start(i, cancelled_by_group<decltype(fan->slot(i))>{fan->slot(i), cancel});
  } catch (...) {
    for (; i < layers; ++i) fan->slot(i)(std::error_code(kv_errc::capacity_exhausted));
  }
}

/// Makes a fan-out for an operation that has set `busy`; clears it again if
/// that throws (the exception then leaves the initiating call).
template <class Result, class T, class Finish, class Allocator>
auto begun_fan_out(sequence_state<T>& state, Finish&& finish, const Allocator& alloc) {
  try {
    return make_fan_out<Result>(state.layers.size(), std::forward<Finish>(finish), alloc);
  } catch (...) {
    state.end();
    throw;
  }
}

/// Drops token `index` again from the layers that took it (`errors[i]`
/// clear), then completes `done` with `ec`. Without memory to do so the
/// token stays where it was stored, hidden (other layers lack it) until the
/// next append overwrites it.
template <storage_element T, class Handler>
void undo_append(std::shared_ptr<sequence_state<T>> state, std::size_t index,
                 const std::vector<std::error_code>& errors, pending_handler<Handler> done, std::error_code ec) {
  const auto alloc = done.allocator();
  auto finish = [state, ec, done = std::move(done)](const auto&, const auto&) mutable {
    state->dropped();
    state->end();
    std::move(done).complete(ec);
  };
  try {
    auto fan = make_fan_out<std::monostate>(errors.size(), std::move(finish), alloc);
    start_layers(fan, errors.size(), [&](std::size_t i, auto slot) {
      if (errors[i]) return slot(std::error_code());  // never took it
      state->layers[i].async_truncate(index, std::move(slot));
    });
  } catch (const std::bad_alloc&) {
    finish(std::vector<std::error_code>(), std::vector<std::monostate>());  // left intact by make_fan_out
  }
}

template <storage_element T, class Handler>
void start_append(std::shared_ptr<sequence_state<T>> state, Handler handler,
                  std::span<const std::span<const float>> keys, std::span<const std::span<const float>> values) {
  pending_handler<Handler> done(std::move(handler), state->executor);
  const ref_ptr<cancel_state> cancel = watch_slot(done.cancellation_slot());
  if (std::error_code ec = check_append(state->layers.size(), state->config.token_width(), keys, values))
    return std::move(done).complete(ec);
  if (!state->try_begin()) return std::move(done).complete(std::error_code(kv_errc::operation_in_progress));
  const std::size_t index = state->length.load(std::memory_order_relaxed);
  if (index >= state->config.max_tokens_per_seq) {
    state->end();
    return std::move(done).complete(std::error_code(kv_errc::index_out_of_range));
  }
  const auto alloc = done.allocator();
  auto fan = begun_fan_out<std::monostate>(
      *state,
      [state, index, done = std::move(done)](const auto& errors, const auto&) mutable {
        if (std::error_code ec = first_error(errors)) return undo_append(state, index, errors, std::move(done), ec);
        state->length.store(index + 1, std::memory_order_release);
        state->end();
        std::move(done).complete(std::error_code());
      },
      alloc);
  start_layers(
      fan, state->layers.size(),
      [&](std::size_t i, auto slot) { state->layers[i].async_write(index, keys[i], values[i], std::move(slot)); },
      cancel);
}

template <storage_element T, class Handler>
void start_truncate(std::shared_ptr<sequence_state<T>> state, Handler handler, std::size_t n) {
  pending_handler<Handler> done(std::move(handler), state->executor);
  const ref_ptr<cancel_state> cancel = watch_slot(done.cancellation_slot());
  if (!state->try_begin()) return std::move(done).complete(std::error_code(kv_errc::operation_in_progress));
  if (n >= state->length.load(std::memory_order_relaxed)) {
    state->end();
    return std::move(done).complete(std::error_code());
  }
  const auto alloc = done.allocator();
  auto fan = begun_fan_out<std::monostate>(
      *state,
      [state, n, done = std::move(done)](const auto& errors, const auto&) mutable {
        // One layer truncated is enough for the sequence to be: a layer that
        // could not keeps its extra tokens hidden (snapshots show the
        // shortest layer) until appends overwrite them.
        const bool any = std::any_of(errors.begin(), errors.end(), [](std::error_code ec) { return !ec; });
        if (any) {
          state->length.store(n, std::memory_order_release);
          state->dropped();
        }
        state->end();
        std::move(done).complete(any ? std::error_code() : first_error(errors));
      },
      alloc);
  start_layers(
      fan, state->layers.size(), [&](std::size_t i, auto slot) { state->layers[i].async_truncate(n, std::move(slot)); },
      cancel);
}

template <storage_element T, class Handler>
void start_fork(std::shared_ptr<sequence_state<T>> state, Handler handler) {
  using sequence = basic_sequence_kv_cache<T>;
  pending_handler<Handler> done(std::move(handler), state->executor);
  const ref_ptr<cancel_state> cancel = watch_slot(done.cancellation_slot());
  if (!state->try_begin()) return std::move(done).complete(std::error_code(kv_errc::operation_in_progress), sequence());
  const std::size_t length = state->length.load(std::memory_order_relaxed);
  const auto alloc = done.allocator();
  auto fan = begun_fan_out<basic_layer_kv_cache<T>>(
      *state,
      [state, length, done = std::move(done)](const auto& errors, auto& children) mutable {
        state->end();
        std::error_code ec = first_error(errors);
        sequence child;
        if (!ec) {
          try {
            child = sequence_state<T>::make_child(state->executor, state->config, std::move(children), length);
          } catch (const std::bad_alloc&) {
            ec = kv_errc::capacity_exhausted;
          }
        }
        std::move(done).complete(ec, std::move(child));
      },
      alloc);
  start_layers(
      fan, state->layers.size(), [&](std::size_t i, auto slot) { state->layers[i].async_fork(std::move(slot)); },
      cancel);
}

}  // namespace detail

template <storage_element T>
basic_sequence_kv_cache<T>::basic_sequence_kv_cache(asio::any_io_executor ex, std::size_t num_layers,
                                                    kv_cache_config config, const kv_block_pool& pool)
    : state_(detail::sequence_state<T>::make(std::move(ex), num_layers, config, config, pool)) {}

template <storage_element T>
basic_sequence_kv_cache<T>::basic_sequence_kv_cache(asio::any_io_executor ex, std::size_t num_layers,
                                                    kv_cache_config config)
    : state_(detail::sequence_state<T>::make(std::move(ex), num_layers, config,
                                             detail::sequence_state<T>::without_budget(config),
                                             kv_block_pool::for_caches<T>(config, {.max_blocks = config.max_blocks}))) {
}

template <storage_element T>
const kv_cache_config& basic_sequence_kv_cache<T>::config() const noexcept {
  return state_->config;
}

template <storage_element T>
std::size_t basic_sequence_kv_cache<T>::num_layers() const noexcept {
  return state_->layers.size();
}

template <storage_element T>
auto basic_sequence_kv_cache<T>::get_executor() const noexcept -> executor_type {
  return state_->executor;
}

template <storage_element T>
std::size_t basic_sequence_kv_cache<T>::size() const noexcept {
  return state_->length.load(std::memory_order_acquire);
}

template <storage_element T>
auto basic_sequence_kv_cache<T>::layer(std::size_t i) const noexcept -> const layer_type& {
  return state_->layers[i];
}

template <storage_element T>
auto basic_sequence_kv_cache<T>::snapshot() const -> snapshot_type {
  std::vector<basic_kv_snapshot<T>> layers;
  layers.reserve(state_->layers.size());
  // Lock-free: a retry means a removal completed meanwhile (see
  // sequence_state::drops).
  for (std::uint64_t drops = state_->drops.load(std::memory_order_acquire);;) {
    for (const layer_type& l : state_->layers) layers.push_back(l.snapshot());
    const std::uint64_t now = state_->drops.load(std::memory_order_acquire);
    if (now == drops) break;
    drops = now;
    layers.clear();
  }
  return snapshot_type(std::move(layers));
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_kv_cache<T>::async_append(std::span<const std::span<const float>> keys_per_layer,
                                              std::span<const std::span<const float>> values_per_layer,
                                              CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(std::error_code)>(
      [state = state_](auto handler, auto keys, auto values) {
        detail::start_append(state, std::move(handler), keys, values);
      },
      token, keys_per_layer, values_per_layer);
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_kv_cache<T>::async_truncate(std::size_t n, CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(std::error_code)>(
      [state = state_](auto handler, std::size_t n) { detail::start_truncate(state, std::move(handler), n); }, token,
      n);
}

template <storage_element T>
template <class CompletionToken>
auto basic_sequence_kv_cache<T>::async_fork(CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(std::error_code, basic_sequence_kv_cache)>(
      [state = state_](auto handler) { detail::start_fork(state, std::move(handler)); }, token);
}

}  // namespace ghostlink
