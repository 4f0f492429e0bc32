// Keys-only latent layers (DeepSeek's MLA): sequences whose layout stores
// keys alone, in blocks of half the bytes, on pools of that kind; their
// writes, reads and errors, forks, truncates and windows, save and load, and
// what refuses them.

#include "common/sequence_support.hpp"

#include "common/files.hpp"
#include "common/tiny_mla.hpp"

#include "common/asio_compat.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <thread>

namespace keys_only_tests {

using namespace ghostlink;
using namespace ghostlink::test::seq;
using ghostlink::test::small_config;
using ghostlink::test::wait_ec;

namespace {

/// `layout` with `keys_only` set.
kv_model_layout keys_only(kv_model_layout layout) {
  layout.keys_only = true;
  return layout;
}

/// Layer `l`'s keys of `tokens` tokens from `index` on, tagged `tag` (the
/// keys a `step` carries), and no values: a keys-only append's spans.
struct key_step {
  key_step(std::size_t layers, std::size_t width, std::size_t index, int tag, std::size_t tokens = 1)
      : full(layers, width, index, tag, tokens), values(layers) {}
  key_step(const key_step&) = delete;
  key_step& operator=(const key_step&) = delete;
  step full;                                     // its keys are these tokens' keys
  std::vector<std::span<const float>> values;    // empty spans
};

/// A keys-only sequence of `layout` on a keys-only pool of its own, and the
/// tag of each token appended.
struct latent {
  explicit latent(const kv_model_layout& layout, std::size_t max_tokens = 64)
      : config(config_for(max_tokens)),
        pool(kv_block_pool::for_caches(config, kv_block_kind::keys_only)),
        seq(threads, layout, config, pool),
        layers(layout.num_layers()),
        width(config.token_width()) {}

  static kv_cache_config config_for(std::size_t tokens) {
    kv_cache_config c = small_config();
    c.max_tokens_per_seq = tokens;
    return c;
  }
  /// Appends `n` tokens (one request) tagged `tag`; must succeed.
  void append_ok(std::size_t n, int tag) {
    const key_step st(layers, width, seq.size(), tag, n);
    REQUIRE_FALSE(append(seq, st.full.key_spans, st.values));
    tags.insert(tags.end(), n, tag);
  }
  /// "" if layer `l` of `snap` holds, from `begin` to its end, the keys
  /// appended and no values; else what differs.
  std::string diff_keys(const sequence_snapshot& snap, std::size_t l, std::size_t begin = 0) const {
    const kv_snapshot& s = snap.layer(l);
    if (s.value_width() != 0) return str("layer ", l, ": value_width() ", s.value_width());
    kv_range r;
    if (ghostlink::error_code ec = s.read_range(begin, s.size(), r)) return str("layer ", l, ": ", ec.message());
    if (!r.values.empty()) return str("layer ", l, ": read_range gave ", r.values.size(), " values");
    for (std::size_t i = begin; i < s.size(); ++i)
      for (std::size_t lane = 0; lane < width; ++lane)
        if (r.keys[(i - begin) * width + lane] != key_of(l, i, tags[i], lane))
          return str("layer ", l, " token ", i, " lane ", lane, ": ", r.keys[(i - begin) * width + lane]);
    return {};
  }

