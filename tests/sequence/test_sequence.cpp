// basic_sequence_kv_cache: one token appended to every layer at once, all or
// nothing; truncate and fork of every layer; snapshots of one length.
#include "common/sequence_support.hpp"

#ifdef GHOSTLINK_CATCH2_V3
#include <catch2/catch_template_test_macros.hpp>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>

namespace sequence_tests {

using namespace ghostlink;
using namespace ghostlink::test::seq;
using ghostlink::test::small_config;

TEST_CASE("append puts each layer's own token at index size() in every layer and grows size by one", "[sequence]") {
  fixture f;
  CHECK(f.seq.num_layers() == layers);
  CHECK(f.seq.empty());
  CHECK(f.seq.snapshot().num_layers() == layers);
  for (int t = 0; t < 6; ++t) {
    f.append_ok(1 + t % 9);
    f.check_contents();
  }
  // A copy of the handle appends to the same sequence.
  sequence_kv_cache copy = f.seq;
  const step st(layers, f.width, copy.size(), 7);
  REQUIRE_FALSE(append(copy, st));
  f.tags.push_back(7);
  f.check_contents();
}

TEST_CASE("a const sequence handle appends, forks and truncates its sequence, as a const std::shared_ptr",
          "[sequence]") {
  fixture f;
  const sequence_kv_cache& seq = f.seq;  // e.g. a const member of the caller
  const step first(layers, f.width, 0, 3), second(layers, f.width, 1, 4);
  seq.async_append(first.key_spans, first.value_spans, asio::use_future).get();
  seq.async_append(second.key_spans, second.value_spans, asio::use_future).get();
  const sequence_kv_cache child = seq.async_fork(asio::use_future).get();
  seq.async_truncate(1, asio::use_future).get();
  CHECK(seq.size() == 1);
  CHECK(child.size() == 2);
  std::string d = diff_snapshot(child.snapshot(), {3, 4}) + diff_snapshot(seq.snapshot(), {3});
  INFO(d);
  CHECK(d.empty());
}

TEST_CASE("an append for the wrong number of layers is layer_mismatch and changes nothing", "[sequence]") {
  fixture f;
  f.append_ok(1);
  const step st(layers + 1, f.width, 1, 2);
  const std::span<const std::span<const float>> k(st.key_spans), v(st.value_spans);
  check_rejected(f, kv_errc::layer_mismatch, [&] { return append(f.seq, k.first(layers - 1), v.first(layers - 1)); });
  check_rejected(f, kv_errc::layer_mismatch, [&] { return append(f.seq, k, v); });
  check_rejected(f, kv_errc::layer_mismatch, [&] { return append(f.seq, k.first(layers), v.first(layers - 1)); });
  check_rejected(f, kv_errc::layer_mismatch, [&] { return append(f.seq, {}, {}); });
}

TEST_CASE("an append whose keys and values differ in length in any layer is length_mismatch and changes nothing",
          "[sequence]") {
  fixture f;
  f.append_ok(1);
  const std::vector<float> longer(f.width + 1, 9.0f);
  for (std::size_t bad_layer = 0; bad_layer < layers; ++bad_layer) {
    step st(layers, f.width, 1, 2);
    st.value_spans[bad_layer] = longer;
    INFO("layer " << bad_layer << " has longer values");
    check_rejected(f, kv_errc::length_mismatch, [&] { return append(f.seq, st); });
  }
}

TEST_CASE("an append of the wrong width in any layer is width_mismatch and changes nothing", "[sequence]") {
  fixture f;
  f.append_ok(1);
  const std::vector<float> shorter(f.width - 1, 9.0f);
  for (std::size_t bad_layer = 0; bad_layer < layers; ++bad_layer) {
    step st(layers, f.width, 1, 2);
    st.key_spans[bad_layer] = st.value_spans[bad_layer] = shorter;
    INFO("layer " << bad_layer << " is one float short");
    check_rejected(f, kv_errc::width_mismatch, [&] { return append(f.seq, st); });
    st.key_spans[bad_layer] = st.value_spans[bad_layer] = {};
    check_rejected(f, kv_errc::width_mismatch, [&] { return append(f.seq, st); });
  }
}

TEST_CASE("an append to a full sequence is index_out_of_range, after the shape checks, and changes nothing",
          "[sequence]") {
  fixture f;
  const std::size_t max = f.seq.config().max_tokens_per_seq;
  for (std::size_t i = 0; i < max; ++i) f.append_ok(1 + static_cast<int>(i % 9));
  step st(layers, f.width, max, 2);
  check_rejected(f, kv_errc::index_out_of_range, [&] { return append(f.seq, st); });
  const std::vector<float> shorter(f.width - 1, 9.0f);
  st.key_spans[2] = st.value_spans[2] = shorter;
  check_rejected(f, kv_errc::width_mismatch, [&] { return append(f.seq, st); });
  f.check_contents();
}

TEST_CASE("a sequence of zero layers, or on a pool that does not fit its caches, throws invalid_config", "[sequence]") {
  asio::thread_pool threads{2};
  const auto expect_invalid = [](const char* what, auto make) {
    INFO(what);
    try {
      make();
      FAIL("no exception");
    } catch (const std::system_error& e) {
      INFO("got: " << e.code().message());
      CHECK(e.code() == kv_errc::invalid_config);
    }
  };
  const kv_cache_config config = small_config();
  const kv_block_pool pool = kv_block_pool::for_caches<float>(config);
  expect_invalid("zero layers", [&] { sequence_kv_cache s(threads, 0, config); });
  expect_invalid("zero layers on a pool", [&] { sequence_kv_cache s(threads, 0, config, pool); });
  expect_invalid("float-sized pool, half storage", [&] { basic_sequence_kv_cache<half> s(threads, 2, config, pool); });
  kv_cache_config budgeted = config;
  budgeted.max_blocks = 4;
  expect_invalid("a budget in the config and a pool", [&] { sequence_kv_cache s(threads, 2, budgeted, pool); });
  sequence_kv_cache ok(threads, 2, config, pool);
  CHECK(ok.pool() == pool);
}

TEST_CASE("an append that runs out of pool blocks midway stores the token in no layer, and fits once blocks are freed",
          "[sequence]") {
  const kv_cache_config config = small_config();  // 4 tokens a block
  const kv_block_pool pool = kv_block_pool::for_caches<float>(config, {.max_blocks = 3 * layers});
  fixture f(config, pool);
  for (int t = 0; t < 8; ++t) f.append_ok(1);  // two blocks in every layer
  // Another cache on the pool takes one block: two left for three layers. It
  // runs on threads of its own, so joining them ends it once it is dropped.
  asio::thread_pool other_threads{2};
  layer_kv_cache other(other_threads, config, pool);
  ghostlink::test::blocking other_sync{other};
  REQUIRE_FALSE(other_sync.initialize(1));
  REQUIRE_FALSE(other_sync.write(0, ghostlink::test::filled(f.width, 1.0f), ghostlink::test::filled(f.width, 1.0f)));
  const std::size_t in_use = 2 * layers + 1;
  REQUIRE(pool.stats().blocks_in_use == in_use);

  const step st(layers, f.width, 8, 2);
  check_rejected(f, kv_errc::capacity_exhausted, [&] { return append(f.seq, st); });
  INFO("blocks in use after the failed append: " << pool.stats().blocks_in_use << ", before " << in_use);
  CHECK(pool.stats().blocks_in_use == in_use);

  SECTION("after a truncate frees a block in every layer, appends fit again") {
    REQUIRE_FALSE(truncate(f.seq, 4));
    f.tags.resize(4);
    CHECK(pool.stats().blocks_in_use == layers + 1);
    for (int t = 0; t < 4; ++t) f.append_ok(3);
    f.check_contents();
  }
  SECTION("after another cache on the pool releases its block, the append fits") {
    other = {};
    other_threads.join();  // the dropped cache's last drain has ended: its block is back
    CHECK(pool.stats().blocks_in_use == 2 * layers);
    f.append_ok(2);
    f.check_contents();
    CHECK(pool.stats().blocks_in_use == 3 * layers);
  }
}

TEST_CASE("an append, truncate or fork started while an append is in flight is operation_in_progress, storing nothing",
          "[sequence]") {
  // Nothing runs until the context does, so the first append is surely in
  // flight when the others start.
  asio::io_context ctx;
  sequence_kv_cache seq(ctx, layers, small_config());
  const std::size_t width = seq.config().token_width();
  const step first(layers, width, 0, 1), second(layers, width, 0, 2), third(layers, width, 1, 3);
  ghostlink::error_code first_ec = kv_errc::zero_length, second_ec, truncate_ec, fork_ec,
                        third_ec = kv_errc::zero_length;
  sequence_kv_cache forked = seq;
  seq.async_append(first.key_spans, first.value_spans, [&](ghostlink::error_code ec) { first_ec = ec; });
  seq.async_append(second.key_spans, second.value_spans, [&](ghostlink::error_code ec) { second_ec = ec; });
  seq.async_truncate(0, [&](ghostlink::error_code ec) { truncate_ec = ec; });
  seq.async_fork([&](ghostlink::error_code ec, sequence_kv_cache s) {
    fork_ec = ec;
    forked = std::move(s);
  });
  run_on_two_threads(ctx);
  INFO("first: " << first_ec.message() << "; second: " << second_ec.message() << "; truncate: " << truncate_ec.message()
                 << "; fork: " << fork_ec.message());
  CHECK_FALSE(first_ec);
  CHECK(second_ec == kv_errc::operation_in_progress);
  CHECK(truncate_ec == kv_errc::operation_in_progress);
  CHECK(fork_ec == kv_errc::operation_in_progress);
  CHECK_FALSE(forked.valid());
  CHECK(seq.size() == 1);
  std::string d = diff_snapshot(seq.snapshot(), {1});
  INFO(d);
  CHECK(d.empty());

  // The rejected operations left no claim behind: the next append goes through.
  seq.async_append(third.key_spans, third.value_spans, [&](ghostlink::error_code ec) { third_ec = ec; });
  run_on_two_threads(ctx);
  CHECK_FALSE(third_ec);
  d = diff_snapshot(seq.snapshot(), {1, 3});
  INFO(d);
  CHECK(d.empty());
}

TEST_CASE("truncate drops the tail from every layer, keeps older snapshots whole and frees the blocks once released",
          "[sequence]") {
  fixture f;
  for (int t = 0; t < 6; ++t) f.append_ok(1 + t);
  const kv_block_pool pool = f.seq.pool();
  std::vector<int> old_tags = f.tags;
  {
    const auto old = f.seq.snapshot();
    REQUIRE_FALSE(truncate(f.seq, 3));
    f.tags.resize(3);
    f.check_contents();
    const std::string d = diff_snapshot(old, old_tags);
    INFO("snapshot taken before the truncate: " << d);
    CHECK(old.size() == 6);
    CHECK(d.empty());
    CHECK(pool.stats().blocks_in_use == layers * blocks_for(6));  // the old snapshot pins the tail
  }
  CHECK(pool.stats().blocks_in_use == layers * blocks_for(3));
  CHECK_FALSE(truncate(f.seq, 3));  // n >= size(): nothing to drop
  CHECK_FALSE(truncate(f.seq, 100));
  f.check_contents();
  f.append_ok(8);  // lands at index 3
  f.check_contents();
  REQUIRE_FALSE(truncate(f.seq, 0));
  f.tags.clear();
  f.check_contents();
  CHECK(pool.stats().blocks_in_use == 0);
}

TEST_CASE("fork shares every block of every layer and both sequences then diverge independently", "[sequence]") {
  fixture f;
  for (int t = 0; t < 6; ++t) f.append_ok(1);
  const std::size_t blocks = f.seq.pool().stats().blocks_in_use;
  auto [ec, child] = fork(f.seq);
  REQUIRE_FALSE(ec);
  REQUIRE(child.valid());
  INFO("blocks in use before the fork " << blocks << ", after " << f.seq.pool().stats().blocks_in_use);
  CHECK(f.seq.pool().stats().blocks_in_use == blocks);
  CHECK(child.pool() == f.seq.pool());
  CHECK(child.num_layers() == layers);
  CHECK(child.size() == 6);
  CHECK(observe(child) == observe(f.seq));

  std::vector<int> child_tags = f.tags;
  const step to_child(layers, f.width, 6, 2);
  REQUIRE_FALSE(append(child, to_child));
  child_tags.push_back(2);
  f.append_ok(3);
  std::string d = diff_snapshot(child.snapshot(), child_tags);
  INFO("child: " << d);
  CHECK(d.empty());
  f.check_contents();

  REQUIRE_FALSE(truncate(child, 2));
  child_tags.resize(2);
  CHECK(child.size() == 2);
  d = diff_snapshot(child.snapshot(), child_tags);
  INFO("child after truncate: " << d);
  CHECK(d.empty());
  f.check_contents();
}

TEST_CASE("a fork of an empty sequence accepts appends of its own", "[sequence]") {
  fixture f;
  auto [ec, child] = fork(f.seq);
  REQUIRE_FALSE(ec);
  REQUIRE(child.valid());
  const step st(layers, f.width, 0, 4);
  REQUIRE_FALSE(append(child, st));
  const std::string d = diff_snapshot(child.snapshot(), {4});
  INFO(d);
  CHECK(d.empty());
  CHECK(child.size() == 1);
  f.check_contents();  // the parent stays empty
}

namespace {

/// Appends 48 tokens, `chunk` per append, while 2 reader threads snapshot:
/// every snapshot holds whole appends (a multiple of `chunk` tokens), exactly
/// as appended, never fewer than size() showed before it, never shrinking.
/// The writer appends the next chunk only once every reader has seen the
/// last, so readers snapshot every length and race every append.
void check_concurrent_snapshots(std::size_t chunk) {
  constexpr std::size_t tokens = 48, readers = 2;
  constexpr std::size_t max_rounds = 5'000'000;  // per reader; far more than the writer needs
  kv_cache_config config = small_config();
  config.max_tokens_per_seq = tokens;
  std::vector<int> tags(tokens);
  for (std::size_t i = 0; i < tokens; ++i) tags[i] = 1 + static_cast<int>(i / chunk % 9);
  shared_mismatches bad;
  std::atomic<std::size_t> snapshots{0};
  // Each reader publishes the largest size it has seen (SIZE_MAX once it
  // stops).
  std::array<std::atomic<std::size_t>, readers> seen{};
  std::atomic<bool> writer_done{false};
  fixture f(config);
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < readers; ++r)
    threads.emplace_back([&, r] {
      std::size_t last = 0, rounds = 0;
      for (bool finished = false; !finished && rounds < max_rounds; ++rounds) {
        finished = writer_done.load(std::memory_order_acquire);
        const std::size_t completed = f.seq.size();
        const auto snap = f.seq.snapshot();
        if (snap.size() < completed)
          bad.add(str("reader ", r, ": snapshot ", snap.size(), " after size() ", completed));
        if (snap.size() < last) bad.add(str("reader ", r, ": snapshot shrank from ", last, " to ", snap.size()));
        if (snap.size() % chunk != 0) bad.add(str("reader ", r, ": snapshot of ", snap.size(), " tokens"));
        if (finished && snap.size() != tokens) bad.add(str("reader ", r, ": final snapshot of ", snap.size()));
        if (std::string d = diff_snapshot(snap, tags); !d.empty()) bad.add(str("reader ", r, ": ", d));
        if (snap.size() > last) {
          seen[r].store(snap.size(), std::memory_order_release);
          seen[r].notify_all();
        }
        last = std::max(last, snap.size());
      }
      seen[r].store(SIZE_MAX, std::memory_order_release);
      seen[r].notify_all();
      snapshots += rounds;
    });
  std::size_t appended = 0;
  for (std::size_t i = 0; i < tokens; i += chunk) {
    const step st(layers, f.width, i, tags[i], chunk);
    if (append(f.seq, st)) break;
    appended += chunk;
    for (std::atomic<std::size_t>& s : seen)
      for (std::size_t v = s.load(std::memory_order_acquire); v < appended; v = s.load(std::memory_order_acquire))
        s.wait(v, std::memory_order_acquire);
  }
  writer_done.store(true, std::memory_order_release);
  for (std::thread& t : threads) t.join();
  CHECK(appended == tokens);
  INFO(bad.log.count << " mismatch(es) in " << snapshots << " snapshots, first:\n" << bad.log.first);
  CHECK(bad.log.count == 0);
  f.tags = tags;
  f.check_contents();
}

}  // namespace

