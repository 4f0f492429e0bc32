#pragma once
// Included by every public header before any Asio header. Asio 1.22 does
// not detect C++20 coroutines under Clang with libstdc++ (it looks for
// <experimental/coroutine>); the build passes these defines through the
// dependency, and this covers translation units built without it, as long as
// they include ghostlink before Asio.

#if defined(__clang__) && defined(__cpp_impl_coroutine) && !defined(ASIO_HAS_CO_AWAIT)
#define ASIO_HAS_CO_AWAIT 1
#define ASIO_HAS_STD_COROUTINE 1
#endif
