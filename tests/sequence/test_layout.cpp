// Model layouts: windowed layers and attention sinks. What a windowed layer
// keeps as its sequence grows, when its blocks go back to the pool, reads
// and attention over what it dropped, truncates and forks.

#include "common/sequence_support.hpp"

#include "common/files.hpp"

#include "common/asio_compat.hpp"

#ifdef GHOSTLINK_CATCH2_V3
#include <catch2/generators/catch_generators.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <thread>
#include <tuple>

namespace layout_tests {

using namespace ghostlink;
using namespace ghostlink::test::seq;
using ghostlink::test::small_config;
using ghostlink::test::wait_ec;

namespace {

constexpr std::size_t B = 4;  // small_config()'s block_tokens

/// small_config() holding `tokens` tokens.
kv_cache_config config_for(std::size_t tokens) {
  kv_cache_config c = small_config();
  c.max_tokens_per_seq = tokens;
  return c;
}

std::size_t ceil_div(std::size_t n, std::size_t d) { return (n + d - 1) / d; }

/// The contract's bound on a windowed layer's blocks.
std::size_t kept_bound(const kv_layer_layout& l, std::size_t rollback) {
  return ceil_div(l.sink_tokens, B) + ceil_div(l.window + rollback, B) + 1;
}

/// A sequence of `layout` on its own pool (whose blocks are the model
/// layers': the token ids have a pool of their own), and the tag of each
/// token appended.
struct windowed {
  windowed(const kv_model_layout& layout, std::size_t max_tokens)
      : pool(kv_block_pool::for_caches(config_for(max_tokens))),
        seq(threads, layout, config_for(max_tokens), pool),
        layers(layout.num_layers()),
        width(seq.config().token_width()) {}

  /// Appends `n` tokens (one request) tagged `tag`; must succeed.
  void append_ok(std::size_t n, int tag) {
    const step st(layers, width, seq.size(), tag, n);
    REQUIRE_FALSE(append(seq, st));
    tags.insert(tags.end(), n, tag);
  }
  /// "" if layer `l` of `snap` holds its sinks and everything from
  /// kept_from() on as appended, else what differs.
  std::string diff_kept(const sequence_snapshot& snap, std::size_t l) const {
    const kv_snapshot& s = snap.layer(l);
    if (s.size() != snap.size()) return str("layer ", l, " shows ", s.size(), " of ", snap.size());
    std::string d;
    const auto check = [&](std::size_t begin, std::size_t end) {
      kv_range r;
      if (ghostlink::error_code ec = s.read_range(begin, end, r))
        return d = str("layer ", l, ": ", ec.message()), void();
      for (std::size_t i = begin; i < end && d.empty(); ++i)
        d = diff_token<float>(l, i, tags[i], std::span(r.keys).subspan((i - begin) * width, width),
                              std::span(r.values).subspan((i - begin) * width, width));
    };
    check(0, std::min(s.sink_tokens(), s.size()));
    if (d.empty()) check(std::min(std::max(s.sink_tokens(), s.kept_from()), s.size()), s.size());
    return d;
  }