TEST_CASE("concurrent snapshots never show a partially appended token", "[sequence][concurrency]") {
  check_concurrent_snapshots(1);
}

TEST_CASE("concurrent snapshots show every token of a multi-token append or none of them",
          "[sequence][prefill][concurrency]") {
  check_concurrent_snapshots(3);
}

TEST_CASE("a sequence snapshot never shows a token of one append in some layers and of another in the rest",
          "[sequence][concurrency]") {
  // Speculative-decoding rollback: token 1 is dropped and appended again,
  // alternately with tag 2 and tag 3, while readers take snapshots.
  constexpr int rollbacks = 20000;
  constexpr std::size_t readers = 3, max_rounds = 100'000'000;  // per reader; far more than the writer needs
  shared_mismatches bad;
  std::atomic<std::size_t> snapshots{0};
  std::atomic<bool> writer_done{false};
  fixture f;
  f.append_ok(1);
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < readers; ++r)
    threads.emplace_back([&] {
      std::size_t rounds = 0;
      for (; !writer_done.load(std::memory_order_acquire) && rounds < max_rounds; ++rounds) {
        const auto snap = f.seq.snapshot();
        const std::string as2 = diff_snapshot(snap, {1, 2}), as3 = diff_snapshot(snap, {1, 3});
        if (!as2.empty() && !as3.empty()) bad.add("neither all tag 2 (" + as2 + ") nor all tag 3 (" + as3 + ")");
      }
      snapshots += rounds;
    });
  int done = 0;
  for (; done < rollbacks; ++done) {
    const step st(layers, f.width, 1, 2 + done % 2);
    if (truncate(f.seq, 1) || append(f.seq, st)) break;
  }
  writer_done.store(true, std::memory_order_release);
  for (std::thread& t : threads) t.join();
  CHECK(done == rollbacks);
  INFO(bad.log.count << " mixed snapshot(s) in " << snapshots << ", first:\n" << bad.log.first);
  CHECK(bad.log.count == 0);
}

