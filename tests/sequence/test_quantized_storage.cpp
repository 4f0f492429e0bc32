// Quantized storage end to end (q8_0, q4_0, fp8_e4m3): what layer caches and
// sequences store and read back, bit for bit against the element types' own
// quantize and dequantize; the configs they refuse; attend over their
// snapshots and stored spans; save and load; the prefix cache's hashes and
// store; and readers on other threads while a writer appends.
#include "common/files.hpp"
#include "common/sequence_support.hpp"

#ifdef GHOSTLINK_CATCH2_V3
#include <catch2/catch_template_test_macros.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace quantized_storage_tests {

using namespace ghostlink;
using ghostlink::test::wait_ec;
using ghostlink::test::seq::begin_step;
using ghostlink::test::seq::bits32;
using ghostlink::test::seq::commit;
using ghostlink::test::seq::initialize;
using ghostlink::test::seq::refused;
using ghostlink::test::seq::shared_mismatches;
using ghostlink::test::seq::str;
using ghostlink::test::seq::write;

namespace {

constexpr std::size_t layers = 2;

/// 2 heads of `head_dim` lanes (32: two groups a token), 4 tokens a block, 64 tokens.
kv_cache_config base_config(float key_scale = 1.0f, float value_scale = 1.0f, std::size_t head_dim = 32) {
  return {.max_tokens_per_seq = 64,
          .num_heads = 2,
          .head_dim = head_dim,
          .block_tokens = 4,
          .key_scale = key_scale,
          .value_scale = value_scale};
}

/// The config a T cache is tested with: fp8 with scales other than 1 and other than each other.
template <class T>
kv_cache_config config_for() {
  return std::is_same_v<T, fp8_e4m3> ? base_config(0.5f, 3.0f) : base_config();
}

/// Noise of amplitude 4 unless said: several units of each group's scale.
std::vector<float> noise(std::size_t n, std::uint64_t seed, float amplitude = 4.0f) {
  return ghostlink::test::seq::noise(n, seed, amplitude);
}

/// `x` (whole groups) stored as T, by the type's own quantizer: a group
/// type's `quantize`, or `fp8_e4m3(x / scale)`.
template <class T>
std::vector<T> quantized(std::span<const float> x, float scale) {
  std::vector<T> out;
  if constexpr (elements_per<T> == 32) {
    (void)scale;
    for (std::size_t g = 0; g + 32 <= x.size(); g += 32)
      out.push_back(T::quantize(std::span<const float, 32>(x.data() + g, 32)));
  } else {
    for (const float f : x) out.push_back(T(f / scale));
  }
  return out;
}

/// The floats stored `q` stand for: `operator[]`, or the code times `scale`.
template <class T>
std::vector<float> dequantized(std::span<const T> q, float scale) {
  std::vector<float> out;
  for (const T& u : q) {
    if constexpr (elements_per<T> == 32) {
      for (std::size_t i = 0; i < 32; ++i) out.push_back(u[i]);
    } else {
      out.push_back(static_cast<float>(u) * scale);
    }
  }
  return out;
}

/// What a T cache of `scale` reads back for the floats `x`.
template <class T>
std::vector<float> expected_floats(std::span<const float> x, float scale) {
  const std::vector<T> q = quantized<T>(x, scale);
  return dequantized<T>(std::span<const T>(q), scale);
}

/// "" if `got` is `want` bit for bit, else the first difference.
std::string diff_bits(const std::string& what, std::span<const float> got, std::span<const float> want) {
  if (got.size() != want.size()) return str(what, ": ", got.size(), " floats, expected ", want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (bits32(got[i]) != bits32(want[i])) return str(what, " float ", i, ": ", got[i], ", expected ", want[i]);
  return {};
}

/// "" if |got - want| <= 1e-5 (1 + |want|) everywhere, else the first place it is not.
std::string diff_close(std::span<const float> got, std::span<const float> want) {
  if (got.size() != want.size()) return str(got.size(), " outputs, expected ", want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(double(got[i]) - want[i]) <= 1e-5 * (1.0 + std::abs(double(want[i])))))
      return str("output ", i, ": ", got[i], ", expected ", want[i]);
  return {};
}

/// Every stored unit of `snap`'s tokens [begin, end), keys then values.
template <class T>
std::pair<std::vector<T>, std::vector<T>> stored_units(const basic_kv_snapshot<T>& snap, std::size_t begin,
                                                       std::size_t end) {
  std::pair<std::vector<T>, std::vector<T>> out;
  REQUIRE_FALSE(snap.for_each_block(begin, end, [&](std::size_t, std::size_t, auto k, auto v) {
    static_assert(std::is_same_v<decltype(k), std::span<const T>>, "for_each_block hands out the stored type");
    out.first.insert(out.first.end(), k.begin(), k.end());
    out.second.insert(out.second.end(), v.begin(), v.end());
  }));
  return out;
}

/// A T sequence of `layout` (full: `layers` layers) on a pool of its own,
/// every float appended to each layer, and the ids stored.
template <class T>
struct quant_seq {
  explicit quant_seq(kv_cache_config c = config_for<T>(), const kv_model_layout& layout = kv_model_layout::full(layers))
      : config(c),
        pool(kv_block_pool::for_caches<T>(c)),
        seq(threads, layout, c, pool),
        keys(layout.num_layers()),
        values(layout.num_layers()) {}
  quant_seq(const quant_seq&) = delete;
  quant_seq& operator=(const quant_seq&) = delete;
  /// Joined once its work is done: a load completes from the I/O thread.
  ~quant_seq() {
    seq = {};
    threads.join();
  }

