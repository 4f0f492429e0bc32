// The prefix cache over a layout (include/ghostlink/prefix_cache.hpp, docs/API.md,
// "Hybrid models"): the hash of a layout, the match rule at window edges,
// blocks cached as they fill (track), attaches holding only their windows,
// keys-only and quantized entries, the hybrid eviction policy, pins, block
// stores with layouts, and two threads under a tight budget.

#include "common/files.hpp"
#include "common/prefix_support.hpp"
#include "prefix/window_rule.hpp"
#include "store/entry.hpp"

#include <atomic>
#include <fstream>
#include <thread>

namespace prefix_layout_tests {

using namespace ghostlink;
using namespace ghostlink::test::prefix;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t bt = 4;  // config().block_tokens

/// Layer 0 windowed (8 tokens, `sinks`), layer 1 full: a hybrid model of two layers.
kv_model_layout hybrid_layout(std::size_t sinks = 0) { return kv_model_layout::interleaved(2, 2, 8, sinks); }

kv_block_kind kind_of(const kv_model_layout& layout) {
  return layout.keys_only ? kv_block_kind::keys_only : kv_block_kind::keys_and_values;
}

/// A pool and a prefix cache of `layout`, with sequences of that layout.
template <class T = float>
struct layout_fixture {
  explicit layout_fixture(kv_model_layout l, std::size_t max_blocks = 1000, kv_prefix_options options = {},
                          kv_cache_config c = config())
      : layout(std::move(l)),
        conf(c),
        pool(kv_block_pool::for_caches<T>(c, kind_of(layout), {.max_blocks = max_blocks})),
        cache(layout, c, pool, std::move(options)) {}
  layout_fixture(const layout_fixture&) = delete;
  layout_fixture& operator=(const layout_fixture&) = delete;
  ~layout_fixture() { threads.join(); }

  basic_sequence_kv_cache<T> make() { return basic_sequence_kv_cache<T>(threads, layout, conf, pool); }

  /// Appends `ids` with their key() data (keys alone for a keys-only layout).
  ghostlink::error_code append(const basic_sequence_kv_cache<T>& seq, std::span<const token_id> ids) {
    const std::size_t width = conf.token_width(), at = seq.size();
    std::vector<std::vector<float>> keys(seq.num_layers()), values(seq.num_layers());
    std::vector<std::span<const float>> ks, vs;
    for (std::size_t l = 0; l < seq.num_layers(); ++l) {
      for (std::size_t t = 0; t < ids.size(); ++t)
        for (std::size_t lane = 0; lane < width; ++lane) {
          keys[l].push_back(key(l, at + t, ids[t], lane));
          if (!layout.keys_only) values[l].push_back(-key(l, at + t, ids[t], lane));
        }
      ks.emplace_back(keys[l]);
      vs.emplace_back(values[l]);
    }
    return wait_ec([&](auto token) { return seq.async_append(ids, ks, vs, token); });
  }
  /// A new tracked sequence holding `ids`, appended `chunk` tokens at a time.
  basic_sequence_kv_cache<T> tracked(std::span<const token_id> ids, std::size_t chunk = 1000) {
    basic_sequence_kv_cache<T> seq = make();
    cache.track(seq);
    for (std::size_t i = 0; i < ids.size(); i += chunk)
      REQUIRE(append(seq, ids.subspan(i, std::min(chunk, ids.size() - i))) == ghostlink::error_code());
    return seq;
  }
  /// "" when `seq` holds `ids` and each layer's key() data at every
  /// position it holds (a windowed layer: its sinks and from kept_from()).
  std::string held_diff(const basic_sequence_kv_cache<T>& seq, std::span<const token_id> ids) const {
    const auto snap = seq.snapshot();
    if (snap.size() != ids.size()) return str("size ", snap.size(), ", expected ", ids.size());
    if (snap.token_ids() != std::vector<token_id>(ids.begin(), ids.end())) return "token ids differ";
    const std::size_t width = conf.token_width();
    for (std::size_t l = 0; l < snap.num_layers(); ++l) {
      const auto& layer = snap.layer(l);
      for (std::size_t p = 0; p < ids.size(); ++p) {
        if (p >= layer.sink_tokens() && p < layer.kept_from()) continue;
        kv_range r;
        if (ghostlink::error_code ec = layer.read_range(p, p + 1, r))
          return str("layer ", l, " @", p, ": ", ec.message());
        for (std::size_t lane = 0; lane < width; ++lane) {
          const float k = static_cast<float>(T(key(l, p, ids[p], lane)));
          if (r.keys[lane] != k) return str("layer ", l, " @", p, " lane ", lane, ": key ", r.keys[lane], " not ", k);
          if (!layout.keys_only && r.values[lane] != -k) return str("layer ", l, " @", p, ": value");
        }
      }
    }
    return {};
  }