  asio::thread_pool threads{2};
  kv_cache_config config;
  kv_block_pool pool;
  sequence_kv_cache seq;
  std::size_t layers, width;
  std::vector<int> tags;
};

}  // namespace

TEST_CASE("a keys-only sequence takes keys with empty values and reads back keys and no values", "[keys_only]") {
  latent w(keys_only(kv_model_layout::full(3)));
  CHECK(w.seq.layout().keys_only);
  w.append_ok(5, 1);  // a prefill chunk across a block boundary
  w.append_ok(1, 2);
  // A step: each layer's keys written alone.
  {
    auto [ec, open] = begin_step(w.seq, std::size_t{2});
    REQUIRE_FALSE(ec);
    const key_step st(w.layers, w.width, w.seq.size(), 3, 2);
    for (std::size_t l = 0; l < w.layers; ++l)
      REQUIRE_FALSE(open.write(l, st.full.key_spans[l], std::span<const float>()));
    REQUIRE_FALSE(commit(open));
    w.tags.insert(w.tags.end(), 2, 3);
  }
  const sequence_snapshot snap = w.seq.snapshot();
  REQUIRE(snap.size() == 8);
  for (std::size_t l = 0; l < w.layers; ++l) {
    INFO("layer " << l);
    const kv_snapshot& s = snap.layer(l);
    CHECK(s.token_width() == w.width);
    CHECK(s.value_width() == 0);
    CHECK(w.diff_keys(snap, l).empty());
    // read_kv into spans: the keys, and an empty values span is enough.
    std::vector<float> keys(w.width, -1.0f);
    CHECK_FALSE(s.read_kv(6, keys, std::span<float>()));
    CHECK(keys[0] == key_of(l, 6, 3, 0));
    kv_entry entry{{1.0f}, {2.0f}};
    CHECK_FALSE(s.read_kv(0, entry));
    CHECK(entry.keys.size() == w.width);
    CHECK(entry.values.empty());
    // for_each_block: keys of every token, values spans empty.
    std::size_t tokens = 0, value_elements = 0;
    CHECK_FALSE(s.for_each_block(0, s.size(), [&](std::size_t, std::size_t count, auto k, auto v) {
      tokens += count;
      value_elements += v.size() + (k.size() == count * w.width ? 0 : 1000);
    }));
    CHECK(tokens == 8);
    CHECK(value_elements == 0);
  }
}

TEST_CASE("keys-only appends and step writes with values are length_mismatch and change nothing", "[keys_only]") {
  latent w(keys_only(kv_model_layout::full(2)));
  w.append_ok(3, 1);
  const observed before = observe(w.seq);
  // Values beside the keys (as a layout with values takes them).
  const step with_values(w.layers, w.width, w.seq.size(), 2);
  CHECK(append(w.seq, with_values) == kv_errc::length_mismatch);
  // Keys of the wrong width, no values.
  const key_step st(w.layers, w.width, w.seq.size(), 2);
  std::vector<std::span<const float>> short_keys;
  for (const auto& k : st.full.key_spans) short_keys.push_back(k.first(w.width - 1));
  CHECK(append(w.seq, short_keys, st.values) == kv_errc::width_mismatch);
  CHECK(observe(w.seq) == before);
  // A step's write with values, then one of the wrong width: refused, the
  // step still open and writable.
  auto [ec, open] = begin_step(w.seq, std::size_t{1});
  REQUIRE_FALSE(ec);
  CHECK(open.write(0, with_values.key_spans[0], with_values.value_spans[0]) == kv_errc::length_mismatch);
  CHECK(open.write(0, short_keys[0], std::span<const float>()) == kv_errc::width_mismatch);
  for (std::size_t l = 0; l < w.layers; ++l) CHECK_FALSE(open.write(l, st.full.key_spans[l], std::span<const float>()));
  REQUIRE_FALSE(commit(open));
  w.tags.push_back(2);
  for (std::size_t l = 0; l < w.layers; ++l) CHECK(w.diff_keys(w.seq.snapshot(), l).empty());
}

TEST_CASE("a keys-only block holds half the bytes, on a pool of its kind; other kinds are invalid_config",
          "[keys_only]") {
  const kv_cache_config c = small_config();
  const std::size_t full = kv_block_pool::block_bytes_for(c);
  const std::size_t half = kv_block_pool::block_bytes_for(c, kv_block_kind::keys_only);
  CHECK(half * 2 == full);
  const kv_block_pool kv_pool = kv_block_pool::for_caches(c);
  const kv_block_pool keys_pool = kv_block_pool::for_caches(c, kv_block_kind::keys_only);
  CHECK(kv_pool.kind() == kv_block_kind::keys_and_values);
  CHECK(keys_pool.kind() == kv_block_kind::keys_only);
  CHECK(keys_pool.block_bytes() == half);
  // The same bytes, another kind: a keys-only block of twice the width is
  // as large as a block of keys and values, and still refused.
  kv_cache_config wide = c;
  wide.num_heads *= 2;
  const kv_block_pool wide_keys = kv_block_pool::for_caches(wide, kv_block_kind::keys_only);
  REQUIRE(wide_keys.block_bytes() == kv_pool.block_bytes());

  asio::thread_pool threads{2};
  const kv_model_layout latent_layout = keys_only(kv_model_layout::full(2));
  CHECK(refused([&] { sequence_kv_cache(threads, latent_layout, c, kv_pool); }));
  CHECK(refused([&] { sequence_kv_cache(threads, kv_model_layout::full(2), wide, wide_keys); }));
  CHECK(refused([&] { sequence_kv_cache(threads, kv_model_layout::full(2), c, keys_pool); }));
  CHECK(refused([&] { layer_kv_cache(threads, wide, wide_keys); }));
  CHECK(refused([&] { kv_prefix_cache(2, wide, wide_keys); }));
  CHECK(refused([&] { kv_block_pool(half, {}, static_cast<kv_block_kind>(7)); }));
  CHECK(refused([&] { kv_block_pool(0, {}, kv_block_kind::keys_only); }));
  // On its kind, and on a private pool of its kind.
  sequence_kv_cache on_pool(threads, latent_layout, c, keys_pool);
  CHECK(on_pool.pool().kind() == kv_block_kind::keys_only);
  sequence_kv_cache private_pool(threads, latent_layout, c);
  CHECK(private_pool.pool().kind() == kv_block_kind::keys_only);
  CHECK(private_pool.pool().block_bytes() == half);
  // It holds half the bytes of the same tokens with values.
  const key_step st(2, c.token_width(), 0, 1, 9);
  REQUIRE_FALSE(append(on_pool, st.full.key_spans, st.values));
  sequence_kv_cache with_values(threads, kv_model_layout::full(2), c, kv_pool);
  REQUIRE_FALSE(append(with_values, st.full));
  CHECK(keys_pool.stats().bytes_in_use() * 2 == kv_pool.stats().bytes_in_use());
  CHECK(keys_pool.stats().blocks_in_use == kv_pool.stats().blocks_in_use);
}

TEST_CASE("keys-only sequences fork, truncate and slide windows as any other", "[keys_only]") {
  kv_model_layout layout = keys_only(kv_model_layout::interleaved(3, 3, 6, 1));  // layers 0, 1 windowed
  layout.rollback_tokens = 2;
  latent w(layout, 128);
  for (int tag = 1; tag <= 10; ++tag) w.append_ok(static_cast<std::size_t>(tag % 4 + 1), tag);
  const sequence_snapshot snap = w.seq.snapshot();
  for (std::size_t l = 0; l < 3; ++l) {
    INFO("layer " << l);
    const kv_snapshot& s = snap.layer(l);
    if (l < 2) {
      REQUIRE(s.kept_from() > s.sink_tokens());
      kv_entry dropped;
      CHECK(s.read_kv(s.kept_from() - 1, dropped) == kv_errc::outside_window);
    }
    CHECK(w.diff_keys(snap, l, l < 2 ? s.kept_from() : 0).empty());
  }
  // A fork shares the blocks; each side then goes its own way.
  auto [ec, child] = fork(w.seq);
  REQUIRE_FALSE(ec);
  CHECK(child.layout() == layout);
  const std::size_t at_fork = w.seq.size();
  REQUIRE_FALSE(truncate(child, at_fork - 2));  // within rollback_tokens
  const key_step other(3, w.width, child.size(), 99);
  REQUIRE_FALSE(append(child, other.full.key_spans, other.values));
  w.append_ok(1, 11);
  const sequence_snapshot parent = w.seq.snapshot(), forked = child.snapshot();
  CHECK(parent.size() == at_fork + 1);
  CHECK(forked.size() == at_fork - 1);
  for (std::size_t l = 0; l < 3; ++l) {
    kv_entry mine, theirs;
    REQUIRE_FALSE(parent.layer(l).read_kv(at_fork, mine));
    REQUIRE_FALSE(forked.layer(l).read_kv(at_fork - 2, theirs));
    CHECK(mine.keys[0] == key_of(l, at_fork, 11, 0));
    CHECK(theirs.keys[0] == key_of(l, at_fork - 2, 99, 0));
    CHECK(theirs.values.empty());
  }
  // Past rollback_tokens into a dropped window: refused, nothing changed.
  const observed before = observe(w.seq);
  CHECK(truncate(w.seq, 8) == kv_errc::outside_window);
  CHECK(observe(w.seq) == before);
}

namespace {

/// A load of `path` onto `pool` expecting `layout`.
std::pair<ghostlink::error_code, sequence_kv_cache> load_as(latent& w, const kv_block_pool& pool,
                                                            const std::filesystem::path& path,
                                                            std::optional<kv_model_layout> layout) {
  return load(w.threads.get_executor(), path, pool,
              {.num_layers = w.layers, .config = w.config, .layout = std::move(layout)});
}

}  // namespace

TEST_CASE("a keys-only sequence saves its keys alone and loads back; a load expecting the other kind is refused",
          "[keys_only]") {
  const kv_model_layout layout = keys_only(kv_model_layout::full(2));
  latent w(layout);
  w.append_ok(7, 1);
  w.append_ok(3, 2);  // 10 tokens: two blocks and a tail
  const ghostlink::test::temp_dir dir;
  const auto path = dir.path / "latent.glkv", full_path = dir.path / "full.glkv";
  REQUIRE_FALSE(wait_ec(
      [&](auto token) { return async_save(w.seq.snapshot(), path, kv_save_options{.config = w.config}, token); }));
  // The same tokens with values take about twice the bytes.
  sequence_kv_cache with_values(w.threads, kv_model_layout::full(2), w.config);
  const step st(2, w.width, 0, 1, 10);
  REQUIRE_FALSE(append(with_values, st));
  REQUIRE_FALSE(wait_ec([&](auto token) {
    return async_save(with_values.snapshot(), full_path, kv_save_options{.config = w.config}, token);
  }));
  const auto keys_bytes = std::filesystem::file_size(path), full_bytes = std::filesystem::file_size(full_path);
  CHECK(keys_bytes < full_bytes);
  CHECK(full_bytes - keys_bytes >= w.width * sizeof(float) * 20 - 128);

  auto [ec, loaded] = load_as(w, w.pool, path, layout);
  REQUIRE_FALSE(ec);
  CHECK(loaded.layout() == layout);
  CHECK(loaded.size() == 10);
  for (std::size_t l = 0; l < 2; ++l) CHECK(w.diff_keys(loaded.snapshot(), l).empty());
  // It goes on as any keys-only sequence.
  const key_step more(2, w.width, loaded.size(), 3, 2);
  REQUIRE_FALSE(append(loaded, more.full.key_spans, more.values));
  w.tags.insert(w.tags.end(), 2, 3);
  for (std::size_t l = 0; l < 2; ++l) CHECK(w.diff_keys(loaded.snapshot(), l).empty());
  // A layer read: keys, no values.
  const kv_range layer =
      async_read_layer<float>(path, 1, kv_sequence_expectation{.num_layers = 2, .config = w.config, .layout = layout},
                              asio::use_future)
          .get();
  CHECK(layer.keys.size() == 10 * w.width);
  CHECK(layer.values.empty());

  // Expecting the other kind: layout_mismatch, nothing made; either file.
  const kv_block_pool kv_pool = kv_block_pool::for_caches(w.config);
  CHECK(load_as(w, kv_pool, path, kv_model_layout::full(2)).first == kv_errc::layout_mismatch);
  CHECK(load_as(w, kv_pool, path, std::nullopt).first == kv_errc::layout_mismatch);
  CHECK(load_as(w, w.pool, full_path, layout).first == kv_errc::layout_mismatch);
  // A pool of the other kind than the layout expected: invalid_config.
  CHECK(load_as(w, kv_pool, path, layout).first == kv_errc::invalid_config);
}

TEST_CASE("a prefix cache of keys and values refuses keys-only sequences: invalid_config, nothing inserted",
          "[keys_only]") {
  const kv_cache_config c = small_config();
  asio::thread_pool threads{2};
  kv_block_pool keys_pool = kv_block_pool::for_caches(c, kv_block_kind::keys_only);
  kv_block_pool kv_pool = kv_block_pool::for_caches(c);
  kv_prefix_cache prefix(2, c, kv_pool);
  sequence_kv_cache seq(threads, keys_only(kv_model_layout::full(2)), c, keys_pool);
  const key_step st(2, c.token_width(), 0, 1, 8);
  std::vector<token_id> ids(8);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<token_id>(i + 1);
  REQUIRE_FALSE(wait_ec([&](auto token) {
    return seq.async_append(std::span<const token_id>(ids), st.full.key_spans, st.values, token);
  }));
  CHECK(refused([&] { (void)prefix.insert(seq, ids); }));
  CHECK(refused([&] { (void)prefix.insert_stored_tokens(seq); }));
  CHECK(prefix.stats().cached_blocks == 0);
}

}  // namespace keys_only_tests