  /// Appends `n` tokens of noise (from `seed`), with ids 500 + position: as
  /// one request, or (`by_step`) through a step written layer by layer.
  ghostlink::error_code append(std::size_t n, std::uint64_t seed, bool by_step = false) {
    const std::size_t w = config.token_width(), at = seq.size();
    std::vector<std::vector<float>> k, v;
    for (std::size_t l = 0; l < keys.size(); ++l) {
      k.push_back(noise(n * w, seed * 100 + 2 * l));
      v.push_back(noise(n * w, seed * 100 + 2 * l + 1));
    }
    const std::vector<std::span<const float>> ks(k.begin(), k.end()), vs(v.begin(), v.end());
    std::vector<token_id> new_ids(n);
    for (std::size_t t = 0; t < n; ++t) new_ids[t] = static_cast<token_id>(500 + at + t);
    ghostlink::error_code ec;
    if (by_step) {
      auto [begun, open] = begin_step(seq, std::span<const token_id>(new_ids));
      ec = begun;
      for (std::size_t l = 0; !ec && l < k.size(); ++l) ec = open.write(l, k[l], v[l]);
      if (!ec) ec = commit(open);
    } else {
      ec = wait_ec([&](auto tk) { return seq.async_append(new_ids, ks, vs, tk); });
    }
    if (ec) return ec;
    for (std::size_t l = 0; l < keys.size(); ++l) {
      keys[l].insert(keys[l].end(), k[l].begin(), k[l].end());
      values[l].insert(values[l].end(), v[l].begin(), v[l].end());
    }
    ids.insert(ids.end(), new_ids.begin(), new_ids.end());
    return {};
  }

  /// The floats layer `l`'s tokens [begin, end) were appended with.
  std::span<const float> raw_keys(std::size_t l, std::size_t begin, std::size_t end) const {
    return std::span(keys[l]).subspan(begin * config.token_width(), (end - begin) * config.token_width());
  }
  std::span<const float> raw_values(std::size_t l, std::size_t begin, std::size_t end) const {
    return std::span(values[l]).subspan(begin * config.token_width(), (end - begin) * config.token_width());
  }

  /// "" if every layer of `snap` reads back (read_range and for_each_block)
  /// exactly what was appended, stored as T; else what differs first.
  std::string diff(const basic_sequence_snapshot<T>& snap) const {
    if (snap.size() != ids.size()) return str("snapshot size ", snap.size(), ", expected ", ids.size());
    if (snap.token_ids() != ids) return "token ids differ";
    const std::size_t n = snap.size();
    for (std::size_t l = 0; l < snap.num_layers(); ++l) {
      const basic_kv_snapshot<T>& s = snap.layer(l);
      if (s.key_scale() != config.key_scale || s.value_scale() != config.value_scale)
        return str("layer ", l, " scales ", s.key_scale(), "/", s.value_scale());
      kv_range r;
      if (ghostlink::error_code ec = s.read_range(0, n, r)) return str("layer ", l, ": ", ec.message());
      std::string d =
          diff_bits(str("layer ", l, " keys"), r.keys, expected_floats<T>(raw_keys(l, 0, n), config.key_scale));
      if (d.empty())
        d = diff_bits(str("layer ", l, " values"), r.values,
                      expected_floats<T>(raw_values(l, 0, n), config.value_scale));
      if (!d.empty()) return d;
      const auto [qk, qv] = stored_units(s, 0, n);
      if (qk != quantized<T>(raw_keys(l, 0, n), config.key_scale)) return str("layer ", l, ": stored keys differ");
      if (qv != quantized<T>(raw_values(l, 0, n), config.value_scale))
        return str("layer ", l, ": stored values differ");
    }
    return {};
  }