  kv_model_layout layout;
  kv_cache_config conf;
  asio::thread_pool threads{2};
  kv_block_pool pool;
  basic_kv_prefix_cache<T> cache;
};

std::vector<token_id> first(const std::vector<token_id>& t, std::size_t n) {
  return {t.begin(), t.begin() + static_cast<std::ptrdiff_t>(n)};
}

}  // namespace

TEST_CASE("layouts: a full layout hashes as before; windows, sinks and keys only change every hash, rollback does not",
          "[prefix][layouts]") {
  const auto t = run(1, 8);
  fixture plain;  // 2 full layers through the constructor taking a number of layers
  layout_fixture full(kv_model_layout::full(2));
  CHECK(full.cache.block_hashes(t) == plain.cache.block_hashes(t));
  CHECK(full.cache.layout() == kv_model_layout::full(2));
  kv_model_layout rolled = hybrid_layout();
  rolled.rollback_tokens = 3;
  layout_fixture hybrid(hybrid_layout()), with_rollback(rolled);
  CHECK(with_rollback.cache.block_hashes(t) == hybrid.cache.block_hashes(t));
  kv_model_layout keys_only = kv_model_layout::full(2);
  keys_only.keys_only = true;
  std::vector<std::vector<kv_block_hash>> seen{plain.cache.block_hashes(t)};
  for (const kv_model_layout& l : {hybrid_layout(), hybrid_layout(2), kv_model_layout::interleaved(2, 2, 12),
                                   kv_model_layout::sliding(2, 8), keys_only}) {
    layout_fixture f(l);
    seen.push_back(f.cache.block_hashes(t));
  }
  check_apart(seen);
}

TEST_CASE("the match rule at window edges: a block just outside the window is not needed, one just inside is, "
          "and the answer is the longest valid length",
          "[prefix][layouts]") {
  // Layer 0 windowed, layer 1 full; 6 blocks of 4 tokens; `missing` lacks
  // those blocks of layer 0.
  const auto longest = [](const kv_model_layout& layout, std::vector<std::size_t> missing) {
    const detail::window_rule rule(layout, bt);
    return rule.longest(6, [&](std::size_t l, std::size_t j) {
      return l != 0 || std::find(missing.begin(), missing.end(), j) == missing.end();
    });
  };
  // Window 8 at L = 24 attends 17..23: blocks 4 and 5.
  CHECK(longest(hybrid_layout(), {}) == 6);
  CHECK(longest(hybrid_layout(), {3}) == 6);  // just outside
  CHECK(longest(hybrid_layout(), {4}) == 4);  // just inside: L = 20 needs 3, 4; L = 16 needs 2, 3
  CHECK(longest(hybrid_layout(), {5}) == 5);  // 20 needs blocks 3 and 4
  CHECK(longest(hybrid_layout(), {0, 1, 2, 3}) == 6);
  CHECK(longest(hybrid_layout(), {0, 1, 2}) == 6);
  CHECK(longest(hybrid_layout(), {1}) == 6);  // not monotone: 6 blocks match, 2 to 3 do not
  CHECK(longest(hybrid_layout(), {1, 4}) == 4);
  CHECK(longest(hybrid_layout(), {1, 3, 5}) == 1);
  // Window 9 at L = 24 attends 16..23: block 3 is still outside; 10 reaches it.
  CHECK(longest(kv_model_layout::interleaved(2, 2, 9), {3}) == 6);
  CHECK(longest(kv_model_layout::interleaved(2, 2, 10), {3}) == 3);
  // Sinks: block 0 is needed by every match (2 sinks), blocks 0 and 1 by 5.
  CHECK(longest(hybrid_layout(2), {0}) == 0);
  CHECK(longest(hybrid_layout(2), {1, 2, 3}) == 6);
  CHECK(longest(hybrid_layout(5), {1}) == 1);
  // The rule's needs and the start of what an attached layer holds.
  const detail::window_rule rule(hybrid_layout(2), bt);
  CHECK(rule.kept_from(0, 6) == 16);
  CHECK(rule.kept_from(0, 2) == 2);  // every position from the sinks on
  CHECK(rule.needs(0, 0, 6));
  CHECK_FALSE(rule.needs(0, 3, 6));
  CHECK(rule.needs(0, 4, 6));
  CHECK(rule.needs(1, 3, 6));
}

