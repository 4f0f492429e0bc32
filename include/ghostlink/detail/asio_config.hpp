#pragma once
// Included by every public header before any Asio header. The build passes
// these defines through the dependency (meson.build says why each is
// needed); this covers translation units built without it, as long as they
// include ghostlink before Asio.

#if defined(__clang__) && defined(__cpp_impl_coroutine) && !defined(ASIO_HAS_CO_AWAIT)
// Asio 1.22 looks for <experimental/coroutine>, which libstdc++ lacks.
#define ASIO_HAS_CO_AWAIT 1
#define ASIO_HAS_STD_COROUTINE 1
#endif

#if defined(__clang__) && __clang_major__ < 17 && !defined(ASIO_DISABLE_AWAITABLE_FRAME_RECYCLING)
// LLVM issue 63022: a thread_local's address kept across co_await.
#define ASIO_DISABLE_AWAITABLE_FRAME_RECYCLING 1
#endif
