// ghostlink::attend against a scalar double-precision reference: every
// element type, grouped-query shapes, runs that cross blocks and chunks,
// both instruction paths (a head_dim that is not a multiple of 8 takes the
// portable one), pending tokens, causal rows, the errors, and calls from two
// threads at once.
#include "common/sequence_support.hpp"

#ifdef GHOSTLINK_CATCH2_V3
#include <catch2/catch_template_test_macros.hpp>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace attend_tests {

using namespace ghostlink;
using namespace ghostlink::test::seq;

namespace {

/// Rounds `v` as a T cache stores it.
template <class T>
std::vector<float> stored_as(std::vector<float> v) {
  for (float& f : v) f = stored<T>(f);
  return v;
}

/// softmax(scale q.k) v in double precision, two passes, causal rows as
/// attend documents; `keys`/`values` are every token attended, as floats.
std::vector<float> reference(const attention_shape& s, const std::vector<float>& keys, const std::vector<float>& values,
                             const std::vector<float>& queries) {
  const std::size_t width = s.kv_heads * s.head_dim, row = s.query_heads * s.head_dim;
  const std::size_t total = keys.size() / width, rows = queries.size() / row, group = s.query_heads / s.kv_heads;
  const double scale = s.scale != 0.0f ? s.scale : 1.0 / std::sqrt(double(s.head_dim));
  std::vector<float> out(queries.size());
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t h = 0; h < s.query_heads; ++h) {
      const std::size_t seen = total - rows + r + 1, kv = (h / group) * s.head_dim;
      const float* q = queries.data() + r * row + h * s.head_dim;
      std::vector<double> logit(seen);
      for (std::size_t t = 0; t < seen; ++t) {
        double d = 0;
        for (std::size_t i = 0; i < s.head_dim; ++i) d += double(q[i]) * keys[t * width + kv + i];
        logit[t] = d * scale;
      }
      const double m = *std::max_element(logit.begin(), logit.end());
      double sum = 0;
      for (double& l : logit) sum += (l = std::exp(l - m));
      for (std::size_t i = 0; i < s.head_dim; ++i) {
        double o = 0;
        for (std::size_t t = 0; t < seen; ++t) o += logit[t] / sum * values[t * width + kv + i];
        out[r * row + h * s.head_dim + i] = static_cast<float>(o);
      }
    }
  return out;
}

/// The largest difference between two outputs (infinite if their sizes
/// differ). No Catch2 assertion: the concurrency test calls it off the main
/// thread.
double worst_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double w = 0;
  for (std::size_t i = 0; i < a.size(); ++i) w = std::max(w, std::abs(double(a[i]) - b[i]));
  return w;
}

/// A layer cache of `stored` tokens of noise and the floats it stores.
template <class T>
struct filled_cache {
  filled_cache(asio::thread_pool& pool, const attention_shape& s, std::size_t stored, std::size_t block_tokens)
      : cache(pool, {.max_tokens_per_seq = 1024,
                     .num_heads = s.kv_heads,
                     .head_dim = s.head_dim,
                     .block_tokens = block_tokens}) {
    const std::size_t width = s.kv_heads * s.head_dim;
    REQUIRE_FALSE(initialize(cache, std::max<std::size_t>(stored, 1)));
    for (std::size_t t = 0; t < stored; ++t) {
      const auto k = noise(width, 2 * t), v = noise(width, 2 * t + 1);
      REQUIRE_FALSE(write(cache, t, k, v));
      const auto ks = stored_as<T>(k), vs = stored_as<T>(v);
      keys.insert(keys.end(), ks.begin(), ks.end());
      values.insert(values.end(), vs.begin(), vs.end());
    }
  }
  basic_kv_snapshot<T> snapshot() const { return cache.snapshot().prefix(keys.size() / cache.config().token_width()); }

  basic_layer_kv_cache<T> cache;
  std::vector<float> keys, values;  // as stored
};

struct shape_case {
  attention_shape shape;
  const char* name = "";
};

const shape_case shapes[] = {
    {{.query_heads = 8, .kv_heads = 2, .head_dim = 64}, "GQA 8/2 x 64 (AVX2 where the CPU has it)"},
    {{.query_heads = 4, .kv_heads = 4, .head_dim = 16}, "MHA 4 x 16"},
    {{.query_heads = 6, .kv_heads = 1, .head_dim = 12, .scale = 0.3f}, "MQA 6/1 x 12 (portable), scale 0.3"},
};

}  // namespace

