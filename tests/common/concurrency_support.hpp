#pragma once
// Shared by the concurrency tests.
//
// Catch2 assertions are not thread-safe: threads other than the test's own
// only record what differed in a `mismatch_log`, which the test thread checks.
// Loops run fixed counts; threads meet through futures, latches and handlers,
// never sleeps. State that handlers touch is declared before the thread pool,
// so the pool joins before that state is destroyed.

#include "common/str.hpp"
#include "common/support.hpp"

#include <cstdint>
#include <future>
#include <latch>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

namespace ghostlink::test::concurrency {

using ghostlink::test::small_config;
using ghostlink::test::token_pattern;

/// small_config() (8 floats per token, 4 tokens per block) holding `max_tokens`.
inline kv_cache_config paged_config(std::size_t max_tokens) {
  kv_cache_config c = small_config();
  c.max_tokens_per_seq = max_tokens;
  return c;
}

using ghostlink::test::str;

using ghostlink::test::make_token;
using ghostlink::test::token_data;

using ghostlink::test::tag_of;

/// "" if `keys`/`values` are exactly token `index` written with `tag`,
/// otherwise the first float that differs.
inline std::string diff_token(std::size_t index, std::span<const float> keys, std::span<const float> values, int tag) {
  const token_data want = make_token(keys.size(), index, tag);
  for (std::size_t lane = 0; lane < keys.size(); ++lane)
    if (keys[lane] != want.keys[lane] || values[lane] != want.values[lane])
      return str("token ", index, " lane ", lane, ": key ", keys[lane], " value ", values[lane], ", expected tag ", tag,
                 " (key ", want.keys[lane], " value ", want.values[lane], ")");
  return {};
}

/// Calls f(index, keys, values) per token of `snap` in [begin, end), zero-copy.
template <class F>
inline ghostlink::error_code for_each_token(const kv_snapshot& snap, std::size_t begin, std::size_t end, F f) {
  const std::size_t w = snap.token_width();
  return snap.for_each_block(
      begin, end,
      [&](std::size_t first, std::size_t count, std::span<const float> keys, std::span<const float> values) {
        for (std::size_t t = 0; t < count; ++t) f(first + t, keys.subspan(t * w, w), values.subspan(t * w, w));
      });
}

/// What other threads saw go wrong (the first few, and how many in all).
struct mismatch_log {
  std::mutex mutex;
  std::size_t count = 0;
  std::string first;

  void add(const std::string& what) {
    std::lock_guard lock(mutex);
    if (++count <= 5) first += what + '\n';
  }
  void require_none() {
    std::lock_guard lock(mutex);
    INFO(count << " mismatch(es), first:\n" << first);
    REQUIRE(count == 0);
  }
};

/// Checks every token of `snap` is `tag`, through for_each_block, read_range
/// and read_kv; logs each difference with `where`.
inline void check_all(mismatch_log& log, const std::string& where, const kv_snapshot& snap, int tag) {
  const std::size_t n = snap.size(), w = snap.token_width();
  for_each_token(snap, 0, n, [&](std::size_t i, auto keys, auto values) {
    if (auto d = diff_token(i, keys, values, tag); !d.empty()) log.add(where + ", for_each_block: " + d);
  });
  kv_range r;
  if (ghostlink::error_code ec = snap.read_range(0, n, r)) log.add(where + ", read_range: " + ec.message());
  for (std::size_t i = 0; i < n && r.keys.size() == n * w; ++i) {
    const auto keys = std::span(r.keys).subspan(i * w, w), values = std::span(r.values).subspan(i * w, w);
    if (auto d = diff_token(i, keys, values, tag); !d.empty()) log.add(where + ", read_range: " + d);
  }
  for (std::size_t i = 0; i < n; ++i) {
    kv_entry e;
    if (ghostlink::error_code ec = snap.read_kv(i, e))
      log.add(str(where, ", read_kv(", i, "): ", ec.message()));
    else if (auto d = diff_token(i, e.keys, e.values, tag); !d.empty())
      log.add(where + ", read_kv: " + d);
  }
}

inline asio::awaitable<void> write_token(layer_kv_cache& cache, std::size_t index, int tag) {
  const token_data t = make_token(cache.config().token_width(), index, tag);
  co_await cache.async_write(index, t.keys, t.values, asio::use_awaitable);
}

/// Writes tokens [begin, end) with `tag` as one async_write_batch.
inline asio::awaitable<void> write_batch(layer_kv_cache& cache, std::size_t begin, std::size_t end, int tag) {
  std::vector<token_data> tokens;
  std::vector<kv_write> batch;
  for (std::size_t i = begin; i < end; ++i) tokens.push_back(make_token(cache.config().token_width(), i, tag));
  for (std::size_t i = begin; i < end; ++i) batch.push_back({i, tokens[i - begin].keys, tokens[i - begin].values});
  co_await cache.async_write_batch(batch, asio::use_awaitable);
}

}  // namespace ghostlink::test::concurrency