TEST_CASE("a default-constructed sequence snapshot is empty", "[sequence]") {
  const sequence_kv_cache::snapshot_type snap;
  INFO("size() " << snap.size() << ", num_layers() " << snap.num_layers());
  CHECK(snap.size() == 0);
  CHECK(snap.empty());
  CHECK(snap.num_layers() == 0);
}

TEMPLATE_TEST_CASE("a sequence storing 16-bit elements keeps each layer's token rounded to its type",
                   "[sequence][element]", half, bfloat16) {
  asio::thread_pool threads{2};
  const kv_cache_config config = small_config();
  basic_sequence_kv_cache<TestType> seq(threads, layers, config);
  const std::size_t width = config.token_width(), n = 6;
  std::vector<int> tags;
  for (std::size_t i = 0; i < n; ++i) {
    const step st(layers, width, i, 1 + static_cast<int>(i));
    REQUIRE_FALSE(append(seq, st));
    tags.push_back(1 + static_cast<int>(i));
  }
  const auto snap = seq.snapshot();
  CHECK(snap.size() == n);
  const std::string d = diff_snapshot(snap, tags);  // compares with float(T(x)), bit for bit
  INFO(d);
  CHECK(d.empty());

  std::size_t differing = 0, rounded = 0;
  for (std::size_t l = 0; l < layers; ++l)
    REQUIRE_FALSE(snap.layer(l).for_each_block(0, n, [&](std::size_t first, std::size_t count, auto k, auto) {
      static_assert(std::is_same_v<decltype(k), std::span<const TestType>>);
      for (std::size_t t = 0; t < count; ++t)
        for (std::size_t lane = 0; lane < width; ++lane) {
          const float x = key_of(l, first + t, tags[first + t], lane);
          differing += k[t * width + lane].bits != TestType(x).bits ? 1 : 0;
          rounded += bits32(stored<TestType>(x)) != bits32(x) ? 1 : 0;
        }
    }));
  INFO(differing << " stored elements differ from the converted input");
  CHECK(differing == 0);
  CHECK(rounded > 0);
  CHECK(seq.pool().block_bytes() == kv_block_pool::block_bytes_for<TestType>(config));
  CHECK(seq.pool().stats().bytes_in_use() == layers * blocks_for(n) * kv_block_pool::block_bytes_for<TestType>(config));
}

