// The consumer's own co_await code, compiled with nothing but ghostlink's
// dependency or target: Asio, the threads and the flavour's defines all come
// through it. One program for both flavours: GHOSTLINK_ASIO_BOOST arrives
// with ghostlink-boost (Meson dependency, ghostlink-boost.pc, CMake target).
#if GHOSTLINK_ASIO_BOOST
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>
namespace asio = boost::asio;
#else
#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>
#endif
#include <ghostlink/kv_cache.hpp>

#include <cstdio>
#include <vector>

asio::awaitable<std::size_t> append_two(ghostlink::layer_kv_cache& cache) {
  const std::vector<float> k(cache.config().token_width(), 1.0f), v(k.size(), 2.0f);
  co_await cache.async_initialize(1, asio::use_awaitable);
  co_await cache.async_write(0, k, v, asio::use_awaitable);
  co_await cache.async_write(1, k, v, asio::use_awaitable);
  co_return cache.snapshot().size();
}

int main() {
  asio::io_context io;
  ghostlink::layer_kv_cache cache(io);
  auto size = asio::co_spawn(io, append_two(cache), asio::use_future);
  io.run();
  const std::size_t n = size.get();
  std::printf("consumer (%s): %zu tokens\n", GHOSTLINK_ASIO_BOOST ? "Boost.Asio" : "standalone Asio", n);
  return n == 2 ? 0 : 1;
}