TEST_CASE("the match rule through a cache: after the window dropped the early blocks, 24 tokens match and 20 do not",
          "[prefix][layouts]") {
  layout_fixture f(hybrid_layout());
  const auto t = run(10, 24);
  auto seq = f.make();
  REQUIRE(f.append(seq, t) == ghostlink::error_code());
  CHECK(f.cache.insert(seq, t) == 6);  // after the fact: layer 0 holds blocks 4 and 5 only
  CHECK(f.cache.match(t) == 24);
  CHECK(f.cache.match(first(t, 23)) == 0);
  CHECK(f.cache.match(first(t, 20)) == 0);
  CHECK(f.cache.match(first(t, 8)) == 0);
  CHECK(f.pool.stats().blocks_cached == 6 + 2);
  const auto hit = f.cache.attach(f.threads, t);
  CHECK(hit.size() == 24);
  CHECK(f.held_diff(hit, t) == "");
}

TEST_CASE("track caches every block as it fills, before the window drops it", "[prefix][layouts]") {
  layout_fixture f(hybrid_layout());
  const auto t = run(10, 24), u = run(500, 24);
  // One prefill of 24 tokens: the window drops blocks 0 to 3 in the same drain.
  const auto seq = f.tracked(t);
  CHECK(f.cache.stats().cached_entries == 6);
  CHECK(f.pool.stats().blocks_cached == 12);
  for (std::size_t n = 4; n <= 24; n += 4) CHECK(f.cache.match(first(t, n)) == n);
  // Token by token, as a decoder appends: each block at the append that
  // fills it (a sequence that keeps 8 more tokens for rollbacks: the same
  // layers, so the same cache).
  kv_model_layout rolled = hybrid_layout();
  rolled.rollback_tokens = 8;
  const sequence_kv_cache decoded(f.threads, rolled, f.conf, f.pool);
  f.cache.track(decoded);
  for (std::size_t i = 0; i < u.size(); ++i)
    REQUIRE(f.append(decoded, std::span(u).subspan(i, 1)) == ghostlink::error_code());
  for (std::size_t n = 4; n <= 24; n += 4) CHECK(f.cache.match(first(u, n)) == n);
  // A truncate forgets what it cut: what follows is hashed after the new tokens.
  REQUIRE(truncate(decoded, 18) == ghostlink::error_code());
  auto v = first(u, 18);
  for (token_id i = 0; i < 10; ++i) v.push_back(9000 + i);
  REQUIRE(f.append(decoded, std::span(v).subspan(18)) == ghostlink::error_code());
  CHECK(f.cache.match(v) == 28);
  const auto again = f.cache.attach(f.threads, v);
  CHECK(f.held_diff(again, first(v, 28)) == "");
  // Untracked, the same prompt finds the early windowed blocks gone.
  f.cache.untrack(seq);
  const auto w = run(3000, 24);
  auto late = f.make();
  f.cache.track(late);
  f.cache.untrack(late);
  REQUIRE(f.append(late, w) == ghostlink::error_code());
  CHECK(f.cache.match(first(w, 8)) == 0);
  CHECK(f.cache.insert(late, w) == 6);
  CHECK(f.cache.match(first(w, 8)) == 0);
  CHECK(f.cache.match(w) == 24);
}