  asio::thread_pool threads{2};
  kv_block_pool pool;
  sequence_kv_cache seq;
  std::size_t layers, width;
  std::vector<int> tags;
};

/// A truncate of `w`'s sequence to `n` fails with outside_window and
/// changes nothing.
void check_truncate_refused(windowed& w, std::size_t n) {
  INFO("truncate to " << n << " of " << w.seq.size());
  const observed before = observe(w.seq);
  CHECK(truncate(w.seq, n) == kv_errc::outside_window);
  CHECK(observe(w.seq) == before);
}

}  // namespace

TEST_CASE("every bad layout is invalid_config, and nothing is made", "[layout]") {
  asio::thread_pool threads(1);
  CHECK(refused([&] { sequence_kv_cache(threads, kv_model_layout{}); }));  // no layers
  CHECK(refused([&] { sequence_kv_cache(threads, kv_model_layout::full(0)); }));
  CHECK(refused([&] { sequence_kv_cache(threads, kv_model_layout{.layers = {{.window = 0, .sink_tokens = 2}}}); }));
  CHECK(refused([&] { (void)kv_model_layout::interleaved(4, 0, 8); }));  // a period of 0
  CHECK(refused([&] { (void)kv_model_layout::interleaved(4, 2, 0); }));  // a window of 0
  CHECK(refused([&] { (void)kv_model_layout::sliding(4, 0); }));
  CHECK(refused([&] { sequence_kv_cache(threads, std::size_t{0}); }));  // the constructor taking a count: full(0)
  const std::size_t huge = static_cast<std::size_t>(-1);
  CHECK(refused([&] {
    sequence_kv_cache(threads, kv_model_layout{.layers = {{.window = huge, .sink_tokens = 0}}, .rollback_tokens = 2});
  }));
}

TEST_CASE("full(n) and interleaved(n, period, window, sinks) name the layers the contract says", "[layout]") {
  const kv_model_layout gemma = kv_model_layout::interleaved(12, 6, 1024, 4);
  REQUIRE(gemma.num_layers() == 12);
  for (std::size_t i = 0; i < 12; ++i) {
    INFO("layer " << i);
    const bool full = (i + 1) % 6 == 0;
    CHECK(gemma.layers[i] == (full ? kv_layer_layout{} : kv_layer_layout{.window = 1024, .sink_tokens = 4}));
  }
  CHECK(gemma.windowed());
  CHECK_FALSE(kv_model_layout::full(3).windowed());
  CHECK(kv_model_layout::full(3).layers == std::vector<kv_layer_layout>(3));
  CHECK(kv_model_layout::sliding(2, 8, 1).layers == std::vector<kv_layer_layout>(2, {.window = 8, .sink_tokens = 1}));
  CHECK(str(kv_model_layout::interleaved(2, 2, 8)) ==
        "{layers=[{window=8, sink_tokens=0}, {window=0, sink_tokens=0}], keys_only=0, rollback_tokens=0}");

  // layout(): what the sequence was made with; a count means full(n); a
  // fork's is its parent's.
  asio::thread_pool threads(2);
  const sequence_kv_cache by_count(threads, 3, small_config());
  CHECK(by_count.layout() == kv_model_layout::full(3));
  kv_model_layout with_rollback = kv_model_layout::interleaved(4, 2, 8, 1);
  with_rollback.rollback_tokens = 3;
  sequence_kv_cache seq(threads, with_rollback, small_config());
  CHECK(seq.layout() == with_rollback);
  CHECK(seq.num_layers() == 4);
  auto [ec, child] = fork(seq);
  REQUIRE_FALSE(ec);
  CHECK(child.layout() == with_rollback);
}

TEST_CASE("a windowed layer keeps at most its bound of blocks as the sequence grows to 20 times its window",
          "[layout]") {
  const std::size_t window = 8;
  const std::size_t sinks = GENERATE(0, 3, 4);
  const std::size_t rollback = GENERATE(0, 5);
  const std::size_t chunk = GENERATE(1, 3, 13);  // decode steps; prefill chunks (one longer than the window)
  INFO("sinks " << sinks << ", rollback " << rollback << ", chunk " << chunk);
  kv_model_layout layout = kv_model_layout::sliding(1, window, sinks);
  layout.rollback_tokens = rollback;
  const std::size_t total = 20 * window;
  windowed w(layout, total + chunk);
  const std::size_t bound = kept_bound(layout.layers[0], rollback);
  std::size_t most = 0;
  mismatches log;
  int tag = 1;
  while (w.seq.size() < total) {
    w.append_ok(chunk, tag++);
    const std::size_t held = w.pool.stats().blocks_in_use;
    most = std::max(most, held);
    const sequence_snapshot snap = w.seq.snapshot();
    if (held > bound) log.add(str("at ", w.seq.size(), " tokens: ", held, " blocks"));
    if (snap.size() != w.tags.size() || w.seq.size() != w.tags.size())
      log.add(str("size ", w.seq.size(), ", snapshot ", snap.size(), ": every token counts"));
    // What it keeps: the sinks and p >= h + 1 - W - R (h: the size here).
    const std::size_t h = w.seq.size(), keep = h + 1 > window + rollback ? h + 1 - window - rollback : 0;
    if (snap.layer(0).kept_from() > std::max(keep, sinks))
      log.add(str("at ", h, ": kept from ", snap.layer(0).kept_from()));
    if (std::string d = w.diff_kept(snap, 0); !d.empty()) log.add(str("at ", h, ": ", d));
  }
  INFO(log.count << " problem(s), first:\n" << log.first << "most blocks " << most << ", bound " << bound);
  CHECK(log.count == 0);
  CHECK(most <= bound);
  CHECK(w.seq.snapshot().layer(0).kept_from() > sinks);  // it did drop
}

TEST_CASE("a dropped block leaves the latest state at once and the pool only once no snapshot reads it", "[layout]") {
  const kv_model_layout layout = kv_model_layout::sliding(2, 8, 2);
  windowed w(layout, 256);
  w.append_ok(8, 1);
  const sequence_snapshot early = w.seq.snapshot();  // pins blocks the window will drop
  const std::vector<int> early_tags = w.tags;
  for (int tag = 2; tag < 40; ++tag) w.append_ok(3, tag);
  const std::size_t bound = 2 * kept_bound(layout.layers[0], 0);
  const std::size_t pinned = w.pool.stats().blocks_in_use;
  CHECK(pinned > bound);  // the early snapshot's blocks stay
  CHECK(w.seq.snapshot().layer(0).kept_from() > 8);  // the latest state dropped them
  // The early snapshot still reads every one of its tokens.
  for (std::size_t l = 0; l < 2; ++l) {
    CHECK(early.layer(l).kept_from() == 2);
    kv_range r;
    REQUIRE_FALSE(early.layer(l).read_range(0, 8, r));
    for (std::size_t i = 0; i < 8; ++i)
      CHECK(diff_token<float>(l, i, early_tags[i], std::span(r.keys).subspan(i * w.width, w.width),
                              std::span(r.values).subspan(i * w.width, w.width))
                .empty());
  }
  { const sequence_snapshot gone = std::move(const_cast<sequence_snapshot&>(early)); }  // released here
  CHECK(w.pool.stats().blocks_in_use <= bound);
  CHECK(w.pool.stats().blocks_in_use < pinned);
}

TEST_CASE("reading a dropped position fails with outside_window and writes nothing", "[layout]") {
  const std::size_t sinks = GENERATE(0, 2);
  INFO("sinks " << sinks);
  windowed w(kv_model_layout::sliding(1, 8, sinks), 128);
  for (int tag = 1; tag <= 12; ++tag) w.append_ok(4, tag);
  const sequence_snapshot snap = w.seq.snapshot();
  const kv_snapshot& layer = snap.layer(0);
  const std::size_t kept = layer.kept_from();
  REQUIRE(kept > sinks);
  REQUIRE(kept < layer.size());
  CHECK(layer.window() == 8);
  CHECK(layer.sink_tokens() == sinks);
  CHECK(kept % B == 0);
  std::vector<float> keys(4 * w.width, 7.0f), values(4 * w.width, 7.0f);
  const auto untouched = [&] {
    return std::ranges::all_of(keys, [](float x) { return x == 7.0f; }) &&
           std::ranges::all_of(values, [](float x) { return x == 7.0f; });
  };
  for (std::size_t at : {sinks, kept - 1, (sinks + kept) / 2}) {
    INFO("position " << at);
    CHECK(layer.read_kv(at, keys, values) == kv_errc::outside_window);
    kv_entry e;
    CHECK(layer.read_kv(at, e) == kv_errc::outside_window);
    CHECK(e.keys.empty());
    CHECK(layer.read_range(at, at + 1, keys, values) == kv_errc::outside_window);
    kv_range r;
    CHECK(layer.read_range(at, at + 1, r) == kv_errc::outside_window);
    CHECK(r.keys.empty());
    bool called = false;
    CHECK(layer.for_each_block(at, at + 1, [&](auto...) { called = true; }) == kv_errc::outside_window);
    CHECK_FALSE(called);
  }
  // Ranges that straddle the edge fail too; the sinks and the kept range read.
  CHECK(layer.read_range(kept - 1, kept + 1, keys, values) == kv_errc::outside_window);
  CHECK(layer.read_range(0, layer.size(), keys, values) == kv_errc::outside_window);
  CHECK(untouched());
  CHECK(w.diff_kept(snap, 0).empty());
  // The bounds come first, as for any snapshot.
  CHECK(layer.read_range(sinks + 1, sinks, keys, values) == kv_errc::invalid_range);
  CHECK(layer.read_kv(layer.size(), keys, values) == kv_errc::index_out_of_range);
  // The token ids are not windowed: every token's id reads.
  CHECK(snap.token_ids().size() == w.tags.size());
}

TEST_CASE("an open step's snapshot shows every token of a prefill chunk longer than the window; its commit drops",
          "[layout]") {
  const kv_model_layout layout = kv_model_layout::interleaved(2, 2, 8);  // layer 0 windowed, layer 1 full
  windowed w(layout, 256);
  w.append_ok(3, 1);
  const std::size_t n = 40;
  const step st(2, w.width, w.seq.size(), 2, n);
  {
    auto [ec, open] = begin_step(w.seq, n);
    REQUIRE_FALSE(ec);
    for (std::size_t l = 0; l < 2; ++l) REQUIRE_FALSE(write_layer(open, l, st));
    w.tags.insert(w.tags.end(), n, 2);
    for (std::size_t l = 0; l < 2; ++l) {
      INFO("layer " << l);
      const kv_snapshot s = open.snapshot(l);
      CHECK(s.size() == 43);
      CHECK(s.kept_from() == 0);
      kv_range all;
      CHECK_FALSE(s.read_range(0, 43, all));
    }
    REQUIRE_FALSE(commit(open));
  }  // the step's handle, which pins what its snapshots showed, goes
  const sequence_snapshot after = w.seq.snapshot();
  CHECK(after.size() == 43);
  CHECK(after.layer(0).kept_from() >= 43 + 1 - 8 - B);
  CHECK(after.layer(1).kept_from() == 0);
  CHECK(w.diff_kept(after, 0).empty());
  CHECK(w.diff_kept(after, 1).empty());
  CHECK(w.pool.stats().blocks_in_use <= kept_bound(layout.layers[0], 0) + ceil_div(43, B));
}

namespace {

/// Tokens of `width` floats: token p's keys and values, deterministic.
std::vector<float> token_values(std::size_t p, std::size_t width, float sign) {
  std::vector<float> v(width);
  for (std::size_t i = 0; i < width; ++i) v[i] = sign * std::sin(0.37f * static_cast<float>(p * width + i) + 0.1f);
  return v;
}

}  // namespace

TEST_CASE("attend over a windowed layer is attend over a flat buffer of exactly the positions each row attends",
          "[layout][attend]") {
  const std::size_t window = GENERATE(5, 8);
  const std::size_t sinks = GENERATE(0, 3);
  const std::size_t rows = GENERATE(1, 3, 12);  // a decode row; rows straddling the window edge; a prefill chunk
  const std::size_t pending = GENERATE(0, 2);
  INFO("window " << window << ", sinks " << sinks << ", rows " << rows << ", pending " << pending);
  const std::size_t stored = 37;
  kv_model_layout layout = kv_model_layout::sliding(1, window, sinks);
  // Keep what the first row attends: the rows past the pending ones are
  // stored tokens, attended over again (a recompute).
  layout.rollback_tokens = rows;
  windowed w(layout, 128);
  const std::size_t width = w.width;
  std::vector<std::vector<float>> keys, values;
  for (std::size_t p = 0; p < stored + pending; ++p) {
    keys.push_back(token_values(p, width, 1.0f));
    values.push_back(token_values(p + 1000, width, -1.0f));
  }
  for (std::size_t p = 0; p < stored; ++p) {
    const std::vector<std::span<const float>> k{keys[p]}, v{values[p]};
    REQUIRE_FALSE(append(w.seq, k, v));
  }
  const sequence_snapshot snap = w.seq.snapshot();
  const kv_snapshot& layer = snap.layer(0);
  REQUIRE(layer.kept_from() > sinks);  // it dropped some

  const attention_shape shape{.query_heads = 4, .kv_heads = 2, .head_dim = 4};
  const std::size_t row_width = shape.query_heads * shape.head_dim;
  std::vector<float> queries(rows * row_width);
  for (std::size_t i = 0; i < queries.size(); ++i) queries[i] = std::cos(0.21f * static_cast<float>(i));
  std::vector<float> pk, pv;
  for (std::size_t p = stored; p < stored + pending; ++p) {
    pk.insert(pk.end(), keys[p].begin(), keys[p].end());
    pv.insert(pv.end(), values[p].begin(), values[p].end());
  }
  std::vector<float> out(queries.size());
  REQUIRE_FALSE(attend(layer, queries, out, shape, {pk, pv}));

  const std::size_t total = stored + pending;
  double worst = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t p = total - rows + r;
    std::vector<float> fk, fv;
    for (std::size_t j = 0; j <= p; ++j)
      if (j < sinks || j + window > p) {
        fk.insert(fk.end(), keys[j].begin(), keys[j].end());
        fv.insert(fv.end(), values[j].begin(), values[j].end());
      }
    std::vector<float> want(row_width);
    REQUIRE_FALSE(attend(std::span<const float>(fk), std::span<const float>(fv),
                         std::span(queries).subspan(r * row_width, row_width), want, shape));
    for (std::size_t i = 0; i < row_width; ++i)
      worst = std::max(worst,
                       std::abs(double(out[r * row_width + i]) - want[i]) / std::max(1e-30, std::abs(double(want[i]))));
  }
  INFO("worst relative difference " << worst);
  CHECK(worst <= 1e-6);
}