namespace keys_only_tests {
namespace {

/// Deterministic floats in [-1, 1).
std::vector<float> noise(std::size_t n, std::uint32_t seed) {
  std::vector<float> v(n);
  std::uint32_t s = seed * 2654435761u + 1;
  for (float& x : v) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<float>(s >> 8) / static_cast<float>(1u << 23) - 1.0f;
  }
  return v;
}

/// Attention as plain loops over `keys` (token-major, `kv_heads * head_dim`
/// a token), each key's first `value_dim` elements its value: row `r` of
/// `rows` attends the tokens up to its own position (`window` 0) or its
/// window and `sinks`.
std::vector<float> reference(std::span<const float> keys, std::span<const float> queries, const attention_shape& s,
                             std::size_t window = 0, std::size_t sinks = 0) {
  const std::size_t width = s.kv_heads * s.head_dim, total = keys.size() / width;
  const std::size_t rows = queries.size() / (s.query_heads * s.head_dim), group = s.query_heads / s.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  std::vector<float> out(rows * s.query_heads * s.value_dim);
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t p = total - rows + r;
    for (std::size_t h = 0; h < s.query_heads; ++h) {
      const float* q = queries.data() + (r * s.query_heads + h) * s.head_dim;
      const std::size_t off = h / group * s.head_dim;
      std::vector<double> w(p + 1, 0.0);
      double top = -1e300, sum = 0;
      for (std::size_t j = 0; j <= p; ++j) {
        if (window != 0 && j >= sinks && j + window <= p) continue;
        double d = 0;
        for (std::size_t i = 0; i < s.head_dim; ++i) d += double(q[i]) * keys[j * width + off + i];
        w[j] = d * scale;
        top = std::max(top, w[j]);
      }
      for (std::size_t j = 0; j <= p; ++j) {
        const bool seen = window == 0 || j < sinks || j + window > p;
        sum += w[j] = seen ? std::exp(w[j] - top) : 0.0;
      }
      for (std::size_t i = 0; i < s.value_dim; ++i) {
        double acc = 0;
        for (std::size_t j = 0; j <= p; ++j) acc += w[j] * keys[j * width + off + i];
        out[(r * s.query_heads + h) * s.value_dim + i] = static_cast<float>(acc / sum);
      }
    }
  }
  return out;
}