TEST_CASE("track after clear(): with a full layer nothing goes in past the gap, and no match reads past it",
          "[prefix][layouts]") {
  // A full layout and a hybrid one: clear() drops entries a tracked
  // sequence still uses; its next blocks would need ancestors holding no
  // full layer's block: they are not inserted, and nothing matches.
  for (const kv_model_layout& layout : {kv_model_layout::full(2), hybrid_layout()}) {
    INFO(layout);
    layout_fixture f(layout);
    const auto t = run(10, 16);
    const auto seq = f.make();
    f.cache.track(seq);
    REQUIRE(f.append(seq, first(t, 8)) == ghostlink::error_code());
    CHECK(f.cache.match(t) == 8);
    f.cache.clear();
    REQUIRE(f.append(seq, std::span(t).subspan(8)) == ghostlink::error_code());
    CHECK(f.cache.stats().cached_entries == 0);
    CHECK(f.cache.match(t) == 0);
    const auto hit = f.cache.attach(f.threads, t);
    CHECK(hit.size() == 0);
    // An insert of the whole prompt puts the chain back: all of it matches.
    CHECK(f.cache.insert(seq, t) == 4);
    CHECK(f.cache.match(t) == 16);
    const auto again = f.cache.attach(f.threads, t);
    CHECK(f.held_diff(again, t) == "");
  }
  // Every layer windowed: the ancestors come back holding nothing (the
  // windows had dropped them), and a match that needs only the window's
  // blocks still finds them.
  layout_fixture f(kv_model_layout::sliding(2, 8));
  const auto t = run(10, 16);
  const auto seq = f.make();
  f.cache.track(seq);
  REQUIRE(f.append(seq, first(t, 8)) == ghostlink::error_code());
  f.cache.clear();
  REQUIRE(f.append(seq, std::span(t).subspan(8)) == ghostlink::error_code());
  CHECK(f.cache.stats().cached_entries == 4);  // blocks 0 and 1 revived empty, 2 and 3 whole
  CHECK(f.cache.match(t) == 16);               // the window at 16 reads blocks 2 and 3 only
  CHECK(f.cache.match(first(t, 12)) == 0);     // 12 needs block 1's
  const auto hit = f.cache.attach(f.threads, t);
  CHECK(f.held_diff(hit, t) == "");
}

TEST_CASE("track: a token without an id stops it; refusals are insert's; a tracked fork is not", "[prefix][layouts]") {
  layout_fixture f(hybrid_layout());
  auto seq = f.make();
  f.cache.track(seq);
  // 8 tokens without ids: nothing cached.
  const std::size_t width = f.conf.token_width();
  std::vector<float> k(8 * width, 1.0f), v(8 * width, -1.0f);
  const std::vector<std::span<const float>> ks{k, k}, vs{v, v};
  REQUIRE(wait_ec([&](auto tk) { return seq.async_append(ks, vs, tk); }) == ghostlink::error_code());
  CHECK(f.cache.stats().cached_entries == 0);
  // Another layout, another pool: refused as insert refuses them.
  asio::thread_pool io(1);
  sequence_kv_cache full(io, kv_model_layout::full(2), config(), f.pool);
  CHECK_THROWS_MATCHES(f.cache.track(full), std::system_error,
                       Catch::Predicate<std::system_error>(
                           [](const std::system_error& e) { return e.code() == kv_errc::invalid_config; }));
  sequence_kv_cache three(io, kv_model_layout::interleaved(3, 3, 8), config(), f.pool);
  CHECK_THROWS_MATCHES(f.cache.track(three), std::system_error,
                       Catch::Predicate<std::system_error>(
                           [](const std::system_error& e) { return e.code() == kv_errc::layer_mismatch; }));
  // A fork of a tracked sequence is not tracked.
  const auto t = run(40, 8);
  auto parent = f.tracked(t);
  auto child = fork(parent);
  REQUIRE(f.append(child, run(70, 8)) == ghostlink::error_code());
  CHECK(f.cache.match(cat(t, run(70, 8))) == 8);
  io.join();
}