// Multi-token appends: a prefill chunk, one request per layer, all or nothing.

TEST_CASE("a multi-token append puts its tokens in every layer as one request per layer and grows size by their count",
          "[sequence][prefill]") {
  fixture f;
  f.append_ok(1);
  std::vector<std::uint64_t> applied_before;
  for (std::size_t l = 0; l < layers; ++l) applied_before.push_back(f.seq.layer(l).stats().requests_applied);
  const std::size_t chunk = 6;  // from index 1: across two block boundaries (4 tokens a block)
  const step st(layers, f.width, 1, 2, chunk);
  REQUIRE_FALSE(append(f.seq, st));
  f.tags.insert(f.tags.end(), chunk, 2);
  CHECK(f.seq.size() == 1 + chunk);
  for (std::size_t l = 0; l < layers; ++l) {
    INFO("layer " << l);
    CHECK(f.seq.layer(l).stats().requests_applied == applied_before[l] + 1);
  }
  f.check_contents();
  f.append_ok(3);  // a one-token append goes on after it
  f.check_contents();
}

TEST_CASE("a multi-token append not a whole number of tokens, or of another count in any layer, is width_mismatch",
          "[sequence][prefill]") {
  fixture f;
  f.append_ok(1);
  for (std::size_t bad_layer = 0; bad_layer < layers; ++bad_layer) {
    step st(layers, f.width, 1, 2, 3);
    INFO("layer " << bad_layer);
    st.key_spans[bad_layer] = st.value_spans[bad_layer] = std::span(st.keys[bad_layer]).first(2 * f.width);
    check_rejected(f, kv_errc::width_mismatch, [&] { return append(f.seq, st); });
    st.key_spans[bad_layer] = st.value_spans[bad_layer] = std::span(st.keys[bad_layer]).first(2 * f.width + 1);
    check_rejected(f, kv_errc::width_mismatch, [&] { return append(f.seq, st); });
  }
  f.check_contents();
}