  asio::thread_pool threads{2};
  kv_cache_config config;
  kv_block_pool pool;
  basic_sequence_kv_cache<T> seq;
  std::vector<std::vector<float>> keys, values;  // per layer, every token appended
  std::vector<token_id> ids;
};

/// " what" for each way of making a T cache of `bad` that was not refused
/// with invalid_config, or " no block taken" / " pool still free" if a
/// refusal left a block taken on, or a claim to, a pool of the block size
/// `bad` would have.
template <class T>
std::string not_refused(asio::thread_pool& threads, const kv_cache_config& bad) {
  const kv_block_pool pool(2 * bad.block_tokens * bad.token_width() / elements_per<T> * sizeof(T));
  std::string missed;
  const auto expect = [&](const char* what, bool ok) {
    if (!ok) missed += str(" ", what);
  };
  expect("block_bytes_for", refused([&] { (void)kv_block_pool::block_bytes_for<T>(bad); }));
  expect("for_caches", refused([&] { (void)kv_block_pool::for_caches<T>(bad); }));
  expect("layer cache", refused([&] { basic_layer_kv_cache<T>(threads, bad); }));
  expect("layer cache on a pool", refused([&] { basic_layer_kv_cache<T>(threads, bad, pool); }));
  expect("sequence", refused([&] { basic_sequence_kv_cache<T>(threads, layers, bad); }));
  expect("sequence on a pool", refused([&] { basic_sequence_kv_cache<T>(threads, layers, bad, pool); }));
  expect("prefix cache", refused([&] { basic_kv_prefix_cache<T>(layers, bad, pool); }));
  expect("no block taken", pool.stats().blocks_in_use == 0);
  // Nothing claimed the pool: a prefix cache of a good config of the same bytes still can.
  kv_cache_config good = bad;
  good.num_heads = bad.token_width() / 32;
  good.head_dim = 32;
  good.key_scale = good.value_scale = 1.0f;
  expect("pool still free", !refused([&] { basic_kv_prefix_cache<T>(layers, good, pool); }));
  return missed;
}

/// The shapes attended; the cache is `shape.kv_heads` heads of `shape.head_dim`.
struct attend_case {
  attention_shape shape;
  std::size_t stored = 0, rows = 0, pending = 0;
  const char* name = "";
};
const attend_case attend_cases[] = {
    {{.query_heads = 8, .kv_heads = 2, .head_dim = 32}, 37, 1, 0, "GQA 8/2 x 32, one row"},
    {{.query_heads = 8, .kv_heads = 2, .head_dim = 32}, 37, 2, 0, "GQA 8/2 x 32, 2 causal rows"},
    {{.query_heads = 4, .kv_heads = 1, .head_dim = 64}, 50, 3, 3, "MQA 4/1 x 64, 3 pending, 3 causal rows"},
    {{.query_heads = 2, .kv_heads = 2, .head_dim = 32, .scale = 0.3f}, 20, 2, 1, "MHA 2 x 32, 1 pending, 2 rows"},
};

/// attend over float spans of every token.
std::vector<float> attend_floats(std::span<const float> k, std::span<const float> v, std::span<const float> q,
                                 const attention_shape& shape) {
  std::vector<float> out(q.size(), -9.0f);
  REQUIRE_FALSE(attend(k, v, q, out, shape));
  return out;
}

/// The other element type a T file is loaded as.
template <class T>
using other_type =
    std::conditional_t<std::is_same_v<T, q8_0>, q4_0, std::conditional_t<std::is_same_v<T, q4_0>, fp8_e4m3, q8_0>>;

/// A load of `path` as T onto `pool`: the error, the sequence and the ids.
template <class T>
std::tuple<ghostlink::error_code, basic_sequence_kv_cache<T>, std::vector<token_id>> load_as(
    asio::thread_pool& threads, const std::filesystem::path& path, const kv_block_pool& pool,
    const kv_sequence_expectation& expected) {
  try {
    auto [seq, ids] = async_load<T>(threads.get_executor(), path, pool, expected, asio::use_future).get();
    return {{}, std::move(seq), std::move(ids)};
  } catch (const ghostlink::test::async_error& e) {
    return {e.code(), {}, {}};
  }
}

}  // namespace

