// The consumer's own co_await code, compiled with only dependency('ghostlink').
#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>
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
  std::printf("consumer: %zu tokens\n", n);
  return n == 2 ? 0 : 1;
}