TEST_CASE("an attach's windowed layers hold only the window's blocks, and decode on exactly as a recompute does",
          "[prefix][layouts]") {
  for (const std::size_t sinks : {std::size_t{0}, std::size_t{2}}) {
    INFO("sinks " << sinks);
    layout_fixture f(hybrid_layout(sinks));
    const auto t = run(10, 24);
    { const auto seq = f.tracked(t); }
    const std::size_t before = f.pool.stats().blocks_in_use;
    const auto prompt = cat(t, run(900, 3));
    auto hit = f.cache.attach(f.threads, prompt);
    REQUIRE(hit.size() == 24);
    // Layer 0 holds blocks 4 and 5 (and block 0 for its sinks); layer 1 all six.
    const auto snap = hit.snapshot();
    CHECK(snap.layer(0).kept_from() == 16);
    CHECK(snap.layer(1).kept_from() == 0);
    kv_range r;
    CHECK(snap.layer(0).read_range(12, 16, r) == kv_errc::outside_window);
    CHECK(f.held_diff(hit, t) == "");
    CHECK(f.pool.stats().blocks_in_use == before);  // nothing allocated
    // A truncate within the window works; below it the window is gone, as
    // for the sequence that computed it.
    CHECK(truncate(hit, 23) == ghostlink::error_code());
    CHECK(truncate(hit, 15) == kv_errc::outside_window);
    REQUIRE(f.append(hit, std::span(prompt).subspan(23, 1)) == ghostlink::error_code());
    // Decoding on: the same as a sequence that computed every token.
    auto whole = cat(prompt, run(2000, 9));
    REQUIRE(f.append(hit, std::span(whole).subspan(24)) == ghostlink::error_code());
    auto recompute = f.make();
    REQUIRE(f.append(recompute, whole) == ghostlink::error_code());
    CHECK(f.held_diff(hit, whole) == "");
    const attention_shape shape{.query_heads = 2, .kv_heads = 2, .head_dim = 4};
    constexpr std::size_t row = std::size_t{2} * 4;  // query_heads * head_dim
    std::vector<float> q(row), out_hit(row), out_recompute(row);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = 0.001f * static_cast<float>(i + 1);
    const auto a = hit.snapshot(), b = recompute.snapshot();
    for (std::size_t l = 0; l < 2; ++l) {
      REQUIRE_FALSE(attend(a.layer(l), q, out_hit, shape));
      REQUIRE_FALSE(attend(b.layer(l), q, out_recompute, shape));
      CHECK(out_hit == out_recompute);
    }
  }
}

TEST_CASE("keys-only and quantized layouts reuse their entries", "[prefix][layouts]") {
  SECTION("keys only, windowed") {
    kv_model_layout layout = hybrid_layout();
    layout.keys_only = true;
    layout_fixture f(layout);
    const auto t = run(10, 24);
    { const auto seq = f.tracked(t); }
    CHECK(f.pool.stats().blocks_cached == 12);
    const auto hit = f.cache.attach(f.threads, t);
    REQUIRE(hit.size() == 24);
    CHECK(hit.snapshot().layer(0).value_width() == 0);
    CHECK(f.held_diff(hit, t) == "");
    // A keys-only cache needs a keys-only pool.
    const kv_block_pool kv = kv_block_pool::for_caches(config());
    CHECK_THROWS_AS(kv_prefix_cache(layout, config(), kv), std::system_error);
  }
  SECTION("q8_0, windowed") {
    const kv_cache_config c{.max_tokens_per_seq = 64, .num_heads = 2, .head_dim = 32, .block_tokens = 4};
    layout_fixture<q8_0> f(hybrid_layout(), 1000, {}, c);
    const auto t = run(10, 24);
    const auto seq = f.tracked(t);
    const auto hit = f.cache.attach(f.threads, t);
    REQUIRE(hit.size() == 24);
    const auto a = seq.snapshot(), b = hit.snapshot();
    for (std::size_t l = 0; l < 2; ++l) {
      kv_range ra, rb;
      REQUIRE_FALSE(a.layer(l).read_range(16, 24, ra));
      REQUIRE_FALSE(b.layer(l).read_range(16, 24, rb));
      CHECK(ra.keys == rb.keys);
      CHECK(ra.values == rb.values);
    }
  }
}