TEMPLATE_TEST_CASE(
    "a quantized layer cache reads its writes back as quantize-then-dequantize and stores the quantized units",
    "[quantized]", q8_0, q4_0, fp8_e4m3) {
  using T = TestType;
  const kv_cache_config c = config_for<T>();
  const std::size_t w = c.token_width(), n = 10, units = w / elements_per<T>;
  asio::thread_pool threads{2};
  basic_layer_kv_cache<T> cache(threads, c);
  const std::vector<float> keys = noise(n * w, 1), values = noise(n * w, 2);
  REQUIRE_FALSE(initialize(cache, n));
  for (std::size_t i = 0; i < n; ++i)
    REQUIRE_FALSE(write(cache, i, std::span(keys).subspan(i * w, w), std::span(values).subspan(i * w, w)));
  const basic_kv_snapshot<T> snap = cache.snapshot();
  REQUIRE(snap.size() == n);
  CHECK(snap.key_scale() == c.key_scale);
  CHECK(snap.value_scale() == c.value_scale);
  const std::vector<float> want_k = expected_floats<T>(keys, c.key_scale),
                           want_v = expected_floats<T>(values, c.value_scale);
  CHECK(diff_bits("inputs", keys, want_k) != "");  // the storage does round
  if constexpr (std::is_same_v<T, fp8_e4m3>) {
    // Keys by key_scale, values by value_scale: swapped, they would read otherwise.
    CHECK(diff_bits("keys by value_scale", want_k, expected_floats<T>(keys, c.value_scale)) != "");
    CHECK(diff_bits("values by key_scale", want_v, expected_floats<T>(values, c.key_scale)) != "");
    CHECK(fp8_e4m3(keys[3] / 0.5f) == quantized<T>(keys, c.key_scale)[3]);
  }
  kv_range r;
  REQUIRE_FALSE(snap.read_range(0, n, r));
  CHECK(diff_bits("read_range keys", r.keys, want_k) == "");
  CHECK(diff_bits("read_range values", r.values, want_v) == "");
  kv_entry e;
  REQUIRE_FALSE(snap.read_kv(7, e));
  CHECK(diff_bits("read_kv keys", e.keys, std::span(want_k).subspan(7 * w, w)) == "");
  CHECK(diff_bits("read_kv values", e.values, std::span(want_v).subspan(7 * w, w)) == "");

  std::size_t seen = 0, bad_sizes = 0;
  REQUIRE_FALSE(snap.for_each_block(0, n, [&](std::size_t, std::size_t count, auto k, auto v) {
    bad_sizes += k.size() == count * units && v.size() == count * units ? 0 : 1;
    seen += count;
  }));
  CHECK(seen == n);
  CHECK(bad_sizes == 0);
  const auto [qk, qv] = stored_units(snap, 0, n);
  CHECK(qk == quantized<T>(keys, c.key_scale));
  CHECK(qv == quantized<T>(values, c.value_scale));

  const std::size_t block_bytes = kv_block_pool::block_bytes_for<T>(c);
  CHECK(block_bytes == 2 * c.block_tokens * w / elements_per<T> * sizeof(T));
  CHECK(block_bytes == (std::is_same_v<T, q8_0> ? 544u : std::is_same_v<T, q4_0> ? 288u : 512u));
  CHECK(cache.pool().block_bytes() == block_bytes);
  const kv_cache_stats s = cache.stats();
  CHECK(s.blocks_in_use == (n + c.block_tokens - 1) / c.block_tokens);
  CHECK(s.bytes_in_use == s.blocks_in_use * block_bytes);
  CHECK(cache.pool().stats().bytes_in_use() == s.bytes_in_use);
}

TEMPLATE_TEST_CASE("a quantized sequence's appends and step read back quantized in every layer", "[quantized]", q8_0,
                   q4_0, fp8_e4m3) {
  using T = TestType;
  quant_seq<T> f;
  REQUIRE_FALSE(f.append(5, 1));  // across a block boundary
  REQUIRE_FALSE(f.append(1, 2));
  REQUIRE_FALSE(f.append(3, 3, true));  // a step
  REQUIRE(f.seq.size() == 9);
  CHECK(f.diff(f.seq.snapshot()) == "");
  const std::size_t block_bytes = kv_block_pool::block_bytes_for<T>(f.config);
  CHECK(f.pool.block_bytes() == block_bytes);
  CHECK(f.pool.stats().blocks_in_use == layers * 3);  // 9 tokens: 3 blocks a layer
  CHECK(f.pool.stats().bytes_in_use() == layers * 3 * block_bytes);
}

TEMPLATE_TEST_CASE("q8_0 and q4_0 caches refuse a head_dim that is not a multiple of 32, creating nothing",
                   "[quantized]", q8_0, q4_0) {
  asio::thread_pool threads{2};
  for (const std::size_t head_dim : {16u, 48u}) {
    INFO("head_dim " << head_dim);
    CHECK(not_refused<TestType>(threads, base_config(1.0f, 1.0f, head_dim)) == "");
    CHECK(kv_block_pool::block_bytes_for<half>(base_config(1.0f, 1.0f, head_dim)) > 0);  // fine for others
  }
}

TEST_CASE("scales are refused on caches other than fp8, and fp8 scales must be finite, positive and at most 1e30",
          "[quantized]") {
  asio::thread_pool threads{2};
  CHECK(not_refused<half>(threads, base_config(2.0f, 1.0f)) == "");
  CHECK(not_refused<q8_0>(threads, base_config(2.0f, 1.0f)) == "");
  CHECK(not_refused<q8_0>(threads, base_config(1.0f, 2.0f)) == "");
  CHECK(not_refused<q4_0>(threads, base_config(1.0f, 0.5f)) == "");
  CHECK(not_refused<float>(threads, base_config(2.0f, 1.0f)) == "");
  const float inf = std::numeric_limits<float>::infinity();
  for (const float bad : {0.0f, -0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(), inf, -inf, 1e31f}) {
    INFO("scale " << bad);
    CHECK(not_refused<fp8_e4m3>(threads, base_config(bad, 1.0f)) == "");
    CHECK(not_refused<fp8_e4m3>(threads, base_config(1.0f, bad)) == "");
  }
  for (const float good : {1e-3f, 0.5f, 3.0f, 1e29f}) {
    INFO("scale " << good);
    CHECK(kv_block_pool::block_bytes_for<fp8_e4m3>(base_config(good, good)) == 512);
    CHECK_FALSE(refused([&] { basic_layer_kv_cache<fp8_e4m3>(threads, base_config(good, good)); }));
  }
}