TEMPLATE_TEST_CASE("attend matches a double-precision reference over a snapshot", "[attend]", float, half, bfloat16) {
  asio::thread_pool pool{2};
  for (const auto& [s, name] : shapes)
    for (const std::size_t stored : {1u, 17u, 200u})
      for (const std::size_t block : {16u, 128u}) {
        INFO(name << ", " << stored << " tokens, blocks of " << block);
        const filled_cache<TestType> c(pool, s, stored, block);
        const auto snap = c.snapshot();
        REQUIRE(snap.size() == stored);
        for (const std::size_t rows : {std::size_t{1}, std::min<std::size_t>(2, stored)}) {
          const auto q = noise(rows * s.query_heads * s.head_dim, 1000 + rows);
          std::vector<float> out(q.size(), -7.0f);
          REQUIRE_FALSE(attend(snap, q, out, s));
          CHECK(worst_diff(out, reference(s, c.keys, c.values, q)) < 2e-5);
        }
      }
}

TEMPLATE_TEST_CASE("attend takes pending tokens after the snapshot, rounded as the write will store them", "[attend]",
                   float, half, bfloat16) {
  asio::thread_pool pool{2};
  for (const auto& [s, name] : shapes)
    for (const std::size_t pending : {1u, 3u}) {
      INFO(name << ", " << pending << " pending");
      const std::size_t width = s.kv_heads * s.head_dim, stored = 40;
      filled_cache<TestType> c(pool, s, stored, 16);
      const auto pk = noise(pending * width, 77), pv = noise(pending * width, 78);
      auto keys = c.keys, values = c.values;
      const auto pks = stored_as<TestType>(pk), pvs = stored_as<TestType>(pv);
      keys.insert(keys.end(), pks.begin(), pks.end());
      values.insert(values.end(), pvs.begin(), pvs.end());

      // One row (a decode step) and `pending` causal rows (a prefill step).
      for (const std::size_t rows : {std::size_t{1}, pending}) {
        const auto q = noise(rows * s.query_heads * s.head_dim, 500 + rows);
        std::vector<float> out(q.size());
        REQUIRE_FALSE(attend(c.snapshot(), q, out, s, {pk, pv}));
        CHECK(worst_diff(out, reference(s, keys, values, q)) < 2e-5);

        // The same as attending after the write.
        for (std::size_t t = 0; t < pending; ++t)
          REQUIRE_FALSE(write(c.cache, stored + t, std::span(pk).subspan(t * width, width),
                              std::span(pv).subspan(t * width, width)));
        std::vector<float> after(q.size());
        REQUIRE_FALSE(attend(c.cache.snapshot().prefix(stored + pending), q, after, s));
        CHECK(worst_diff(out, after) < 1e-5);
      }
    }
}

TEMPLATE_TEST_CASE("attend over contiguous tokens equals attend over a snapshot of them", "[attend]", float, half,
                   bfloat16) {
  asio::thread_pool pool{2};
  const attention_shape s = shapes[0].shape;
  const filled_cache<TestType> c(pool, s, 90, 16);
  const auto q = noise(s.query_heads * s.head_dim, 9);
  std::vector<TestType> keys, values;
  for (float f : c.keys) keys.push_back(TestType(f));
  for (float f : c.values) values.push_back(TestType(f));
  std::vector<float> flat(q.size()), paged(q.size());
  REQUIRE_FALSE(attend(std::span<const TestType>(keys), std::span<const TestType>(values), q, flat, s));
  REQUIRE_FALSE(attend(c.snapshot(), q, paged, s));
  CHECK(worst_diff(flat, paged) < 1e-6);
  CHECK(worst_diff(flat, reference(s, c.keys, c.values, q)) < 2e-5);
}

// The pass holds each block a few behind the one handed to it (to prefetch
// the block ahead) and attends the rest at the end: the sums must still be
// taken in token order, so the result is the contiguous one exactly.
TEMPLATE_TEST_CASE("attend over many blocks takes them in order: bit for bit the result over one buffer", "[attend]",
                   float, half, bfloat16) {
  asio::thread_pool pool{2};
  for (const auto& [s, name] : shapes)
    for (const std::size_t stored : {2u, 33u, 200u}) {
      INFO(name << ", " << stored << " tokens in 16-token blocks");
      const filled_cache<TestType> c(pool, s, stored, 16);
      std::vector<TestType> keys, values;
      for (float f : c.keys) keys.push_back(TestType(f));
      for (float f : c.values) values.push_back(TestType(f));
      for (const std::size_t rows : {std::size_t{1}, std::size_t{2}}) {
        const auto q = noise(rows * s.query_heads * s.head_dim, 40 + rows);
        std::vector<float> flat(q.size()), paged(q.size(), -3.0f);
        REQUIRE_FALSE(attend(std::span<const TestType>(keys), std::span<const TestType>(values), q, flat, s));
        REQUIRE_FALSE(attend(c.snapshot(), q, paged, s));
        CHECK(paged == flat);
      }
    }
}

