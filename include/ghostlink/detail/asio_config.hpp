#pragma once
// The flavour (flavour.hpp) and the Asio headers ghostlink's own headers and
// sources use, from the flavour's Asio.

#include "ghostlink/detail/flavour.hpp"

// A path inside a macro argument: clang-format would space its slashes.
// clang-format off
#include GHOSTLINK_ASIO_HEADER(any_io_executor.hpp)
#include GHOSTLINK_ASIO_HEADER(associated_allocator.hpp)
#include GHOSTLINK_ASIO_HEADER(associated_cancellation_slot.hpp)
#include GHOSTLINK_ASIO_HEADER(associated_executor.hpp)
#include GHOSTLINK_ASIO_HEADER(async_result.hpp)
#include GHOSTLINK_ASIO_HEADER(cancellation_type.hpp)
#include GHOSTLINK_ASIO_HEADER(defer.hpp)
#include GHOSTLINK_ASIO_HEADER(dispatch.hpp)
#include GHOSTLINK_ASIO_HEADER(error.hpp)
#include GHOSTLINK_ASIO_HEADER(execution/blocking.hpp)
#include GHOSTLINK_ASIO_HEADER(execution/executor.hpp)
#include GHOSTLINK_ASIO_HEADER(execution/outstanding_work.hpp)
#include GHOSTLINK_ASIO_HEADER(execution_context.hpp)
#include GHOSTLINK_ASIO_HEADER(executor_work_guard.hpp)
#include GHOSTLINK_ASIO_HEADER(is_executor.hpp)
#include GHOSTLINK_ASIO_HEADER(post.hpp)
#include GHOSTLINK_ASIO_HEADER(prefer.hpp)
#include GHOSTLINK_ASIO_HEADER(recycling_allocator.hpp)
#include GHOSTLINK_ASIO_HEADER(require.hpp)
#include GHOSTLINK_ASIO_HEADER(strand.hpp)
#include GHOSTLINK_ASIO_HEADER(system_executor.hpp)
#include GHOSTLINK_ASIO_HEADER(use_awaitable.hpp)
// clang-format on

// Whether the flavour's Asio has C++20 coroutines (asio::awaitable).
#if defined(ASIO_HAS_CO_AWAIT) || defined(BOOST_ASIO_HAS_CO_AWAIT)
#define GHOSTLINK_HAS_CO_AWAIT 1
#endif