TEST_CASE("attend fails with outside_window, out untouched, when a row's window reaches a dropped position",
          "[layout][attend]") {
  windowed w(kv_model_layout::sliding(1, 8), 128);
  for (int tag = 1; tag <= 10; ++tag) w.append_ok(4, tag);
  const sequence_snapshot snap = w.seq.snapshot();
  const attention_shape shape{.query_heads = 2, .kv_heads = 2, .head_dim = 4};
  // 12 rows over the last 12 stored tokens: the first reaches back past
  // what the window kept for the next token.
  constexpr std::size_t rows = 12, width = 8;
  std::vector<float> queries(rows * width, 0.5f), out(rows * width, 3.0f);
  CHECK(attend(snap.layer(0), queries, out, shape) == kv_errc::outside_window);
  CHECK(std::ranges::all_of(out, [](float x) { return x == 3.0f; }));
  // The next token's row reads only what is kept.
  std::vector<float> one(8, 0.5f), one_out(8);
  std::vector<float> pk(8, 0.25f), pv(8, 0.75f);
  CHECK_FALSE(attend(snap.layer(0), one, one_out, shape, {pk, pv}));
}

TEST_CASE("truncates within rollback_tokens always succeed; beyond it only while the window is held", "[layout]") {
  kv_model_layout layout = kv_model_layout::interleaved(2, 2, 8, 2);
  layout.rollback_tokens = 4;
  windowed w(layout, 512);
  w.append_ok(20, 1);
  // Speculative decoding, many times: a draft of 5, 1 to 4 of it rejected.
  int tag = 2;
  mismatches log;
  for (int round = 0; round < 40; ++round) {
    const std::size_t before = w.seq.size();
    w.append_ok(4, tag++);
    const std::size_t keep = before + static_cast<std::size_t>(round % 4);
    if (ghostlink::error_code ec = truncate(w.seq, keep)) log.add(str("round ", round, ": ", ec.message()));
    w.tags.resize(keep);
    const sequence_snapshot snap = w.seq.snapshot();
    for (std::size_t l = 0; l < 2; ++l)
      if (std::string d = w.diff_kept(snap, l); !d.empty()) log.add(str("round ", round, ": ", d));
  }
  INFO(log.count << " problem(s), first:\n" << log.first);
  CHECK(log.count == 0);
  CHECK(w.pool.stats().blocks_in_use <= kept_bound(layout.layers[0], 4) + ceil_div(w.seq.size(), B));

  // Past rollback_tokens into what the window dropped: refused, nothing changed.
  const std::size_t size = w.seq.size();
  check_truncate_refused(w, size - 30);
  // Past rollback_tokens, to where the window is still held (a token at n
  // attends n - 7 .. n - 1): done.
  const std::size_t n = w.seq.snapshot().layer(0).kept_from() + 7;
  REQUIRE(n < size - 4);
  REQUIRE_FALSE(truncate(w.seq, n));
  w.tags.resize(n);
  CHECK(w.diff_kept(w.seq.snapshot(), 0).empty());
  // Then again speculative rounds from there: within rollback_tokens of the
  // new high-water mark, always done.
  for (int round = 0; round < 8; ++round) {
    w.append_ok(4, tag++);
    REQUIRE_FALSE(truncate(w.seq, w.seq.size() - 4));
    w.tags.resize(w.seq.size());
    CHECK(w.diff_kept(w.seq.snapshot(), 0).empty());
  }
}