TEMPLATE_TEST_CASE("attend over a quantized snapshot equals attend over its floats; the span overloads agree",
                   "[quantized][attend]", q8_0, q4_0, fp8_e4m3) {
  using T = TestType;
  INFO("AVX2, FMA and F16C: " << ghostlink::detail::has_avx2_fma_f16c());
  for (const auto& [s, stored, rows, pending, name] : attend_cases) {
    INFO(name);
    kv_cache_config c = config_for<T>();
    c.num_heads = s.kv_heads;
    c.head_dim = s.head_dim;
    c.block_tokens = 16;
    quant_seq<T> f(c, kv_model_layout::full(1));
    REQUIRE_FALSE(f.append(stored, 7));
    const auto whole = f.seq.snapshot();
    const basic_kv_snapshot<T>& layer = whole.layer(0);
    const std::size_t w = c.token_width();
    kv_range r;
    REQUIRE_FALSE(layer.read_range(0, stored, r));
    const std::vector<float> pk = noise(pending * w, 70), pv = noise(pending * w, 71);
    std::vector<float> keys = r.keys, values = r.values;
    const auto pks = expected_floats<T>(pk, c.key_scale), pvs = expected_floats<T>(pv, c.value_scale);
    keys.insert(keys.end(), pks.begin(), pks.end());
    values.insert(values.end(), pvs.begin(), pvs.end());
    const std::vector<float> q = noise(rows * s.query_heads * s.head_dim, 90 + rows, 1.0f);
    std::vector<float> out(q.size(), -9.0f);
    REQUIRE_FALSE(attend(layer, q, out, s, {pk, pv}));
    CHECK(diff_close(out, attend_floats(keys, values, q, s)) == "");

    // Over the stored units themselves, without the pending tokens.
    REQUIRE_FALSE(attend(layer, q, out, s));
    const auto [qk, qv] = stored_units(layer, 0, stored);
    std::vector<float> flat(q.size(), -9.0f);
    if constexpr (std::is_same_v<T, fp8_e4m3>) {
      REQUIRE_FALSE(attend(std::span<const T>(qk), std::span<const T>(qv), q, flat, s, c.key_scale, c.value_scale));
    } else {
      REQUIRE_FALSE(attend(std::span<const T>(qk), std::span<const T>(qv), q, flat, s));
    }
    CHECK(diff_close(flat, out) == "");
    CHECK(diff_close(out, attend_floats(r.keys, r.values, q, s)) == "");
  }
}

TEMPLATE_TEST_CASE("attend over a windowed quantized layer equals attend over its sinks and window as floats",
                   "[quantized][attend]", q8_0, q4_0, fp8_e4m3) {
  using T = TestType;
  const std::size_t window = 8, sinks = 2;
  quant_seq<T> f(config_for<T>(), kv_model_layout::sliding(1, window, sinks));
  for (std::uint64_t chunk = 0; chunk < 6; ++chunk) REQUIRE_FALSE(f.append(5, 20 + chunk));
  const auto whole = f.seq.snapshot();
  const basic_kv_snapshot<T>& layer = whole.layer(0);
  const std::size_t n = layer.size();
  REQUIRE(n == 30);
  REQUIRE(layer.kept_from() > sinks);  // the window did drop tokens
  REQUIRE(layer.kept_from() <= n - window);
  kv_range head, tail;
  REQUIRE_FALSE(layer.read_range(0, sinks, head));
  REQUIRE_FALSE(layer.read_range(n - window, n, tail));
  CHECK(diff_bits("window keys", tail.keys, expected_floats<T>(f.raw_keys(0, n - window, n), f.config.key_scale)) ==
        "");
  head.keys.insert(head.keys.end(), tail.keys.begin(), tail.keys.end());
  head.values.insert(head.values.end(), tail.values.begin(), tail.values.end());
  const attention_shape s{.query_heads = 4, .kv_heads = 2, .head_dim = 32};
  const std::vector<float> q = noise(s.query_heads * s.head_dim, 33, 1.0f);
  std::vector<float> out(q.size(), -9.0f);
  REQUIRE_FALSE(attend(layer, q, out, s));
  CHECK(diff_close(out, attend_floats(head.keys, head.values, q, s)) == "");
}