/// The largest difference between two outputs.
float max_diff(std::span<const float> a, std::span<const float> b) {
  float d = a.size() == b.size() ? 0.0f : INFINITY;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

}  // namespace

TEST_CASE("attend with value_dim over a keys-only layer is a reference loop's attention, stored and pending",
          "[keys_only]") {
  const std::size_t kv_heads = GENERATE(1, 2), value_dim = GENERATE(8, 16), rows = GENERATE(1, 3);
  const std::size_t window = GENERATE(0, 5);
  INFO("kv_heads " << kv_heads << ", value_dim " << value_dim << ", rows " << rows << ", window " << window);
  const attention_shape shape{.query_heads = 4, .kv_heads = kv_heads, .head_dim = 16, .value_dim = value_dim};
  const kv_cache_config c{.max_tokens_per_seq = 64, .num_heads = kv_heads, .head_dim = 16, .block_tokens = 4};
  const std::size_t width = c.token_width();
  asio::thread_pool threads{2};
  kv_model_layout layout = keys_only(window ? kv_model_layout::sliding(1, window, 2) : kv_model_layout::full(1));
  layout.rollback_tokens = 3;
  sequence_kv_cache seq(threads, layout, c);
  const std::size_t stored_tokens = 23;
  const std::vector<float> keys = noise((stored_tokens + rows) * width, 7);
  const std::span<const float> stored_keys = std::span(keys).first(stored_tokens * width);
  const std::vector<std::span<const float>> k{stored_keys}, v{std::span<const float>()};
  REQUIRE_FALSE(append(seq, k, v));
  const std::vector<float> queries = noise(rows * shape.query_heads * shape.head_dim, 11);
  const std::vector<float> want = reference(keys, queries, shape, window, 2);
  std::vector<float> out(rows * shape.query_heads * value_dim + 1, 7.0f);
  // The rows' tokens pending (a step's, before its write), keys alone.
  const pending_tokens pending{std::span(keys).subspan(stored_tokens * width), {}};
  REQUIRE_FALSE(attend(seq.snapshot().layer(0), queries, out, shape, pending));
  CHECK(max_diff(std::span(out).first(want.size()), want) < 1e-4f);
  CHECK(out.back() == 7.0f);  // nothing past the rows' outputs
  // The same tokens stored.
  const std::vector<std::span<const float>> rest{std::span(keys).subspan(stored_tokens * width)};
  REQUIRE_FALSE(append(seq, rest, v));
  std::vector<float> again(want.size());
  REQUIRE_FALSE(attend(seq.snapshot().layer(0), queries, again, shape));
  CHECK(max_diff(again, want) < 1e-4f);
  // Over the keys as a span, keys alone.
  if (window == 0) {
    std::vector<float> flat(want.size());
    REQUIRE_FALSE(attend(std::span<const float>(keys), std::span<const float>(), queries, flat, shape));
    CHECK(max_diff(flat, want) < 1e-4f);
  }
}