TEST_CASE("a multi-token append that would pass max_tokens_per_seq is index_out_of_range and changes nothing",
          "[sequence][prefill]") {
  fixture f;
  const std::size_t max = f.seq.config().max_tokens_per_seq;
  const step most(layers, f.width, 0, 1, max - 2);
  REQUIRE_FALSE(append(f.seq, most));
  f.tags.assign(max - 2, 1);
  const step three(layers, f.width, max - 2, 2, 3);
  check_rejected(f, kv_errc::index_out_of_range, [&] { return append(f.seq, three); });
  const step two(layers, f.width, max - 2, 3, 2);
  REQUIRE_FALSE(append(f.seq, two));
  f.tags.insert(f.tags.end(), 2, 3);
  f.check_contents();
}

TEST_CASE("a multi-token append that runs out of pool blocks in any layer stores none of its tokens in any layer",
          "[sequence][prefill]") {
  const kv_cache_config config = small_config();  // 4 tokens a block
  const kv_block_pool pool = kv_block_pool::for_caches<float>(config, {.max_blocks = 2 * layers});
  fixture f(config, pool);
  for (int t = 0; t < 4; ++t) f.append_ok(1);  // one block in every layer: three left for the pool
  const step st(layers, f.width, 4, 2, 8);      // two more blocks in every layer
  check_rejected(f, kv_errc::capacity_exhausted, [&] { return append(f.seq, st); });
  INFO("blocks in use after the failed append: " << pool.stats().blocks_in_use);
  CHECK(pool.stats().blocks_in_use == layers);
  const step fits(layers, f.width, 4, 3, 4);  // one more block in every layer fits
  REQUIRE_FALSE(append(f.seq, fits));
  f.tags.insert(f.tags.end(), 4, 3);
  f.check_contents();
}

}  // namespace sequence_tests