// The AVX2 path widens fp8 codes through half, which turns a NaN code into
// a number; a run holding one takes exact loads. Either way attend gives
// NaN exactly where attending the dequantized floats does: a NaN key makes
// its query head's output NaN, a NaN value its own output lane.
TEST_CASE("attend over fp8 codes that hold a NaN gives NaN where attend over their floats does",
          "[quantized][attend]") {
  const attention_shape s{.query_heads = 4, .kv_heads = 2, .head_dim = 64};
  const std::size_t width = s.kv_heads * s.head_dim, tokens = 40;
  const std::vector<float> q = noise(s.query_heads * s.head_dim, 11, 1.0f);
  for (const bool in_keys : {false, true}) {
    INFO((in_keys ? "a NaN key" : "a NaN value"));
    std::vector<fp8_e4m3> k(tokens * width), v(tokens * width);
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = fp8_e4m3(std::sin(float(i)) * 3.0f);
      v[i] = fp8_e4m3(std::cos(float(i)) * 2.0f);
    }
    // Token 17, KV head 1, element 5: a NaN code (S.1111.111).
    (in_keys ? k : v)[17 * width + s.head_dim + 5] = fp8_e4m3::from_bits(0x7f);
    std::vector<float> kf(k.size()), vf(v.size());
    convert<float, fp8_e4m3>(k, kf.data());
    convert<float, fp8_e4m3>(v, vf.data());
    std::vector<float> got(q.size()), want(q.size());
    REQUIRE_FALSE(attend(std::span<const fp8_e4m3>(k), std::span<const fp8_e4m3>(v), q, got, s));
    REQUIRE_FALSE(attend(std::span<const float>(kf), std::span<const float>(vf), q, want, s));
    std::size_t nans = 0, differ = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      nans += std::isnan(want[i]) ? 1 : 0;
      if (std::isnan(got[i]) != std::isnan(want[i]) ||
          (!std::isnan(want[i]) && std::abs(got[i] - want[i]) > 1e-5f * (1.0f + std::abs(want[i]))))
        ++differ;
    }
    // A key: query heads 2 and 3 (KV head 1) all NaN; a value: lane 5 of them.
    CHECK(nans == (in_keys ? 2 * s.head_dim : 2));
    CHECK(differ == 0);
  }
}

TEST_CASE("attend over q8_0 or q4_0 spans whose head_dim is not a multiple of 32 is invalid_shape",
          "[quantized][attend]") {
  for (const attention_shape s : {attention_shape{.query_heads = 2, .kv_heads = 2, .head_dim = 16},
                                  attention_shape{.query_heads = 1, .kv_heads = 2, .head_dim = 48}}) {
    INFO("head_dim " << s.head_dim);
    const std::size_t groups = 2 * s.kv_heads * s.head_dim / 32;  // two tokens
    const std::vector<q8_0> k8(groups), v8(groups);
    const std::vector<q4_0> k4(groups), v4(groups);
    const std::vector<float> q = noise(s.query_heads * s.head_dim, 5, 1.0f);
    std::vector<float> out(q.size(), 5.0f);
    const std::vector<float> untouched = out;
    CHECK(attend(std::span<const q8_0>(k8), std::span<const q8_0>(v8), q, out, s) == kv_errc::invalid_shape);
    CHECK(attend(std::span<const q4_0>(k4), std::span<const q4_0>(v4), q, out, s) == kv_errc::invalid_shape);
    CHECK(out == untouched);
  }
}

TEMPLATE_TEST_CASE("a quantized sequence saves and loads bit for bit; other element types and scales are refused",
                   "[quantized][persist]", q8_0, q4_0, fp8_e4m3) {
  using T = TestType;
  using U = other_type<T>;
  quant_seq<T> f;
  REQUIRE_FALSE(f.append(9, 4));  // two full blocks and a partial one
  ghostlink::test::temp_dir dir;
  const std::filesystem::path file = dir.path / "q.glkv", other_file = dir.path / "other.glkv";
  const std::string model = "quantized-model";
  const auto save = [&](const std::filesystem::path& to, const kv_cache_config& c) {
    return wait_ec([&](auto tk) { return async_save(f.seq.snapshot(), to, kv_save_options{c, model}, tk); });
  };
  REQUIRE_FALSE(save(file, f.config));
  {
    const kv_block_pool pool = kv_block_pool::for_caches<T>(f.config);
    auto [ec, loaded, ids] = load_as<T>(f.threads, file, pool, {layers, f.config, model});
    REQUIRE_FALSE(ec);
    CHECK(ids == f.ids);
    CHECK(f.diff(loaded.snapshot()) == "");
  }
  const auto refused_load = [&]<class V>(const kv_cache_config& expected) {
    const kv_block_pool pool = kv_block_pool::for_caches<V>(expected);
    auto [ec, loaded, ids] = load_as<V>(f.threads, file, pool, {layers, expected, model});
    INFO("load: " << ec.message());
    CHECK(ec == kv_errc::element_type_mismatch);
    CHECK_FALSE(loaded.valid());
    CHECK(pool.stats().blocks_in_use == 0);
  };
  refused_load.template operator()<U>(config_for<U>());
  refused_load.template operator()<float>(base_config());
  if constexpr (std::is_same_v<T, fp8_e4m3>) {
    refused_load.template operator()<T>(base_config(1.0f, 3.0f));  // key_scale differs
    refused_load.template operator()<T>(base_config(0.5f, 2.0f));  // value_scale differs
    refused_load.template operator()<T>(base_config(3.0f, 0.5f));  // swapped
  } else {
    refused_load.template operator()<fp8_e4m3>(base_config(1.0f, 1.0f));
  }
  // A save whose options.config has other scales than the snapshot's.
  const float other = std::is_same_v<T, fp8_e4m3> ? 1.0f : 2.0f;
  CHECK(save(other_file, base_config(other, f.config.value_scale)) == kv_errc::invalid_config);
  CHECK(save(other_file, base_config(f.config.key_scale, other)) == kv_errc::invalid_config);
  CHECK_FALSE(std::filesystem::exists(other_file));
}