TEST_CASE("attend's keys-only refusals: value_dim past head_dim or beside stored values, values pending, a short out",
          "[keys_only]") {
  const kv_cache_config c{.max_tokens_per_seq = 16, .num_heads = 1, .head_dim = 16, .block_tokens = 4};
  asio::thread_pool threads{2};
  sequence_kv_cache latent_seq(threads, keys_only(kv_model_layout::full(1)), c);
  sequence_kv_cache full_seq(threads, kv_model_layout::full(1), c);
  const std::vector<float> keys = noise(std::size_t{64}, 3);
  const std::vector<std::span<const float>> k{keys}, none{std::span<const float>()};
  REQUIRE_FALSE(append(latent_seq, k, none));
  REQUIRE_FALSE(append(full_seq, k, k));
  const std::vector<float> q = noise(std::size_t{32}, 5);
  std::vector<float> out(std::size_t{16}, 3.0f);
  const auto untouched = [&] { return std::all_of(out.begin(), out.end(), [](float f) { return f == 3.0f; }); };
  const attention_shape mla{.query_heads = 2, .kv_heads = 1, .head_dim = 16, .value_dim = 8};
  CHECK(attend(full_seq.snapshot().layer(0), q, out, mla) == kv_errc::invalid_shape);
  attention_shape too_wide = mla;
  too_wide.value_dim = 17;
  CHECK(attend(latent_seq.snapshot().layer(0), q, out, too_wide) == kv_errc::invalid_shape);
  const std::vector<float> one = noise(16, 9);
  CHECK(attend(latent_seq.snapshot().layer(0), q, out, mla, pending_tokens{one, one}) == kv_errc::length_mismatch);
  std::vector<float> short_out(2 * 8 - 1, 3.0f);
  CHECK(attend(latent_seq.snapshot().layer(0), q, short_out, mla) == kv_errc::buffer_too_small);
  CHECK(std::all_of(short_out.begin(), short_out.end(), [](float f) { return f == 3.0f; }));
  CHECK(untouched());
  // value_dim 0 over a keys-only layer: each whole key is its value.
  std::vector<float> whole(std::size_t{32});
  CHECK_FALSE(attend(latent_seq.snapshot().layer(0), q, whole, attention_shape{2, 1, 16}));
  attention_shape as_value = mla;
  as_value.value_dim = 16;
  CHECK(max_diff(whole, reference(keys, q, as_value)) < 1e-4f);
  CHECK_FALSE(attend(latent_seq.snapshot().layer(0), q, out, mla));
  CHECK(max_diff(out, reference(keys, q, mla)) < 1e-4f);
}

