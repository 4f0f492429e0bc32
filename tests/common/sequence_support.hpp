#pragma once
// Shared by the sequence and element-type tests: bit-exact comparison
// helpers, blocking calls on a cache or sequence of any element type, one
// token for every layer, and what a reader can observe of a sequence.

#include "common/str.hpp"
#include "common/support.hpp"

#include "common/asio_compat.hpp"

#include <bit>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ghostlink::test::seq {

using ghostlink::test::str;

inline std::uint32_t bits32(float f) { return std::bit_cast<std::uint32_t>(f); }

inline std::string hex(std::uint64_t v) { return str("0x", std::hex, v); }

/// The first few of many failed comparisons (for loops too long to assert
/// in, and threads that may not assert), and how many in all.
struct mismatches {
  std::size_t count = 0;
  std::string first;
  void add(const std::string& what) {
    if (++count <= 5) first += what + '\n';
  }
};

/// A `mismatches` that other threads may add to.
struct shared_mismatches {
  std::mutex mutex;
  mismatches log;
  void add(const std::string& what) {
    std::lock_guard lock(mutex);
    log.add(what);
  }
};

/// What a float reads back as from a cache storing T.
template <class T>
float stored(float x) {
  return static_cast<float>(T(x));
}

// Blocking calls on a layer cache of any element type.
template <class T>
ghostlink::error_code initialize(basic_layer_kv_cache<T>& c, std::size_t n) {
  return wait_ec([&](auto tk) { return c.async_initialize(n, tk); });
}
template <class T>
ghostlink::error_code write(basic_layer_kv_cache<T>& c, std::size_t i, std::span<const float> k,
                            std::span<const float> v) {
  return wait_ec([&](auto tk) { return c.async_write(i, k, v, tk); });
}
template <class T>
ghostlink::error_code truncate(basic_layer_kv_cache<T>& c, std::size_t n) {
  return wait_ec([&](auto tk) { return c.async_truncate(n, tk); });
}

using ghostlink::test::key_of;

/// One token for every layer (or `tokens` of them, a prefill chunk: tokens
/// `index`, `index + 1`, ... all with `tag`), as the spans async_append
/// takes. Not copyable: the spans point into it.
struct step {
  step(std::size_t layers, std::size_t width, std::size_t index, int tag, std::size_t tokens = 1) {
    for (std::size_t l = 0; l < layers; ++l) {
      keys.emplace_back(width * tokens);
      values.emplace_back(width * tokens);
      for (std::size_t t = 0; t < tokens; ++t)
        for (std::size_t lane = 0; lane < width; ++lane) {
          keys[l][t * width + lane] = key_of(l, index + t, tag, lane);
          values[l][t * width + lane] = -keys[l][t * width + lane];
        }
    }
    for (std::size_t l = 0; l < layers; ++l) {
      key_spans.emplace_back(keys[l]);
      value_spans.emplace_back(values[l]);
    }
  }
  step(const step&) = delete;
  step& operator=(const step&) = delete;

  std::vector<std::vector<float>> keys, values;
  std::vector<std::span<const float>> key_spans, value_spans;
};

template <class T>
ghostlink::error_code append(basic_sequence_kv_cache<T>& s, std::span<const std::span<const float>> keys,
                             std::span<const std::span<const float>> values) {
  return wait_ec([&](auto token) { return s.async_append(keys, values, token); });
}
template <class T>
ghostlink::error_code append(basic_sequence_kv_cache<T>& s, const step& st) {
  return append(s, st.key_spans, st.value_spans);
}
template <class T>
ghostlink::error_code truncate(basic_sequence_kv_cache<T>& s, std::size_t n) {
  return wait_ec([&](auto token) { return s.async_truncate(n, token); });
}
template <class T>
std::pair<ghostlink::error_code, basic_sequence_kv_cache<T>> fork(basic_sequence_kv_cache<T>& s) {
  try {
    return {{}, s.async_fork(asio::use_future).get()};
  } catch (const ghostlink::test::async_error& e) {
    return {e.code(), {}};
  }
}

// Blocking calls on a sequence's step.
/// `n`: a number of tokens, or their ids (a span of token_id).
template <class T, class N>
std::pair<ghostlink::error_code, basic_sequence_step<T>> begin_step(const basic_sequence_kv_cache<T>& s, N n) {
  using result = std::pair<ghostlink::error_code, basic_sequence_step<T>>;
  try {
    return result(ghostlink::error_code(), s.async_begin_step(n, asio::use_future).get());
  } catch (const ghostlink::test::async_error& e) {
    return result(e.code(), basic_sequence_step<T>());
  }
}
/// Writes layer `l`'s part of `st` (its tokens) through `step`.
template <class T>
ghostlink::error_code write_layer(const basic_sequence_step<T>& open, std::size_t l, const step& st) {
  return wait_ec([&](auto token) { return open.async_write(l, st.key_spans[l], st.value_spans[l], token); });
}
template <class T>
ghostlink::error_code commit(const basic_sequence_step<T>& open) {
  return wait_ec([&](auto token) { return open.async_commit(token); });
}
template <class T>
ghostlink::error_code abandon(const basic_sequence_step<T>& open) {
  return wait_ec([&](auto token) { return open.async_abandon(token); });
}