TEST_CASE("insert and track refuse an fp8 sequence of other scales: invalid_config, nothing cached",
          "[prefix][layouts]") {
  const kv_cache_config c{.max_tokens_per_seq = 64,
                          .num_heads = 2,
                          .head_dim = 4,
                          .block_tokens = 4,
                          .key_scale = 0.5f,
                          .value_scale = 2.0f};
  layout_fixture<fp8_e4m3> f(hybrid_layout(), 1000, {}, c);
  kv_cache_config other = c;
  other.value_scale = 4.0f;
  const basic_sequence_kv_cache<fp8_e4m3> seq(f.threads, hybrid_layout(), other, f.pool);  // the same block bytes
  const auto t = run(10, 8);
  REQUIRE(f.append(seq, t) == ghostlink::error_code());
  const auto refused = [](auto call) {
    try {
      call();
    } catch (const std::system_error& e) {
      return e.code() == kv_errc::invalid_config;
    }
    return false;
  };
  CHECK(refused([&] { (void)f.cache.insert(seq, t); }));
  CHECK(refused([&] { f.cache.track(seq); }));
  CHECK(f.cache.stats().cached_entries == 0);
  // The cache's own scales: taken.
  const auto same = f.tracked(t);
  CHECK(f.cache.stats().cached_entries == 2);
}

TEST_CASE("hybrid eviction: windowed parts no window read go first, oldest first; full layers' blocks stay",
          "[prefix][layouts]") {
  // 2 layers: 12 blocks for the 6 entries; a sequence of 4 tokens takes 2
  // more (and its ids none of the pool's).
  layout_fixture f(hybrid_layout(), 12);
  const auto t = run(10, 24);
  { const auto seq = f.tracked(t); }
  { const auto hit = f.cache.attach(f.threads, t); }  // reads the windowed parts of blocks 4 and 5
  REQUIRE(f.cache.stats().idle_blocks == 6);
  CHECK(f.pool.stats().blocks_available == 12);
  // Two blocks: block 3's windowed part, then block 2's.
  const sequence_kv_cache other(f.threads, kv_model_layout::full(2), f.conf, f.pool);
  REQUIRE(f.append(other, run(700, 4)) == ghostlink::error_code());
  CHECK(f.cache.stats().window_evictions == 2);
  CHECK(f.cache.stats().evicted_blocks == 0);
  CHECK(f.cache.stats().cached_entries == 6);
  CHECK(f.cache.match(t) == 24);            // the window at 24 reads blocks 4 and 5
  CHECK(f.cache.match(first(t, 20)) == 8);  // 20 needs block 3's, 16 block 2's; 8 has 0 and 1
  // Two more: blocks 1 and 0; then the oldest whole entry, the leaf (block 5).
  REQUIRE(f.append(other, run(800, 4)) == ghostlink::error_code());
  CHECK(f.cache.stats().window_evictions == 4);
  CHECK(f.cache.stats().evicted_blocks == 0);
  CHECK(f.cache.match(first(t, 8)) == 0);
  REQUIRE(f.append(other, run(900, 4)) == ghostlink::error_code());
  CHECK(f.cache.stats().evicted_blocks == 1);
  CHECK(f.cache.stats().cached_entries == 5);
  CHECK(f.cache.match(t) == 0);  // 20 needs block 3's windowed part
  CHECK(f.pool.stats().blocks_cached == 6);  // 5 entries' full blocks and block 4's windowed one
}

