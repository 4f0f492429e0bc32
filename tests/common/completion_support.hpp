#pragma once
// Shared by the completion tests: inputs for the small config and a cache on
// a 2-thread pool.

#include "common/support.hpp"

#include "common/asio_compat.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <exception>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

namespace ghostlink::test {

/// Runs `aw` on `io` to completion (this thread runs io); rethrows what the
/// coroutine threw.
inline void run_on(asio::io_context& io, asio::awaitable<void> aw) {
  std::exception_ptr failure;
  asio::co_spawn(io, std::move(aw), [&](std::exception_ptr e) { failure = std::move(e); });
  io.run();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace ghostlink::test

namespace ghostlink::test::completion {

constexpr int rounds = 20;

inline ghostlink::error_code err(kv_errc e) { return make_error_code(e); }

/// Inputs for the small config (8 floats a token, 16 tokens): tokens 1..3,
/// a too-short token, a batch of tokens 2..3 and one with an entry past the end.
struct tokens {
  tokens() = default;
  tokens(const tokens&) = delete;  // the batches point into this object
  std::size_t w = ghostlink::test::small_config().token_width();
  std::vector<float> k1 = ghostlink::test::token_pattern(w, 1, 1), v1 = ghostlink::test::token_pattern(w, 1, 2);
  std::vector<float> k2 = ghostlink::test::token_pattern(w, 2, 1), v2 = ghostlink::test::token_pattern(w, 2, 2);
  std::vector<float> k3 = ghostlink::test::token_pattern(w, 3, 1), v3 = ghostlink::test::token_pattern(w, 3, 2);
  std::vector<float> too_short = ghostlink::test::filled(w - 1, 9.0f);
  std::array<kv_write, 2> batch{{{2, k2, v2}, {3, k3, v3}}};
  std::array<kv_write, 2> bad_batch{{{2, k1, v1}, {16, k1, v1}}};  // 16 == max_tokens_per_seq
};

inline std::vector<float> concat(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const auto* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

/// A 2-thread pool and a cache on it. Nothing else keeps the pool busy, so
/// joining it waits for every pending handler.
struct fixture {
  asio::thread_pool pool{2};
  layer_kv_cache cache{pool, ghostlink::test::small_config()};
  tokens tk;
  ~fixture() { pool.join(); }
};

/// The calls every token is tried with: five that succeed, in this order, on

/// The error a future-returning operation finished with.
template <class T>
ghostlink::error_code code_of(std::future<T> f) {
  try {
    f.get();
  } catch (const ghostlink::test::async_error& e) {
    return e.code();
  }
  return {};
}

/// Counts what a `counting_allocator` allocates and frees.
struct alloc_counts {
  std::atomic<int> allocations{0}, deallocations{0};
};

/// An allocator that counts into `alloc_counts` (for `asio::bind_allocator`).
template <class T>
struct counting_allocator {
  using value_type = T;
  alloc_counts* counts;
  explicit counting_allocator(alloc_counts& c) noexcept : counts(&c) {}
  template <class U>
  counting_allocator(const counting_allocator<U>& o) noexcept : counts(o.counts) {}
  T* allocate(std::size_t n) {
    ++counts->allocations;
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    ++counts->deallocations;
    std::allocator<T>().deallocate(p, n);
  }
  template <class U>
  bool operator==(const counting_allocator<U>& o) const noexcept {
    return counts == o.counts;
  }
};

}  // namespace ghostlink::test::completion