TEST_CASE(
    "an MLA-shaped decoder over a keys-only cache matches a recompute without a cache, across forks and truncates",
    "[keys_only]") {
  using ghostlink::test::tiny_mla;
  const tiny_mla model(2, 42);
  asio::thread_pool threads{2};
  const kv_cache_config c = tiny_mla::config(64);
  kv_block_pool pool = kv_block_pool::for_caches(c, kv_block_kind::keys_only);
  kv_model_layout layout = keys_only(kv_model_layout::full(model.num_layers()));
  sequence_kv_cache seq(threads, layout, c, pool);
  std::vector<token_id> tokens;
  std::vector<std::vector<float>> logits;
  // Decodes `ids` through `s` after `history`, checking each position's
  // logits against a recompute of the whole list.
  const auto decode = [&](sequence_kv_cache& s, std::vector<token_id>& history, std::span<const token_id> ids) {
    for (const token_id id : ids) {
      std::vector<float> got;
      REQUIRE_FALSE(model.decode_step(s, id, got));
      history.push_back(id);
      const std::vector<std::vector<float>> want = model.recompute(history);
      INFO("position " << history.size() - 1);
      CHECK(max_diff(got, want.back()) < 1e-3f);
    }
  };
  const std::vector<token_id> prompt{3, 1, 4, 1, 5, 9, 2, 6, 5, 3};
  decode(seq, tokens, prompt);
  // A fork decodes on its own from the same prefix.
  auto [ec, child] = fork(seq);
  REQUIRE_FALSE(ec);
  std::vector<token_id> child_tokens = tokens;
  decode(child, child_tokens, std::vector<token_id>{7, 7, 8});
  decode(seq, tokens, std::vector<token_id>{2, 7, 1});
  // A truncate takes tokens back; decoding goes on from there.
  REQUIRE_FALSE(truncate(seq, 6));
  tokens.resize(6);
  decode(seq, tokens, std::vector<token_id>{11, 12, 13, 14, 15});
  REQUIRE_FALSE(truncate(child, 9));
  child_tokens.resize(9);
  decode(child, child_tokens, std::vector<token_id>{0, 31});
  // What the cache holds is the recompute's stored vectors: both sides
  // still hold what they decoded.
  CHECK(seq.size() == tokens.size());
  CHECK(child.size() == child_tokens.size());
}