TEST_CASE("a q8_0 prefix cache inserts a sequence's blocks and attaches them, reading back the same data",
          "[quantized][prefix]") {
  quant_seq<q8_0> f;
  basic_kv_prefix_cache<q8_0> cache(layers, f.config, f.pool);
  REQUIRE_FALSE(f.append(10, 5));
  CHECK(cache.insert(f.seq, f.ids) == 2);
  CHECK(cache.match(f.ids) == 8);
  basic_sequence_kv_cache<q8_0> attached = cache.attach(f.threads, f.ids);
  REQUIRE(attached.size() == 8);
  const auto a = attached.snapshot(), o = f.seq.snapshot();
  CHECK(a.token_ids() == std::vector<token_id>(f.ids.begin(), f.ids.begin() + 8));
  for (std::size_t l = 0; l < layers; ++l) {
    kv_range ra, ro;
    REQUIRE_FALSE(a.layer(l).read_range(0, 8, ra));
    REQUIRE_FALSE(o.layer(l).read_range(0, 8, ro));
    CHECK(diff_bits(str("layer ", l, " keys"), ra.keys, ro.keys) == "");
    CHECK(diff_bits(str("layer ", l, " values"), ra.values, ro.values) == "");
    CHECK(diff_bits("expected", ra.keys, expected_floats<q8_0>(f.raw_keys(l, 0, 8), 1.0f)) == "");
    CHECK(stored_units(a.layer(l), 0, 8) == stored_units(o.layer(l), 0, 8));
  }
}

TEST_CASE("fp8 prefix caches of other scales hash the same tokens apart, and miss each other's store entries",
          "[quantized][prefix]") {
  const kv_cache_config a = base_config(0.5f, 3.0f), key_apart = base_config(0.25f, 3.0f),
                        value_apart = base_config(0.5f, 2.0f);
  ghostlink::test::temp_dir dir;
  asio::thread_pool io{2}, threads{2};
  auto store = std::make_shared<kv_file_store>(dir.path, kv_file_store_limits{.io_executor = io.get_executor()});
  {
    const kv_prefix_options options{.model = "fp8-model", .store = store};
    quant_seq<fp8_e4m3> f(a);
    basic_kv_prefix_cache<fp8_e4m3> writer(layers, a, f.pool, options);
    const kv_block_pool pool_k = kv_block_pool::for_caches<fp8_e4m3>(key_apart),
                        pool_v = kv_block_pool::for_caches<fp8_e4m3>(value_apart),
                        pool_same = kv_block_pool::for_caches<fp8_e4m3>(a);
    basic_kv_prefix_cache<fp8_e4m3> by_key(layers, key_apart, pool_k, options),
        by_value(layers, value_apart, pool_v, options), same(layers, a, pool_same, options);
    REQUIRE_FALSE(f.append(12, 6));
    const std::vector<token_id>& ids = f.ids;
    const std::vector<kv_block_hash> h = writer.block_hashes(ids), hk = by_key.block_hashes(ids),
                                     hv = by_value.block_hashes(ids);
    REQUIRE(h.size() == 3);
    CHECK(same.block_hashes(ids) == h);
    for (std::size_t b = 0; b < h.size(); ++b) {
      CHECK(h[b] != hk[b]);
      CHECK(h[b] != hv[b]);
      CHECK(hk[b] != hv[b]);
    }

    // Stored through the store by the writer; flushed so that it is there.
    CHECK(writer.insert(f.seq, ids) == 3);
    REQUIRE_FALSE(wait_ec([&](auto tk) { return writer.async_flush(tk); }));
    CHECK(store->stats().entries == 3);
    const auto attach = [&](basic_kv_prefix_cache<fp8_e4m3>& cache) {
      return cache.async_attach(threads.get_executor(), ids, {}, asio::use_future).get();
    };
    CHECK(attach(by_key).size() == 0);
    CHECK(attach(by_value).size() == 0);
    CHECK(by_key.stats().store_hit_tokens == 0);
    CHECK(by_value.stats().store_hit_tokens == 0);
    // The same scales on another pool: a hit, the same data.
    const basic_sequence_kv_cache<fp8_e4m3> hit = attach(same);
    CHECK(same.stats().store_hit_tokens == 12);
    REQUIRE(hit.size() == 12);
    const auto hs = hit.snapshot(), fs = f.seq.snapshot();
    for (std::size_t l = 0; l < layers; ++l) {
      CHECK(hs.layer(l).key_scale() == 0.5f);
      CHECK(hs.layer(l).value_scale() == 3.0f);
      CHECK(stored_units(hs.layer(l), 0, 12) == stored_units(fs.layer(l), 0, 12));
    }
  }
  store->flush();
  io.join();
  threads.join();
}