/// "" if `keys`/`values` are layer `layer`'s token `index` appended with
/// `tag` (as stored in T, bit for bit), else the first float that differs.
template <class T>
std::string diff_token(std::size_t layer, std::size_t index, int tag, std::span<const float> keys,
                       std::span<const float> values) {
  for (std::size_t lane = 0; lane < keys.size(); ++lane) {
    const float k = stored<T>(key_of(layer, index, tag, lane)), v = stored<T>(-key_of(layer, index, tag, lane));
    if (bits32(keys[lane]) != bits32(k) || bits32(values[lane]) != bits32(v))
      return str("layer ", layer, " token ", index, " lane ", lane, ": key ", keys[lane], " value ", values[lane],
                 ", expected tag ", tag, " (key ", k, " value ", v, ")");
  }
  return {};
}

/// "" if every layer snapshot of `snap` shows exactly `snap.size()` tokens
/// and token i of layer l is the one appended with `tags[i]`; else what
/// differed first.
template <class T>
std::string diff_snapshot(const basic_sequence_snapshot<T>& snap, const std::vector<int>& tags) {
  if (snap.size() > tags.size()) return str("snapshot shows ", snap.size(), " tokens, only ", tags.size(), " appended");
  for (std::size_t l = 0; l < snap.num_layers(); ++l) {
    const basic_kv_snapshot<T>& layer = snap.layer(l);
    if (layer.size() != snap.size())
      return str("layer ", l, " shows ", layer.size(), " tokens, the sequence snapshot ", snap.size());
    kv_range r;
    if (ghostlink::error_code ec = layer.read_range(0, snap.size(), r)) return str("layer ", l, ": ", ec.message());
    const std::size_t w = layer.token_width();
    for (std::size_t i = 0; i < snap.size(); ++i) {
      std::string d =
          diff_token<T>(l, i, tags[i], std::span(r.keys).subspan(i * w, w), std::span(r.values).subspan(i * w, w));
      if (!d.empty()) return d;
    }
  }
  return {};
}

using ghostlink::test::observe;
using observed = ghostlink::test::observed_sequence;

/// Runs `ctx` on this thread and one more until it runs out of work.
inline void run_on_two_threads(asio::io_context& ctx) {
  ctx.restart();
  std::thread other([&] { ctx.run(); });
  ctx.run();
  other.join();
}

constexpr std::size_t layers = 3;

/// A 3-layer sequence of small_config() (8 floats a token, 4 tokens a block,
/// 16 tokens) on a 2-thread pool, and the tag each appended token got.
struct fixture {
  explicit fixture(kv_cache_config config = small_config()) : seq(threads, layers, config) {}
  fixture(kv_cache_config config, const kv_block_pool& pool) : seq(threads, layers, config, pool) {}
  asio::thread_pool threads{2};
  sequence_kv_cache seq;
  std::size_t width = seq.config().token_width();
  std::vector<int> tags;

  /// Appends token size() with `tag` to every layer; must succeed.
  void append_ok(int tag) {
    const step st(layers, width, seq.size(), tag);
    REQUIRE_FALSE(append(seq, st));
    tags.push_back(tag);
  }
  /// Checks the snapshot and every layer hold exactly `tags`.
  void check_contents() const {
    const auto snap = seq.snapshot();
    CHECK(seq.size() == tags.size());
    CHECK(snap.size() == tags.size());
    for (std::size_t l = 0; l < layers; ++l) {
      INFO("layer " << l);
      CHECK(seq.layer(l).size() == tags.size());
    }
    const std::string d = diff_snapshot(snap, tags);
    INFO(d);
    CHECK(d.empty());
  }
};

/// Runs `bad`, checks it fails with `expected` and that nothing changed.
template <class Bad>
void check_rejected(const fixture& f, kv_errc expected, Bad&& bad) {
  const observed before = observe(f.seq);
  const ghostlink::error_code ec = bad();
  INFO("got: " << ec.message());
  CHECK(ec == expected);
  const observed after = observe(f.seq);
  INFO("before: " << before << "; after: " << after);
  CHECK(after == before);
}

/// Blocks of small_config() that `tokens` tokens fill.
inline std::size_t blocks_for(std::size_t tokens) {
  return (tokens + small_config().block_tokens - 1) / small_config().block_tokens;
}

/// True when `f` throws std::system_error with invalid_config.
template <class F>
bool refused(const F& f) {
  try {
    f();
  } catch (const std::system_error& e) {
    return e.code() == kv_errc::invalid_config;
  }
  return false;
}

/// A load of `path` onto `pool` expecting `expected`, its I/O on `ex`: the
/// sequence, or the error the load completed with.
inline std::pair<ghostlink::error_code, sequence_kv_cache> load(const asio::any_io_executor& ex,
                                                                const std::filesystem::path& path,
                                                                const kv_block_pool& pool,
                                                                const kv_sequence_expectation& expected) {
  try {
    auto loaded = async_load<float>(ex, path, pool, expected, asio::use_future).get();
    return {{}, std::get<0>(std::move(loaded))};
  } catch (const ghostlink::test::async_error& e) {
    return {e.code(), {}};
  }
}

/// Deterministic values in [-amplitude, amplitude), distinct per (seed, i).
inline std::vector<float> noise(std::size_t n, std::uint64_t seed, float amplitude = 1.0f) {
  std::vector<float> v(n);
  std::uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull;
  for (float& f : v) {
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    f = static_cast<float>((static_cast<double>(x >> 40) / double(1ull << 24) * 2.0 - 1.0) * amplitude);
  }
  return v;
}

}  // namespace ghostlink::test::seq