TEST_CASE("a fork shares what each layer keeps and inherits the high-water mark", "[layout]") {
  kv_model_layout layout = kv_model_layout::interleaved(2, 2, 8);
  layout.rollback_tokens = 2;
  windowed w(layout, 512);
  for (int tag = 1; tag <= 10; ++tag) w.append_ok(4, tag);
  const std::size_t before = w.pool.stats().blocks_in_use;
  auto [ec, child] = fork(w.seq);
  REQUIRE_FALSE(ec);
  CHECK(w.pool.stats().blocks_in_use == before);  // shared, not copied
  const sequence_snapshot parent_snap = w.seq.snapshot(), child_snap = child.snapshot();
  for (std::size_t l = 0; l < 2; ++l) {
    INFO("layer " << l);
    CHECK(child_snap.layer(l).kept_from() == parent_snap.layer(l).kept_from());
    CHECK(w.diff_kept(child_snap, l).empty());
  }
  // The child's truncates follow the parent's high-water mark: within
  // rollback_tokens, done; into what the window dropped, refused.
  const observed child_before = observe(child);
  CHECK(truncate(child, 20) == kv_errc::outside_window);
  CHECK(observe(child) == child_before);
  CHECK_FALSE(truncate(child, child.size() - 2));
  CHECK(child.size() == 38);
  CHECK(w.seq.size() == 40);  // the parent keeps its own
  CHECK(w.diff_kept(w.seq.snapshot(), 0).empty());
}