TEST_CASE("readers on two threads see exactly the quantized tokens of a q8_0 sequence while a writer appends",
          "[quantized][concurrency]") {
  const kv_cache_config c = base_config();
  const std::size_t w = c.token_width(), total = 48;
  const attention_shape s{.query_heads = 4, .kv_heads = 2, .head_dim = 32};
  std::vector<std::vector<float>> keys, values, want_k, want_v;
  for (std::size_t l = 0; l < layers; ++l) {
    keys.push_back(noise(total * w, 300 + 2 * l));
    values.push_back(noise(total * w, 301 + 2 * l));
    want_k.push_back(expected_floats<q8_0>(keys[l], 1.0f));
    want_v.push_back(expected_floats<q8_0>(values[l], 1.0f));
  }
  const std::vector<float> q = noise(s.query_heads * s.head_dim, 77, 1.0f);
  asio::thread_pool threads{2};
  basic_sequence_kv_cache<q8_0> seq(threads, layers, c);
  const auto append_token = [&](std::size_t at) {
    std::vector<std::span<const float>> ks, vs;
    for (std::size_t l = 0; l < layers; ++l) {
      ks.push_back(std::span<const float>(keys[l]).subspan(at * w, w));
      vs.push_back(std::span<const float>(values[l]).subspan(at * w, w));
    }
    return wait_ec([&](auto tk) { return seq.async_append(ks, vs, tk); });
  };
  REQUIRE_FALSE(append_token(0));  // so that every snapshot a reader takes holds a token
  shared_mismatches bad;
  std::atomic<bool> done{false};
  std::vector<std::size_t> reads(2, 0);
  std::vector<std::thread> readers;
  for (std::size_t t = 0; t < 2; ++t)
    readers.emplace_back([&, t] {
      std::vector<float> out(q.size()), ref(q.size());
      std::size_t last = 1;
      for (int i = 0; i < 20000 && (i < 50 || !done.load()); ++i) {
        const basic_sequence_snapshot<q8_0> snap = seq.snapshot();
        const std::size_t n = snap.size();
        if (n < last || n > total) bad.add(str("reader ", t, ": size ", n, " after ", last));
        if (n == 0 || n > total) continue;
        last = n;
        ++reads[t];
        const std::size_t l = static_cast<std::size_t>(i) % layers;
        kv_range r;
        if (ghostlink::error_code ec = snap.layer(l).read_range(0, n, r)) {
          bad.add(str("reader ", t, ": ", ec.message()));
          continue;
        }
        const auto ek = std::span<const float>(want_k[l]).first(n * w),
                   ev = std::span<const float>(want_v[l]).first(n * w);
        if (std::string d = diff_bits(str("layer ", l, " keys of ", n), r.keys, ek); !d.empty()) bad.add(d);
        if (std::string d = diff_bits(str("layer ", l, " values of ", n), r.values, ev); !d.empty()) bad.add(d);
        if (attend(snap.layer(l), q, out, s) || attend(ek, ev, q, ref, s)) {
          bad.add(str("reader ", t, ": attend failed"));
          continue;
        }
        if (std::string d = diff_close(out, ref); !d.empty()) bad.add(str("attend over ", n, ": ", d));
      }
    });
  std::size_t failures = 0;
  for (std::size_t at = 1; at < total; ++at) failures += append_token(at) ? 1 : 0;
  done = true;
  for (auto& r : readers) r.join();
  CHECK(failures == 0);
  CHECK(seq.size() == total);
  INFO(bad.log.count << " mismatch(es), first:\n" << bad.log.first);
  CHECK(bad.log.count == 0);
  CHECK(reads[0] > 0);
  CHECK(reads[1] > 0);
}

}  // namespace quantized_storage_tests
