#pragma once
// What every implementation is fed and computes, identically: token data,
// and the attention kernel (attention.hpp) run over whatever spans an
// implementation hands out (ghostlink's blocks, a baseline's copy).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <ghostlink/element.hpp>
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

/// Tokens 0..n-1 of `width` floats (as `token` makes them), token-major:
/// the keys and values of multi-token appends (a prefill).
struct token_rows {
  std::size_t width = 0;
  std::vector<float> keys, values;
  token_rows(std::size_t width, std::size_t n) : width(width) {
    keys.reserve(n * width);
    values.reserve(n * width);
    for (std::size_t i = 0; i < n; ++i) {
      const token t(width, i);
      keys.insert(keys.end(), t.keys.begin(), t.keys.end());
      values.insert(values.end(), t.values.begin(), t.values.end());
    }
  }
  /// Tokens [first, first + n).
  std::span<const float> keys_of(std::size_t first, std::size_t n) const {
    return std::span(keys).subspan(first * width, n * width);
  }
  std::span<const float> values_of(std::size_t first, std::size_t n) const {
    return std::span(values).subspan(first * width, n * width);
  }
};

/// `n` token ids drawn uniformly from [0, vocabulary).
inline std::vector<token_id> random_token_ids(std::mt19937_64& rng, std::size_t n, token_id vocabulary = 1 << 30) {
  std::uniform_int_distribution<token_id> draw(0, vocabulary - 1);
  std::vector<token_id> ids(n);
  for (token_id& id : ids) id = draw(rng);
  return ids;
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

/// Calls `run.template operator()<T>()` with T the storage type --element names.
template <class Run>
void with_element(const options& o, Run&& run) {
  if (o.element == "half")
    run.template operator()<half>();
  else if (o.element == "bfloat16")
    run.template operator()<bfloat16>();
  else if (o.element == "q8_0")
    run.template operator()<q8_0>();
  else
    run.template operator()<float>();
}

/// Reports a broken expectation of `scenario` and ends the benchmark with
/// status 1 at once (threads may be running): a figure measured on a wrong
/// result would mislead.
[[noreturn]] inline void fail(const std::string& scenario, const std::string& what) {
  std::fprintf(stderr, "ghostlink-bench: %s: %s\n", scenario.c_str(), what.c_str());
  std::fflush(nullptr);
  std::_Exit(1);
}

/// Keeps a value alive for the optimiser.
inline std::atomic<float> sink{0};
inline void keep(float v) { sink.store(v, std::memory_order_relaxed); }

}  // namespace ghostlink::bench
