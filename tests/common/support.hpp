#pragma once
// Shared by the tests: Catch2 v2/v3, Asio version differences, and helpers
// to run a coroutine to completion on a thread pool.

#ifdef GHOSTLINK_CATCH2_V3
#include <catch2/catch_test_macros.hpp>
#else
#include <catch2/catch.hpp>
#endif

#include <ghostlink/kv_cache.hpp>

#include "common/asio_compat.hpp"
#include "common/observe.hpp"
#include "common/tokens.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <system_error>
#include <utility>
#include <vector>

namespace ghostlink::test {

/// The seed tests' config: 2 heads * 4 dims = 8 floats per token, 16 tokens.
inline kv_cache_config small_config() {
  return {.max_tokens_per_seq = 16, .num_heads = 2, .head_dim = 4, .block_tokens = 4};
}

/// `width` copies of `x`.
inline std::vector<float> filled(std::size_t width, float x) { return std::vector<float>(width, x); }

/// A cache on `io` (which this thread runs) initialized to one token, so it
/// accepts writes; `io` is restarted, ready to run again.
inline layer_kv_cache initialized_cache(asio::io_context& io, const kv_cache_config& config) {
  layer_kv_cache cache(io, config);
  cache.async_initialize(1, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  io.run();
  io.restart();
  return cache;
}

/// Runs `aw` on `ex` and waits for it; rethrows what it throws.
template <class Executor, class T>
T run(const Executor& ex, asio::awaitable<T> aw) {
  return asio::co_spawn(ex, std::move(aw), asio::use_future).get();
}

/// Waits for an operation started with `asio::use_future` and returns its
/// error code instead of throwing.
template <class Initiate>
ghostlink::error_code wait_ec(Initiate&& start) {
  try {
    start(asio::use_future).get();
    return {};
  } catch (const ghostlink::test::async_error& e) {
    return e.code();
  }
}

/// Blocking calls on a cache, for tests of single-threaded semantics: each
/// waits for completion and returns the error code (and the value).
struct blocking {
  layer_kv_cache& cache;

  ghostlink::error_code initialize(std::size_t n) const {
    return wait_ec([&](auto token) { return cache.async_initialize(n, token); });
  }
  ghostlink::error_code write(std::size_t i, std::span<const float> k, std::span<const float> v) const {
    return wait_ec([&](auto token) { return cache.async_write(i, k, v, token); });
  }
  ghostlink::error_code write_batch(std::span<const kv_write> entries) const {
    return wait_ec([&](auto token) { return cache.async_write_batch(entries, token); });
  }
  std::pair<ghostlink::error_code, kv_entry> read_kv(std::size_t i) const {
    try {
      return {{}, cache.async_read_kv(i, asio::use_future).get()};
    } catch (const ghostlink::test::async_error& e) {
      return {e.code(), {}};
    }
  }
  std::pair<ghostlink::error_code, kv_range> read_range(std::size_t b, std::size_t e) const {
    try {
      return {{}, cache.async_read_range(b, e, asio::use_future).get()};
    } catch (const ghostlink::test::async_error& err) {
      return {err.code(), {}};
    }
  }
};

/// A cache with small_config() (or `config`) on its own 2-thread pool.
struct cache_fixture {
  explicit cache_fixture(kv_cache_config config = small_config()) : cache(pool, config) {}
  asio::thread_pool pool{2};
  layer_kv_cache cache;
  blocking sync{cache};
  std::size_t width = cache.config().token_width();

  /// Writes token_pattern(width, index, tag) as token `index`'s keys and values.
  void write_pattern(std::size_t index, int tag) {
    const auto v = token_pattern(width, index, tag);
    REQUIRE_FALSE(sync.write(index, v, v));
  }
};

}  // namespace ghostlink::test