TEST_CASE("two threads append to windowed sequences while snapshots are taken, read and attended", "[layout]") {
  const kv_model_layout layout = kv_model_layout::interleaved(2, 2, 8, 2);
  kv_cache_config config = config_for(4096);
  asio::thread_pool threads(2);
  const kv_block_pool pool = kv_block_pool::for_caches(config);
  sequence_kv_cache a(threads, layout, config, pool), b(threads, layout, config, pool);
  constexpr std::size_t rounds = 300;
  shared_mismatches log;
  std::atomic<bool> done{false};
  const attention_shape shape{.query_heads = 2, .kv_heads = 2, .head_dim = 4};
  const auto reader = [&] {
    std::vector<float> q(8, 0.5f), out(8), pk(8, 0.1f), pv(8, 0.2f);
    for (std::size_t i = 0; i < 100000 && !done.load(); ++i) {
      for (sequence_kv_cache* s : {&a, &b}) {
        const sequence_snapshot snap = s->snapshot();
        for (std::size_t l = 0; l < 2; ++l) {
          const kv_snapshot& layer = snap.layer(l);
          kv_range r;
          const std::size_t from = std::min(std::max(layer.sink_tokens(), layer.kept_from()), layer.size());
          if (ghostlink::error_code ec = layer.read_range(from, layer.size(), r)) log.add(str("read: ", ec.message()));
          for (std::size_t t = 0; t + r.begin < r.end; ++t)
            if (r.keys[t * 8] != key_of(l, r.begin + t, 1, 0)) log.add(str("layer ", l, " token ", r.begin + t));
          if (ghostlink::error_code ec = attend(layer, q, out, shape, {pk, pv})) log.add(str("attend: ", ec.message()));
        }
      }
    }
  };
  const auto appender = [&](sequence_kv_cache& s) {
    for (std::size_t i = 0; i < rounds; ++i) {
      const step st(2, 8, s.size(), 1);
      if (ghostlink::error_code ec = append(s, st)) log.add(str("append: ", ec.message()));
    }
  };
  {
    std::jthread r(reader);
    std::jthread ta([&] { appender(a); }), tb([&] { appender(b); });
    ta.join();
    tb.join();
    done = true;
  }
  INFO(log.log.count << " problem(s), first:\n" << log.log.first);
  CHECK(log.log.count == 0);
  CHECK(a.size() == rounds);
  CHECK(b.size() == rounds);
  CHECK(pool.stats().blocks_in_use <= 2 * (kept_bound(layout.layers[0], 0) + ceil_div(rounds, B)));
}

