#pragma once
// What every implementation is fed and computes, identically: token data,
// and the attention kernel (attention.hpp) run over whatever spans an
// implementation hands out (ghostlink's blocks, a baseline's copy).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <span>
#include <thread>
#include <vector>

#include <ghostlink/types.hpp>

#include "attention.hpp"
#include "harness.hpp"

namespace ghostlink::bench {

/// Keys and values for one token; distinct per (index, salt).
struct token {
  std::vector<float> keys, values;
  token(std::size_t width, std::size_t index, std::size_t salt = 0) : keys(width), values(width) {
    for (std::size_t i = 0; i < width; ++i) {
      keys[i] = float((index * 31 + i * 7 + salt) % 97) / 97.0f - 0.5f;
      values[i] = float((index * 17 + i * 13 + salt) % 89) / 89.0f - 0.5f;
    }
  }
};

/// Tokens 0..n-1 of the benchmark's shape.
inline std::vector<token> tokens_for(const options& o, std::size_t n) {
  std::vector<token> data;
  data.reserve(n);
  for (std::size_t i = 0; i < n; ++i) data.emplace_back(o.config().token_width(), i);
  return data;
}

/// A batch writing tokens [first, end), token i's data being
/// data[i % data.size()] (a prefill, a run of drafts).
inline std::vector<kv_write> writes_of(const std::vector<token>& data, std::size_t first, std::size_t end) {
  std::vector<kv_write> batch;
  batch.reserve(end - first);
  for (std::size_t i = first; i < end; ++i)
    batch.push_back({i, data[i % data.size()].keys, data[i % data.size()].values});
  return batch;
}

/// Runs `f(t)` for t in [0, threads): t = 0 on this thread, the others on
/// threads of their own; returns when all are done.
template <class F>
void on_threads(std::size_t threads, F f) {
  std::vector<std::thread> workers;
  for (std::size_t t = 1; t < threads; ++t) workers.emplace_back(f, t);
  f(0);
  for (auto& w : workers) w.join();
}

/// Keeps a value alive for the optimiser.
inline std::atomic<float> sink{0};
inline void keep(float v) { sink.store(v, std::memory_order_relaxed); }

}  // namespace ghostlink::bench