TEST_CASE("two threads append to keys-only sequences while two others attend them", "[keys_only]") {
  const kv_cache_config c{.max_tokens_per_seq = 256, .num_heads = 1, .head_dim = 16, .block_tokens = 4};
  asio::thread_pool threads{2};
  kv_block_pool pool = kv_block_pool::for_caches(c, kv_block_kind::keys_only);
  std::vector<sequence_kv_cache> seqs;
  for (int i = 0; i < 2; ++i) seqs.emplace_back(threads, keys_only(kv_model_layout::sliding(1, 24, 2)), c, pool);
  const attention_shape mla{.query_heads = 4, .kv_heads = 1, .head_dim = 16, .value_dim = 8};
  std::atomic<bool> done{false};
  shared_mismatches bad;
  std::vector<std::thread> workers;
  for (std::size_t w = 0; w < 2; ++w)
    workers.emplace_back([&, w] {
      for (std::size_t t = 0; t < c.max_tokens_per_seq; ++t) {
        // Every lane of token t is t + w: a value is exact, and a key too.
        const std::vector<float> key(16, static_cast<float>(t + w));
        const std::vector<std::span<const float>> k{key}, none{std::span<const float>()};
        if (append(seqs[w], k, none)) bad.add("append failed");
      }
    });
  for (std::size_t r = 0; r < 2; ++r)
    workers.emplace_back([&, r] {
      const std::vector<float> q(std::size_t{64}, 0.0f);  // equal weights: the mean of the window's values
      std::vector<float> out(std::size_t{32});
      for (std::size_t i = 0; i < 100000 && !done.load(); ++i) {
        const sequence_snapshot pinned = seqs[r].snapshot();
        const kv_snapshot& snap = pinned.layer(0);
        if (snap.size() == 0) continue;
        // The next token's row, its key pending (lanes n + r, as the
        // writer's token n will be): sinks 0, 1 and the window up to it.
        const std::size_t n = snap.size();
        const std::vector<float> next(16, static_cast<float>(n + r));
        if (ghostlink::error_code ec = attend(snap, q, out, mla, pending_tokens{next, {}})) {
          bad.add(str("attend at ", n, ": ", ec.message()));
          continue;
        }
        double sum = 0, count = 0;
        for (std::size_t j = 0; j <= n; ++j)
          if (j < 2 || j + 24 > n) sum += static_cast<double>(j + r), ++count;
        if (std::abs(out[0] - sum / count) > 1e-3 || out[7] != out[0]) bad.add(str("mean ", out[0], " at ", n));
      }
    });
  workers[0].join();
  workers[1].join();
  done.store(true);
  workers[2].join();
  workers[3].join();
  INFO(bad.log.first);
  CHECK(bad.log.count == 0);
  CHECK(seqs[0].size() == c.max_tokens_per_seq);
  CHECK(seqs[1].size() == c.max_tokens_per_seq);
}

}  // namespace keys_only_tests