TEST_CASE("a prefix cache of full layers refuses a windowed sequence: invalid_config, never part of its blocks",
          "[layout]") {
  windowed w(kv_model_layout::interleaved(2, 2, 8), 256);
  for (int tag = 1; tag <= 10; ++tag) w.append_ok(4, tag);
  kv_prefix_cache prefix(2, config_for(256), w.pool);
  std::vector<token_id> ids(w.seq.size());
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<token_id>(i);
  CHECK(refused([&] { (void)prefix.insert(w.seq, ids); }));
  CHECK(refused([&] { (void)prefix.insert_stored_tokens(w.seq); }));
  CHECK(prefix.stats().cached_blocks == 0);
  CHECK(prefix.match(ids) == 0);
}

namespace {

/// A load of `path` onto `w`'s pool expecting `layout`.
std::pair<ghostlink::error_code, sequence_kv_cache> load_as(windowed& w, const std::filesystem::path& path,
                                                            std::optional<kv_model_layout> layout) {
  return load(w.threads.get_executor(), path, w.pool,
              {.num_layers = w.layers, .config = w.seq.config(), .layout = std::move(layout)});
}

}  // namespace

TEST_CASE("a windowed sequence saves only what it keeps and loads back as it was, its layout checked", "[layout]") {
  const std::size_t sinks = GENERATE(0, 3);
  const std::size_t rollback = GENERATE(0, 2);
  INFO("sinks " << sinks << ", rollback " << rollback);
  kv_model_layout layout = kv_model_layout::interleaved(3, 3, 8, sinks);  // layers 0 and 1 windowed, 2 full
  layout.rollback_tokens = rollback;
  windowed w(layout, 512);
  for (int tag = 1; tag <= 9; ++tag) w.append_ok(static_cast<std::size_t>(tag % 5 + 3), tag);  // 47: ends mid-block
  REQUIRE(w.seq.size() % B != 0);
  const sequence_snapshot before = w.seq.snapshot();
  const ghostlink::test::temp_dir dir;
  const auto path = dir.path / "windowed.glkv";
  REQUIRE_FALSE(wait_ec([&](auto token) {
    return async_save(w.seq.snapshot(), path, kv_save_options{.config = w.seq.config()}, token);
  }));
  // Smaller than the same tokens saved whole: the windowed layers saved
  // their sinks and what they kept alone.
  const std::uintmax_t whole = std::uintmax_t{3} * 2 * w.seq.size() * w.width * sizeof(float);
  CHECK(std::filesystem::file_size(path) < whole);

  auto [ec, loaded] = load_as(w, path, layout);
  REQUIRE_FALSE(ec);
  CHECK(loaded.layout() == layout);
  const sequence_snapshot after = loaded.snapshot();
  CHECK(after.size() == before.size());
  CHECK(after.token_ids() == before.token_ids());
  for (std::size_t l = 0; l < 3; ++l) {
    INFO("layer " << l);
    CHECK(after.layer(l).kept_from() == before.layer(l).kept_from());
    CHECK(w.diff_kept(after, l).empty());
  }
  // It goes on as the original would: appends drop as they would, and a
  // truncate within rollback_tokens finds its window.
  const std::vector<int> tags = w.tags;
  for (int tag = 10; tag < 16; ++tag) {
    const step st(3, w.width, loaded.size(), tag, 3);
    REQUIRE_FALSE(append(loaded, st));
    w.tags.insert(w.tags.end(), 3, tag);
  }
  REQUIRE_FALSE(truncate(loaded, loaded.size() - rollback));
  w.tags.resize(loaded.size());
  for (std::size_t l = 0; l < 3; ++l) CHECK(w.diff_kept(loaded.snapshot(), l).empty());
  w.tags = tags;

  // Another layout, or none (full), or another count: refused, nothing made.
  const std::size_t blocks = w.pool.stats().blocks_in_use;
  kv_model_layout other_rollback = layout;
  other_rollback.rollback_tokens = rollback + 1;
  for (const std::optional<kv_model_layout>& wrong :
       {std::optional<kv_model_layout>(), std::optional(kv_model_layout::interleaved(3, 3, 16, sinks)),
        std::optional(kv_model_layout::interleaved(3, 3, 8, sinks + 1)), std::optional(other_rollback)}) {
    auto [refused, none] = load_as(w, path, wrong);
    CHECK(refused == kv_errc::layout_mismatch);
    CHECK_FALSE(none.valid());
  }
  auto [bad_count, none] = load_as(w, path, kv_model_layout::interleaved(4, 3, 8, sinks));
  CHECK(bad_count == kv_errc::invalid_config);
  CHECK(w.pool.stats().blocks_in_use == blocks);

  // One layer alone: the full one reads; a windowed one that dropped
  // positions has no whole layer to give.
  kv_sequence_expectation expected{.num_layers = 3, .config = w.seq.config(), .layout = layout};
  CHECK_NOTHROW(async_read_layer<float>(path, 2, expected, asio::use_future).get());
  try {
    (void)async_read_layer<float>(path, 0, expected, asio::use_future).get();
    FAIL("a windowed layer read whole");
  } catch (const ghostlink::test::async_error& e) {
    CHECK(e.code() == kv_errc::outside_window);
  }
}

}  // namespace layout_tests