TEST_CASE("hybrid eviction: an entry left with no block is removed, and so are its hollow parents",
          "[prefix][layouts]") {
  // Every layer windowed (a Mistral-like layout).
  layout_fixture f(kv_model_layout::sliding(2, 8), 12);
  event_log log;
  f.cache.set_event_handler(log.handler());
  const auto t = run(10, 24);
  { const auto seq = f.tracked(t); }
  CHECK(log.size() == 6);
  { const auto hit = f.cache.attach(f.threads, t); }
  const sequence_kv_cache other(f.threads, kv_model_layout::full(2), f.conf, f.pool);
  // 4 windowed parts of 2 blocks go (blocks 3 to 0): those entries hold
  // nothing, but lead to 4 and 5.
  REQUIRE(f.append(other, run(700, 16)) == ghostlink::error_code());
  CHECK(f.cache.stats().window_evictions == 4);
  CHECK(f.cache.stats().cached_entries == 6);
  CHECK(f.cache.match(t) == 24);
  // Then the leaf (older than block 4's windowed part), then block 4, whose
  // hollow parents lead nowhere any more.
  REQUIRE(f.append(other, run(800, 4)) == ghostlink::error_code());
  CHECK(f.cache.stats().cached_entries == 5);
  REQUIRE(f.append(other, run(900, 4)) == ghostlink::error_code());
  CHECK(f.cache.stats().cached_entries == 0);
  CHECK(f.pool.stats().blocks_cached == 0);
  CHECK(log.size() == 6 + 6);  // a removed event for each
  CHECK(f.cache.match(t) == 0);
}

TEST_CASE("hybrid eviction never takes what a sequence or a snapshot holds", "[prefix][layouts]") {
  layout_fixture f(hybrid_layout(), 12);
  const auto t = run(10, 24);
  { const auto seq = f.tracked(t); }
  auto hit = f.cache.attach(f.threads, t);  // holds all full blocks and layer 0's blocks 4, 5
  const auto snap = hit.snapshot();
  hit = {};
  const sequence_kv_cache other(f.threads, kv_model_layout::full(2), f.conf, f.pool);
  // Room for the 4 windowed parts nothing holds, then none.
  REQUIRE(f.append(other, run(700, 8)) == ghostlink::error_code());
  CHECK(f.append(other, run(800, 4)) == kv_errc::capacity_exhausted);
  CHECK(f.cache.stats().window_evictions == 4);
  CHECK(f.cache.stats().evicted_blocks == 0);
  for (std::size_t l = 0; l < 2; ++l) {
    kv_range r;
    REQUIRE_FALSE(snap.layer(l).read_range(16, 24, r));
    for (std::size_t i = 0; i < 8; ++i) CHECK(r.keys[i * 8] == key(l, 16 + i, t[16 + i], 0));
  }
}

