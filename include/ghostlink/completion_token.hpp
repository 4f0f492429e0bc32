#pragma once
/// @file
/// `default_completion_token`: the completion token of every asynchronous
/// operation of ghostlink that is given none.

#include "ghostlink/detail/asio_config.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// The completion token of every asynchronous operation that is given
/// none: `asio::use_awaitable`, so `co_await cache.async_write(i, k, v);`
/// works inside an `asio::awaitable<>` coroutine (on any executor an
/// `asio::any_io_executor` holds), on every Asio version ghostlink supports.
using default_completion_token = asio::use_awaitable_t<>;

GHOSTLINK_NAMESPACE_END
