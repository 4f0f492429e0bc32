#pragma once
// Template implementations of persist.hpp: each operation stores its handler
// once and hands the rest to the untyped machinery (detail/persist_interface.hpp).

#include <cstddef>
#include <filesystem>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/detail/completion.hpp"
#include "ghostlink/detail/persist_interface.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// Starts a save.
struct initiate_save {
  template <class Handler, storage_element T>
  void operator()(Handler&& handler, basic_sequence_snapshot<T> snapshot, std::filesystem::path path,
                  kv_save_options options) const {
    using handler_type = std::decay_t<Handler>;
    using op = handler_op<io_op, handler_type, asio::any_io_executor>;
    // Whatever may throw (memory, the private pool's threads) before the
    // operation exists; start_save discards it if it throws.
    asio::any_io_executor io = io_pool_executor(options.io_executor);
    auto saved = std::make_unique<typed_saved_sequence<T>>(std::move(snapshot));
    handler_type h(std::forward<Handler>(handler));
    io_op* started = op::make(std::move(h), io);
    start_save(std::move(saved), std::move(path), options.config, std::move(options.model), codec_of<T>,
               options.file_mode, io, started);
  }
};

/// Starts a load of a sequence storing `T`.
template <storage_element T>
struct initiate_load {
  template <class Handler>
  void operator()(Handler&& handler, asio::any_io_executor ex, std::filesystem::path path, kv_block_pool pool,
                  kv_sequence_expectation expected, const kv_load_options& options) const {
    using handler_type = std::decay_t<Handler>;
    using op = handler_op<io_op, handler_type, asio::any_io_executor, take_loaded<basic_sequence_kv_cache<T>>>;
    // The private pool's threads, which may fail to start, before the
    // operation exists; start_load discards it if it throws.
    asio::any_io_executor io = io_pool_executor(options.io_executor);
    handler_type h(std::forward<Handler>(handler));
    io_op* started = op::make(std::move(h), ex);
    start_load(
        std::move(ex), std::move(path), pool,
        {expected.num_layers, expected.config, std::move(expected.model), codec_of<T>, std::move(expected.layout)}, io,
        started);
  }
};

/// Starts a read of one layer of a file storing `T`.
template <storage_element T>
struct initiate_read_layer {
  template <class Handler>
  void operator()(Handler&& handler, std::filesystem::path path, std::size_t layer, kv_sequence_expectation expected,
                  const kv_load_options& options) const {
    using handler_type = std::decay_t<Handler>;
    using op = handler_op<io_op, handler_type, asio::any_io_executor, take_layer>;
    asio::any_io_executor io = io_pool_executor(options.io_executor);
    handler_type h(std::forward<Handler>(handler));
    io_op* started = op::make(std::move(h), io);
    start_read_layer(
        std::move(path), layer,
        {expected.num_layers, expected.config, std::move(expected.model), codec_of<T>, std::move(expected.layout)}, io,
        started);
  }
};

}  // namespace detail

template <storage_element T, class CompletionToken>
auto async_save(basic_sequence_snapshot<T> snapshot, std::filesystem::path path, kv_save_options options,
                CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(error_code)>(detail::initiate_save{}, token, std::move(snapshot),
                                                                 std::move(path), std::move(options));
}

template <storage_element T, class CompletionToken>
  requires(!std::same_as<std::decay_t<CompletionToken>, kv_load_options>)
auto async_load(asio::any_io_executor ex, std::filesystem::path path, kv_block_pool pool,
                kv_sequence_expectation expected, CompletionToken&& token) {
  return async_load<T>(std::move(ex), std::move(path), std::move(pool), std::move(expected), kv_load_options{},
                       std::forward<CompletionToken>(token));
}

template <storage_element T, class CompletionToken>
auto async_load(asio::any_io_executor ex, std::filesystem::path path, kv_block_pool pool,
                kv_sequence_expectation expected, kv_load_options options, CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(error_code, basic_sequence_kv_cache<T>, std::vector<token_id>)>(
      detail::initiate_load<T>{}, token, std::move(ex), std::move(path), std::move(pool), std::move(expected),
      std::move(options));
}

template <storage_element T, class CompletionToken>
  requires(!std::same_as<std::decay_t<CompletionToken>, kv_load_options>)
auto async_read_layer(std::filesystem::path path, std::size_t layer, kv_sequence_expectation expected,
                      CompletionToken&& token) {
  return async_read_layer<T>(std::move(path), layer, std::move(expected), kv_load_options{},
                             std::forward<CompletionToken>(token));
}

template <storage_element T, class CompletionToken>
auto async_read_layer(std::filesystem::path path, std::size_t layer, kv_sequence_expectation expected,
                      kv_load_options options, CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, void(error_code, kv_range)>(
      detail::initiate_read_layer<T>{}, token, std::move(path), layer, std::move(expected), std::move(options));
}

GHOSTLINK_NAMESPACE_END