TEST_CASE("a file store round-trips hybrid entries, stores what each entry holds, and refuses a forged layout",
          "[prefix][layouts][store]") {
  ghostlink::test::temp_dir dir;
  asio::thread_pool io(2);
  auto store = std::make_shared<kv_file_store>(dir.path, kv_file_store_limits{.io_executor = io.get_executor()});
  const auto t = run(10, 24);
  const detail::entry_geometry g(hybrid_layout(), config(), detail::codec_of<float>);
  {
    // Write-back: the windowed parts of blocks 0 to 3 go first, and are not written.
    layout_fixture f(hybrid_layout(), 12, {.store = store, .store_policy = kv_store_policy::write_back});
    { const auto seq = f.tracked(t); }
    { const auto hit = f.cache.attach(f.threads, t); }
    auto other = f.make();
    REQUIRE(f.append(other, run(700, 8)) == ghostlink::error_code());
    REQUIRE_FALSE(wait_ec([&](auto tk) { return f.cache.async_flush(tk); }));
    const auto h = f.cache.block_hashes(t);
    for (std::size_t b = 0; b < 6; ++b) {
      INFO("block " << b);
      CHECK(fs::file_size(store->path_of(h[b])) == g.entry_bytes(b < 4 ? 1 : 2));
    }
  }
  // Write-through from a tracked sequence: every entry with both layers.
  auto through =
      std::make_shared<kv_file_store>(dir.path / "through", kv_file_store_limits{.io_executor = io.get_executor()});
  {
    layout_fixture f(hybrid_layout(), 1000, {.store = through});
    { const auto seq = f.tracked(t); }
    through->flush();
    for (const kv_block_hash& h : f.cache.block_hashes(t))
      CHECK(fs::file_size(through->path_of(h)) == g.entry_bytes(2));
  }
  const auto attach_from = [&](const std::shared_ptr<kv_file_store>& s) {
    layout_fixture f(hybrid_layout(), 1000, {.store = s});
    std::promise<attach_result> done;
    f.cache.async_attach(f.threads.get_executor(), t, {}, [&](ghostlink::error_code e, sequence_kv_cache seq) {
      done.set_value({e, std::move(seq)});
    });
    attach_result r = done.get_future().get();
    CHECK_FALSE(r.first);
    INFO("attached " << r.second.size());
    CHECK(f.held_diff(r.second, first(t, r.second.size())) == "");
    CHECK(f.cache.stats().store_hit_tokens == r.second.size());
    return std::pair{r.second.size(), f.cache.stats()};
  };
  // Another process's caches: the entries attach as RAM's would.
  CHECK(attach_from(through).first == 24);
  // The write-back store has no windowed block before block 4: the window
  // at 24 reads blocks 4 and 5.
  CHECK(attach_from(store).first == 24);
  {
    // Block 5's entry rewritten with another window in its layer table,
    // checksums and all: refused, and the match is what the rest allows.
    const kv_block_hash h5 = [&] {
      layout_fixture f(hybrid_layout());
      return f.cache.block_hashes(t)[5];
    }();
    const detail::entry_geometry forged(kv_model_layout::interleaved(2, 2, 16), config(), detail::codec_of<float>);
    std::vector<std::byte> payload(g.block_bytes(), std::byte{0x3f});
    const std::vector<const std::byte*> halves{payload.data(), payload.data() + g.half_bytes(), payload.data(),
                                               payload.data() + g.half_bytes()};
    std::vector<std::byte> bytes(forged.entry_bytes(2));
    detail::encode_entry(forged, h5, halves, bytes);
    REQUIRE(bytes.size() == fs::file_size(through->path_of(h5)));
    {
      std::ofstream out(through->path_of(h5), std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    }
    const auto [attached, stats] = attach_from(through);
    CHECK(attached == 20);  // 5 blocks: the window at 20 reads blocks 3 and 4
    CHECK(stats.store_rejects == 1);
  }
  through->flush();
  store->flush();
  io.join();
}

TEST_CASE("two threads tracking, attaching and evicting under a tight budget with a hybrid layout",
          "[prefix][layouts][concurrency]") {
  layout_fixture f(kv_model_layout::interleaved(2, 2, 6, 1), 40);
  // Four conversations on two system prompts: each turn attaches the longest
  // cached prefix, tracks the sequence and appends the rest.
  const std::vector<std::vector<token_id>> prompts{run(100, 10), run(200, 9)};
  std::atomic<std::size_t> hits{0}, refused{0}, checked{0};
  std::mutex failures_mutex;
  std::vector<std::string> failures;
  auto worker = [&](std::size_t me) {
    for (std::size_t i = 0; i < 60; ++i) {
      const std::size_t conv = (me * 7 + i) % 4;
      std::vector<token_id> tokens = prompts[conv % 2];
      const std::size_t turns = 1 + i % 3;
      for (std::size_t turn = 0; turn < turns; ++turn) {
        const auto more = run(static_cast<token_id>(1000 * (conv + 1) + 10 * turn), 5);
        tokens.insert(tokens.end(), more.begin(), more.end());
      }
      auto seq = f.cache.attach(f.threads, tokens);
      hits += seq.size();
      f.cache.track(seq);
      const std::span<const token_id> rest = std::span(tokens).subspan(seq.size());
      if (f.append(seq, rest) == kv_errc::capacity_exhausted) {
        ++refused;
        continue;
      }
      std::string d = f.held_diff(seq, tokens);
      ++checked;
      if (!d.empty()) {
        std::lock_guard lock(failures_mutex);
        failures.push_back(d);
      }
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  CHECK(failures.empty());
  if (!failures.empty()) WARN(failures.front());
  CHECK(checked > 0);
  CHECK(hits > 0);
  const kv_prefix_stats s = f.cache.stats();
  CHECK(s.idle_blocks == s.cached_entries);  // every sequence let go of
  CHECK(s.evicted_blocks + s.window_evictions > 0);
  CHECK(f.pool.stats().blocks_in_use <= 40);
}

}  // namespace prefix_layout_tests
