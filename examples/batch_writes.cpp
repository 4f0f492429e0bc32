// The smallest complete ghostlink program: co_await a batch write, then read
// the tokens back from a snapshot.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>

#include <cstdio>
#include <exception>
#include <vector>

asio::awaitable<void> run(ghostlink::layer_kv_cache& cache) {
  const std::size_t width = cache.config().token_width();
  std::vector<float> k0(width, 1.0f), v0(width, 2.0f), k1(width, 3.0f), v1(width, 4.0f);
  const ghostlink::kv_write batch[] = {{0, k0, v0}, {1, k1, v1}};

  co_await cache.async_initialize(2, asio::use_awaitable);
  co_await cache.async_write_batch(batch, asio::use_awaitable);  // both tokens, one epoch

  ghostlink::kv_snapshot snap = cache.snapshot();
  ghostlink::kv_entry token1;
  if (auto ec = snap.read_kv(1, token1)) throw std::system_error(ec);
  std::printf("epoch %llu holds %zu tokens; token 1 starts with key %.1f, value %.1f\n",
              static_cast<unsigned long long>(snap.epoch()), snap.size(), token1.keys[0], token1.values[0]);
}

int main() try {
  asio::io_context io;
  ghostlink::layer_kv_cache cache(io, {.max_tokens_per_seq = 64, .num_heads = 2, .head_dim = 4});
  asio::co_spawn(io, run(cache), [](const std::exception_ptr& e) {
    if (e) std::rethrow_exception(e);
  });
  io.run();
} catch (const std::exception& e) {
  std::fprintf(stderr, "batch_writes: %s\n", e.what());
  return 1;
}