TEST_CASE("attend rejects bad arguments and leaves the output unchanged", "[attend][errors]") {
  asio::thread_pool pool{2};
  const attention_shape s{.query_heads = 4, .kv_heads = 2, .head_dim = 8};
  const filled_cache<float> c(pool, s, 5, 4);
  const auto snap = c.snapshot();
  const std::size_t width = 16, row = 32;
  const auto q = noise(row, 1), one = noise(width, 2), two = noise(2 * width, 3);
  std::vector<float> out(2 * row, 5.0f);
  const auto untouched = out;
  const auto check = [&](ghostlink::error_code ec, kv_errc want) {
    CHECK(ec == want);
    CHECK(out == untouched);
  };
  for (const attention_shape bad :
       {attention_shape{0, 2, 8}, attention_shape{4, 0, 8}, attention_shape{4, 2, 0}, attention_shape{3, 2, 8}})
    check(attend(snap, q, out, bad), kv_errc::invalid_shape);
  check(attend(snap, q, out, {.query_heads = 4, .kv_heads = 4, .head_dim = 8}), kv_errc::width_mismatch);
  check(attend(snap, q, out, s, {one, two}), kv_errc::length_mismatch);
  check(attend(snap, q, out, s, {noise(7, 4), noise(7, 5)}), kv_errc::width_mismatch);
  check(attend(snap, std::span(q).first(row - 1), out, s), kv_errc::width_mismatch);
  check(attend(snap, {}, out, s), kv_errc::width_mismatch);
  check(attend(snap, noise(3 * row, 6), out, s), kv_errc::buffer_too_small);
  check(attend(snap, noise(2 * row, 6), std::span(out).first(row), s), kv_errc::buffer_too_small);
  check(attend(basic_kv_snapshot<float>{}, noise(2 * row, 6), out, s, {one, one}), kv_errc::index_out_of_range);
  check(attend(c.snapshot().prefix(1), noise(2 * row, 6), out, s), kv_errc::index_out_of_range);
  check(attend(std::span<const float>(one), std::span<const float>(two), q, out, s), kv_errc::length_mismatch);
  check(attend(std::span<const float>(one).first(9), std::span<const float>(one).first(9), q, out, s),
        kv_errc::width_mismatch);

  // An empty snapshot with pending tokens is a valid first step.
  REQUIRE_FALSE(attend(basic_kv_snapshot<float>{}, q, out, s, {one, one}));
  CHECK(worst_diff(std::vector<float>(out.begin(), out.begin() + row), reference(s, one, one, q)) < 2e-5);
}

TEST_CASE("attend runs on two threads at once over one snapshot while it is written", "[attend][concurrency]") {
  asio::thread_pool pool{2};
  const attention_shape s = shapes[0].shape;
  filled_cache<half> c(pool, s, 300, 16);
  const auto snap = c.snapshot();
  const std::size_t width = s.kv_heads * s.head_dim;
  std::vector<std::vector<float>> queries, expected;
  for (std::uint64_t i = 0; i < 4; ++i) {
    queries.push_back(noise(s.query_heads * s.head_dim, 40 + i));
    expected.push_back(reference(s, c.keys, c.values, queries.back()));
  }
  std::vector<double> worst(2, 0.0);
  std::vector<int> failures(2, 0);
  std::thread readers[2];
  for (int t = 0; t < 2; ++t)
    readers[t] = std::thread([&, t] {
      std::vector<float> out(queries[0].size());
      for (int i = 0; i < 200; ++i) {
        const std::size_t which = static_cast<std::size_t>(i + t) % queries.size();
        if (attend(snap, queries[which], out, s)) ++failures[t];
        worst[t] = std::max(worst[t], worst_diff(out, expected[which]));
      }
    });
  // Meanwhile the cache rewrites the tokens the snapshot pinned.
  for (std::size_t i = 0; i < 100; ++i) REQUIRE_FALSE(write(c.cache, i, noise(width, 9000 + i), noise(width, i)));
  for (auto& r : readers) r.join();
  CHECK(failures == std::vector<int>{0, 0});
  CHECK(worst[0] < 2e-5);
  CHECK(worst[1] < 2e-5);
}

}  // namespace attend_tests
