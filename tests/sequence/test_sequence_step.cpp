// A sequence's step: begin, write layer by layer, read each layer's own
// write, commit or end; the forward pass of a real engine.

#include "common/sequence_support.hpp"

#include "common/asio_compat.hpp"
#include "testing/hooks.hpp"

#ifdef GHOSTLINK_CATCH2_V3
#include <catch2/generators/catch_generators.hpp>
#endif

#include <atomic>
#include <future>
#include <memory>
#include <optional>
#include <thread>

namespace sequence_step_tests {

using namespace ghostlink;
using namespace ghostlink::test::seq;
using ghostlink::test::small_config;
using ghostlink::test::wait_ec;

namespace {

/// The tags the fixture's tokens get: one per step, from `first`.
std::vector<int> tags_from(const fixture& f, int tag, std::size_t tokens) {
  std::vector<int> tags = f.tags;
  tags.insert(tags.end(), tokens, tag);
  return tags;
}

/// "" if layer `l`'s snapshot `snap` shows exactly `tags`, else what differs.
std::string diff_layer(const kv_snapshot& snap, std::size_t l, const std::vector<int>& tags) {
  if (snap.size() != tags.size()) return str("layer ", l, " shows ", snap.size(), " tokens, expected ", tags.size());
  kv_range r;
  if (ghostlink::error_code ec = snap.read_range(0, snap.size(), r)) return ec.message();
  const std::size_t w = snap.token_width();
  for (std::size_t i = 0; i < tags.size(); ++i) {
    std::string d =
        diff_token<float>(l, i, tags[i], std::span(r.keys).subspan(i * w, w), std::span(r.values).subspan(i * w, w));
    if (!d.empty()) return d;
  }
  return {};
}

}  // namespace

TEST_CASE("a step's tokens join the sequence at its commit, all at once; each layer's snapshot reads its own write",
          "[step]") {
  fixture f;
  f.append_ok(1);
  f.append_ok(2);
  const std::size_t tokens = GENERATE(1, 3);  // a decode step; a chunk across a block boundary
  INFO(tokens << " tokens");
  const observed before = observe(f.seq);
  auto [ec, open] = begin_step(f.seq, tokens);
  REQUIRE_FALSE(ec);
  REQUIRE(open.valid());
  CHECK(open.index() == 2);
  CHECK(open.size() == tokens);
  CHECK(open.num_layers() == layers);
  const step st(layers, f.width, 2, 7, tokens);
  const std::vector<int> with_step = tags_from(f, 7, tokens);
  for (std::size_t l = 0; l < layers; ++l) {
    INFO("layer " << l);
    CHECK(diff_layer(open.snapshot(l), l, f.tags).empty());  // before its write: the sequence's tokens
    REQUIRE_FALSE(write_layer(open, l, st));
    const std::string d = diff_layer(open.snapshot(l), l, with_step);  // read your writes
    INFO(d);
    CHECK(d.empty());
    if (l + 1 < layers) CHECK(open.snapshot(l + 1).size() == 2);  // the next layer is not written yet
    // The sequence does not show the step before its commit.
    CHECK(f.seq.size() == 2);
    CHECK(f.seq.snapshot().size() == 2);
  }
  CHECK(observe(f.seq).size == before.size);
  REQUIRE_FALSE(commit(open));
  f.tags = with_step;
  f.check_contents();
  SECTION("a committed step's tokens are the sequence's: fork keeps them, truncate drops them") {
    auto [fork_ec, child] = fork(f.seq);
    REQUIRE_FALSE(fork_ec);
    CHECK(diff_snapshot(child.snapshot(), f.tags).empty());
    REQUIRE_FALSE(truncate(f.seq, 2));
    f.tags.resize(2);
    f.check_contents();
    CHECK(child.size() == 2 + tokens);
  }
  SECTION("after the commit, the step's writes, commits and abandons fail with step_closed") {
    const observed committed = observe(f.seq);
    CHECK(write_layer(open, 0, st) == kv_errc::step_closed);
    CHECK(commit(open) == kv_errc::step_closed);
    CHECK(abandon(open) == kv_errc::step_closed);
    CHECK(observe(f.seq) == committed);
    f.append_ok(3);  // the sequence is free
    f.check_contents();
  }
}

TEST_CASE("while a step is open, the sequence's appends, truncates, forks and steps fail with operation_in_progress",
          "[step]") {
  fixture f;
  f.append_ok(1);
  auto [ec, open] = begin_step(f.seq, 1);
  REQUIRE_FALSE(ec);
  const step st(layers, f.width, 1, 2);
  REQUIRE_FALSE(write_layer(open, 0, st));
  check_rejected(f, kv_errc::operation_in_progress, [&] { return append(f.seq, st); });
  check_rejected(f, kv_errc::operation_in_progress, [&] { return truncate(f.seq, 0); });
  check_rejected(f, kv_errc::operation_in_progress, [&] { return fork(f.seq).first; });
  check_rejected(f, kv_errc::operation_in_progress, [&] { return begin_step(f.seq, 1).first; });
  for (std::size_t l = 1; l < layers; ++l) REQUIRE_FALSE(write_layer(open, l, st));
  REQUIRE_FALSE(commit(open));
  f.tags.push_back(2);
  f.check_contents();
}

TEST_CASE("a step commits only once every layer is written: step_incomplete leaves it open", "[step]") {
  fixture f;
  auto [ec, open] = begin_step(f.seq, 2);
  REQUIRE_FALSE(ec);
  const step st(layers, f.width, 0, 4, 2);
  REQUIRE_FALSE(write_layer(open, 0, st));
  REQUIRE_FALSE(write_layer(open, 2, st));
  CHECK(commit(open) == kv_errc::step_incomplete);
  CHECK(f.seq.size() == 0);
  CHECK(f.seq.snapshot().size() == 0);
  REQUIRE_FALSE(write_layer(open, 1, st));
  REQUIRE_FALSE(commit(open));
  f.tags = {4, 4};
  f.check_contents();
}

TEST_CASE("a step's bad writes fail with their error and change nothing; a layer is written once", "[step]") {
  fixture f;
  f.append_ok(1);
  auto [ec, open] = begin_step(f.seq, 2);
  REQUIRE_FALSE(ec);
  const step st(layers, f.width, 1, 5, 2), one(layers, f.width, 1, 5, 1);
  const std::vector<float> longer(st.keys[0].size() + f.width);
  const auto layer_state = [&] { return observe(f.seq.layer(0)); };
  const auto check = [&](kv_errc expected, auto&& bad) {
    const auto before = layer_state();
    const ghostlink::error_code got = bad();
    INFO("got " << got.message());
    CHECK(got == expected);
    CHECK(layer_state() == before);
  };
  const auto write = [&](std::size_t l, std::span<const float> k, std::span<const float> v) {
    return wait_ec([&](auto token) { return open.async_write(l, k, v, token); });
  };
  check(kv_errc::layer_mismatch, [&] { return write(layers, st.keys[0], st.values[0]); });
  check(kv_errc::length_mismatch, [&] { return write(0, st.keys[0], longer); });
  check(kv_errc::width_mismatch, [&] { return write(0, one.keys[0], one.values[0]); });   // 1 token of 2
  check(kv_errc::width_mismatch, [&] { return write(0, longer, longer); });               // 3 tokens of 2
  REQUIRE_FALSE(write_layer(open, 0, st));
  check(kv_errc::operation_in_progress, [&] { return write_layer(open, 0, st); });
  for (std::size_t l = 1; l < layers; ++l) REQUIRE_FALSE(write_layer(open, l, st));
  REQUIRE_FALSE(commit(open));
  f.tags = {1, 5, 5};
  f.check_contents();
}

TEST_CASE("a begin of zero tokens or past max_tokens_per_seq fails and changes nothing", "[step]") {
  fixture f;
  f.append_ok(1);
  check_rejected(f, kv_errc::zero_length, [&] { return begin_step(f.seq, 0).first; });
  check_rejected(f, kv_errc::index_out_of_range,
                 [&] { return begin_step(f.seq, small_config().max_tokens_per_seq).first; });
  auto [ec, open] = begin_step(f.seq, small_config().max_tokens_per_seq - 1);  // fills the sequence exactly
  CHECK_FALSE(ec);
}

TEST_CASE("an abandoned step leaves the sequence as before it, free for the next operation", "[step]") {
  fixture f;
  f.append_ok(1);
  f.append_ok(2);
  const observed before = observe(f.seq);
  const std::size_t in_use = f.seq.pool().stats().blocks_in_use;
  auto [ec, open] = begin_step(f.seq, 3);
  REQUIRE_FALSE(ec);
  const step st(layers, f.width, 2, 9, 3);
  REQUIRE_FALSE(write_layer(open, 0, st));
  REQUIRE_FALSE(write_layer(open, 1, st));
  REQUIRE_FALSE(abandon(open));
  CHECK(open.valid());
  CHECK(write_layer(open, 2, st) == kv_errc::step_closed);
  CHECK(commit(open) == kv_errc::step_closed);
  INFO("before: " << before << "; after: " << observe(f.seq));
  CHECK(observe(f.seq) == before);
  CHECK(f.seq.pool().stats().blocks_in_use == in_use);  // what the step set aside is back
  f.append_ok(3);
  f.check_contents();
}

TEST_CASE("destroying an open step undoes it in the background", "[step]") {
  asio::io_context io;
  sequence_kv_cache seq(io, layers, small_config());
  const std::size_t width = seq.config().token_width();
  const step first(layers, width, 0, 1), st(layers, width, 1, 2), next(layers, width, 1, 3);
  std::optional<ghostlink::error_code> result;
  seq.async_append(first.key_spans, first.value_spans, [&](ghostlink::error_code ec) { result = ec; });
  run_on_two_threads(io);
  REQUIRE(result == ghostlink::error_code());
  const observed before = observe(seq);
  {
    std::optional<sequence_kv_cache::step_type> open;
    seq.async_begin_step(1, [&](ghostlink::error_code ec, sequence_kv_cache::step_type s) {
      REQUIRE_FALSE(ec);
      open = std::move(s);
    });
    run_on_two_threads(io);
    REQUIRE(open.has_value());
    std::atomic<int> failed{0};  // (the handlers run on two threads: no Catch2 assertion in them)
    for (std::size_t l = 0; l < layers; ++l)
      open->async_write(l, st.key_spans[l], st.value_spans[l], [&](ghostlink::error_code ec) { failed += ec ? 1 : 0; });
    run_on_two_threads(io);
    CHECK(failed == 0);
    CHECK(seq.layer(0).size() == 1);  // the layer as published: the step shows at its commit
    CHECK(open->snapshot(0).size() == 2);
    CHECK(seq.snapshot().size() == 1);
  }  // destroyed uncommitted
  run_on_two_threads(io);  // every layer drops the step's tokens
  CHECK(observe(seq) == before);
  result.reset();
  seq.async_append(next.key_spans, next.value_spans, [&](ghostlink::error_code ec) { result = ec; });
  run_on_two_threads(io);
  CHECK(result == ghostlink::error_code());
  CHECK(diff_snapshot(seq.snapshot(), {1, 3}).empty());
}

TEST_CASE("a begun step writes every layer even when its pool has run out meanwhile", "[step]") {
  const kv_cache_config config = small_config();  // 4 tokens a block
  const kv_block_pool pool = kv_block_pool::for_caches<float>(config, {.max_blocks = 2 * layers});
  fixture f(config, pool);
  for (int t = 0; t < 3; ++t) f.append_ok(1);  // one block in every layer, one token left in it
  // 5 tokens from index 3: the rest of the first block and one new block per layer.
  auto [ec, open] = begin_step(f.seq, 5);
  REQUIRE_FALSE(ec);
  CHECK(pool.stats().blocks_in_use == 2 * layers);  // set aside: the whole budget
  // Nothing is left for anyone else.
  const step other_tokens(layers, f.width, 0, 1);
  sequence_kv_cache other(f.threads, layers, config, pool);
  CHECK(append(other, other_tokens) == kv_errc::capacity_exhausted);
  const step st(layers, f.width, 3, 6, 5);
  for (std::size_t l = 0; l < layers; ++l) REQUIRE_FALSE(write_layer(open, l, st));
  REQUIRE_FALSE(commit(open));
  f.tags = {1, 1, 1, 6, 6, 6, 6, 6};
  f.check_contents();
  CHECK(pool.stats().blocks_in_use == 2 * layers);
}

TEST_CASE("a begin the pool cannot serve in every layer fails with capacity_exhausted and changes nothing", "[step]") {
  const kv_cache_config config = small_config();
  const kv_block_pool pool = kv_block_pool::for_caches<float>(config, {.max_blocks = 2 * layers - 1});
  fixture f(config, pool);
  for (int t = 0; t < 4; ++t) f.append_ok(1);  // one full block in every layer
  const std::size_t in_use = pool.stats().blocks_in_use;
  check_rejected(f, kv_errc::capacity_exhausted, [&] { return begin_step(f.seq, 1).first; });
  CHECK(pool.stats().blocks_in_use == in_use);  // the layers that set a block aside gave it back
  // Within the budget, a step fits.
  REQUIRE_FALSE(truncate(f.seq, 3));
  f.tags.resize(3);
  auto [ec, open] = begin_step(f.seq, 1);
  REQUIRE_FALSE(ec);
  const step st(layers, f.width, 3, 2);
  for (std::size_t l = 0; l < layers; ++l) REQUIRE_FALSE(write_layer(open, l, st));
  REQUIRE_FALSE(commit(open));
  f.tags.push_back(2);
  f.check_contents();
}

TEST_CASE("a cancelled begin completes with operation_aborted and changes nothing", "[step][cancellation]") {
  asio::io_context io;
  sequence_kv_cache seq(io, layers, small_config());
  const std::size_t width = seq.config().token_width();
  const step st(layers, width, 0, 2);
  const observed before = observe(seq);
  asio::cancellation_signal signal;
  std::optional<ghostlink::error_code> result;
  std::optional<sequence_kv_cache::step_type> open;
  seq.async_begin_step(1, asio::bind_cancellation_slot(signal.slot(), [&](ghostlink::error_code ec, auto s) {
                         result = ec;
                         open = std::move(s);
                       }));
  signal.emit(asio::cancellation_type::terminal);
  run_on_two_threads(io);
  REQUIRE(result.has_value());
  CHECK(*result == asio::error::operation_aborted);
  CHECK_FALSE(open->valid());
  CHECK(observe(seq) == before);

  // The sequence is free: a step begins, is written and commits.
  result.reset();
  open.reset();
  seq.async_begin_step(1, [&](ghostlink::error_code ec, auto s) {
    result = ec;
    open = std::move(s);
  });
  run_on_two_threads(io);
  REQUIRE(result == ghostlink::error_code());
  for (std::size_t l = 0; l < layers; ++l) CHECK_FALSE(open->write(l, st.key_spans[l], st.value_spans[l]));
  result.reset();
  open->async_commit([&](ghostlink::error_code ec) { result = ec; });
  run_on_two_threads(io);
  CHECK(result == ghostlink::error_code());
  CHECK(diff_snapshot(seq.snapshot(), {2}).empty());
}

TEST_CASE("layers of a step written with write() from two threads at once; snapshots on a third never show an "
          "uncommitted step",
          "[step][concurrency]") {
  fixture f;  // its pool runs the actors on 2 threads
  constexpr std::size_t steps = 12;  // of 1 token: 12 of small_config's 16
  std::atomic<bool> done{false};
  shared_mismatches bad;
  std::atomic<std::size_t> looked{0};
  // The reader: a snapshot never shows more than size() read after it, and
  // shows exactly the tokens of the committed steps.
  std::thread reader([&] {
    while (!done.load(std::memory_order_acquire)) {
      const auto snap = f.seq.snapshot();
      const std::size_t size_after = f.seq.size();
      if (snap.size() > size_after) bad.add(str("snapshot ", snap.size(), " ahead of size ", size_after));
      std::vector<int> tags(snap.size());
      for (std::size_t i = 0; i < tags.size(); ++i) tags[i] = static_cast<int>(i) + 1;
      if (std::string d = diff_snapshot(snap, tags); !d.empty()) bad.add(d);
      const std::vector<token_id> ids = snap.token_ids();
      for (std::size_t i = 0; i < ids.size(); ++i)
        if (ids[i] != static_cast<token_id>(100 + i)) bad.add(str("token ", i, " has id ", ids[i]));
      looked.fetch_add(1, std::memory_order_relaxed);
    }
  });
  for (std::size_t i = 0; i < steps; ++i) {
    const token_id id[] = {static_cast<token_id>(100 + i)};
    auto [ec, open] = begin_step(f.seq, std::span<const token_id>(id));
    REQUIRE_FALSE(ec);
    const step st(layers, f.width, i, static_cast<int>(i) + 1);
    // Layer 0 from this thread, layers 1 and 2 from another, at once.
    ghostlink::error_code other_ec;
    std::thread other([&] {
      for (std::size_t l = 1; l < layers; ++l)
        if (ghostlink::error_code e = open.write(l, st.key_spans[l], st.value_spans[l])) other_ec = e;
    });
    const ghostlink::error_code mine = open.write(0, st.key_spans[0], st.value_spans[0]);
    other.join();
    REQUIRE_FALSE(mine);
    REQUIRE_FALSE(other_ec);
    REQUIRE_FALSE(commit(open));
    f.tags.push_back(static_cast<int>(i) + 1);
  }
  // Let the reader see the final state at least once before it stops.
  const std::size_t seen = looked.load();
  for (int spin = 0; looked.load() < seen + 2 && spin < 100'000'000; ++spin) std::this_thread::yield();
  done.store(true, std::memory_order_release);
  reader.join();
  INFO(bad.log.first);
  CHECK(bad.log.count == 0);
  CHECK(looked.load() > 0);
  f.check_contents();
}

TEST_CASE("token ids are stored once per token with appends and steps, kept by fork and truncate, returned by "
          "snapshots",
          "[step][token_ids]") {
  fixture f;
  const step chunk(layers, f.width, 0, 1, 2), plain(layers, f.width, 2, 2), stepped(layers, f.width, 3, 3);
  const std::vector<token_id> chunk_ids = {10, 11}, step_ids = {12};
  REQUIRE_FALSE(wait_ec([&](auto token) {
    return f.seq.async_append(std::span<const token_id>(chunk_ids), chunk.key_spans, chunk.value_spans, token);
  }));
  REQUIRE_FALSE(append(f.seq, plain));  // no ids: no_token_id
  {
    auto [ec, open] = begin_step(f.seq, std::span<const token_id>(step_ids));
    REQUIRE_FALSE(ec);
    CHECK(open.size() == 1);
    CHECK(f.seq.snapshot().token_ids() == std::vector<token_id>{10, 11, no_token_id});  // not before the commit
    for (std::size_t l = 0; l < layers; ++l) REQUIRE_FALSE(write_layer(open, l, stepped));
    REQUIRE_FALSE(commit(open));
  }
  f.tags = {1, 1, 2, 3};
  f.check_contents();
  const auto snap = f.seq.snapshot();
  CHECK(snap.token_ids() == std::vector<token_id>{10, 11, no_token_id, 12});
  CHECK(snap.token_id_at(1) == 11);
  CHECK(snap.token_id_at(4) == no_token_id);  // past size()

  SECTION("a fork keeps them; a truncate drops them with their tokens") {
    auto [ec, child] = fork(f.seq);
    REQUIRE_FALSE(ec);
    REQUIRE_FALSE(truncate(f.seq, 2));
    CHECK(f.seq.snapshot().token_ids() == std::vector<token_id>{10, 11});
    CHECK(child.snapshot().token_ids() == std::vector<token_id>{10, 11, no_token_id, 12});
    CHECK(snap.token_ids() == std::vector<token_id>{10, 11, no_token_id, 12});  // an older snapshot keeps its own
  }
  SECTION("an abandoned step's ids go with it") {
    const std::vector<token_id> dropped = {77, 78};
    auto [ec, open] = begin_step(f.seq, std::span<const token_id>(dropped));
    REQUIRE_FALSE(ec);
    REQUIRE_FALSE(abandon(open));
    const step next(layers, f.width, 4, 5);
    REQUIRE_FALSE(append(f.seq, next));
    CHECK(f.seq.snapshot().token_ids() == std::vector<token_id>{10, 11, no_token_id, 12, no_token_id});
  }
  SECTION("ids of another count than the tokens fail with length_mismatch and change nothing") {
    const std::vector<token_id> three = {1, 2, 3};
    const step two(layers, f.width, 4, 5, 2);
    check_rejected(f, kv_errc::length_mismatch, [&] {
      return wait_ec([&](auto token) {
        return f.seq.async_append(std::span<const token_id>(three), two.key_spans, two.value_spans, token);
      });
    });
    CHECK(f.seq.snapshot().token_ids() == std::vector<token_id>{10, 11, no_token_id, 12});
    check_rejected(f, kv_errc::zero_length, [&] { return begin_step(f.seq, std::span<const token_id>()).first; });
  }
}

namespace {

/// Writes layer `l` of every step of `open` in one batched call (step `i`
/// from `tokens[i]`); the first error and every step's result.
std::pair<ghostlink::error_code, std::vector<ghostlink::error_code>> write_batch(
    std::span<const sequence_kv_cache::step_type> open, std::size_t l, std::span<const step* const> tokens) {
  std::vector<std::span<const float>> keys, values;
  for (const step* st : tokens) {
    keys.push_back(st->key_spans[l]);
    values.push_back(st->value_spans[l]);
  }
  auto result = std::make_shared<std::promise<std::pair<ghostlink::error_code, std::vector<ghostlink::error_code>>>>();
  auto done = result->get_future();
  sequence_kv_cache::step_type::async_write_layer(
      open, l, keys, values, [result](ghostlink::error_code ec, std::vector<ghostlink::error_code> each) {
        result->set_value({ec, std::move(each)});
      });
  return done.get();
}

}  // namespace

TEST_CASE("one call writes a layer of a decode batch's steps and completes once, with each sequence's result",
          "[step][batch]") {
  asio::thread_pool threads{2};
  constexpr std::size_t batch = 4;
  std::vector<sequence_kv_cache> seqs;
  for (std::size_t b = 0; b < batch; ++b) seqs.emplace_back(threads, layers, small_config());
  const std::size_t width = seqs[0].config().token_width();
  std::vector<std::unique_ptr<step>> tokens;
  std::vector<const step*> token_ptrs;
  std::vector<sequence_kv_cache::step_type> open;
  for (std::size_t b = 0; b < batch; ++b) {
    tokens.push_back(std::make_unique<step>(layers, width, 0, static_cast<int>(b) + 1));
    token_ptrs.push_back(tokens.back().get());
    auto [ec, s] = begin_step(seqs[b], 1);
    REQUIRE_FALSE(ec);
    open.push_back(std::move(s));
  }
  SECTION("every layer written in one call per layer; each step reads its own write") {
    for (std::size_t l = 0; l < layers; ++l) {
      const auto [ec, each] = write_batch(open, l, token_ptrs);
      CHECK_FALSE(ec);
      CHECK(each == std::vector<ghostlink::error_code>(batch));
      for (std::size_t b = 0; b < batch; ++b) CHECK(open[b].snapshot(l).size() == 1);
    }
    for (std::size_t b = 0; b < batch; ++b) {
      REQUIRE_FALSE(commit(open[b]));
      CHECK(diff_snapshot(seqs[b].snapshot(), {static_cast<int>(b) + 1}).empty());
    }
  }
  SECTION("a step that cannot take the write reports its own error; the others are written") {
    for (std::size_t l = 0; l < layers; ++l) REQUIRE_FALSE(write_layer(open[2], l, *tokens[2]));
    REQUIRE_FALSE(commit(open[2]));  // closed: its batched write fails
    const auto [ec, each] = write_batch(open, 0, token_ptrs);
    CHECK(ec == kv_errc::step_closed);
    REQUIRE(each.size() == batch);
    for (std::size_t b = 0; b < batch; ++b)
      CHECK(each[b] == (b == 2 ? ghostlink::error_code(kv_errc::step_closed) : ghostlink::error_code()));
    for (std::size_t b : {0, 1, 3}) CHECK(open[b].snapshot(0).size() == 1);
  }
  SECTION("keys or values for another number of steps fail with length_mismatch and write nothing") {
    const auto [ec, each] = write_batch(open, 0, std::span(token_ptrs).first(batch - 1));
    CHECK(ec == kv_errc::length_mismatch);
    CHECK(each.empty());
    for (std::size_t b = 0; b < batch; ++b) CHECK(open[b].snapshot(0).size() == 0);
  }
  SECTION("two batches of different layers from two threads at once") {
    std::pair<ghostlink::error_code, std::vector<ghostlink::error_code>> other_result;
    std::thread other([&] { other_result = write_batch(open, 1, token_ptrs); });
    const auto mine = write_batch(open, 0, token_ptrs);
    other.join();
    CHECK_FALSE(mine.first);
    CHECK_FALSE(other_result.first);
    REQUIRE_FALSE(write_batch(open, 2, token_ptrs).first);
    for (std::size_t b = 0; b < batch; ++b) REQUIRE_FALSE(commit(open[b]));
    for (std::size_t b = 0; b < batch; ++b) CHECK(diff_snapshot(seqs[b].snapshot(), {static_cast<int>(b) + 1}).empty());
  }
}

namespace {

/// A step of `tokens` begun on `seq`, whose `io` is run on this thread.
sequence_kv_cache::step_type begun(asio::io_context& io, sequence_kv_cache& seq, std::size_t tokens) {
  std::optional<sequence_kv_cache::step_type> open;
  seq.async_begin_step(tokens, [&](ghostlink::error_code ec, auto s) {
    REQUIRE_FALSE(ec);
    open = std::move(s);
  });
  io.restart();
  io.run();
  REQUIRE(open.has_value());
  return std::move(*open);
}

/// Holds every step write() that reaches the test hook (after it claimed
/// its layer, before it stores the tokens) until released: a write running
/// on another thread, for as long as the test wants.
struct held_writes {
  static inline std::atomic<int> inside{0};
  static inline std::atomic<bool> released{false};
  static void hook() {
    inside.fetch_add(1);
    for (int spin = 0; !released.load() && spin < 200'000'000; ++spin) std::this_thread::yield();
  }
  held_writes() {
    inside = 0;
    released = false;
    ghostlink::detail::set_step_write_hook(&hook);
  }
  ~held_writes() {
    released = true;
    ghostlink::detail::set_step_write_hook(nullptr);
  }
  held_writes(const held_writes&) = delete;
  held_writes& operator=(const held_writes&) = delete;
  /// Waits (bounded) until `n` writes are held.
  static bool wait_for(int n) {
    for (int spin = 0; inside.load() < n && spin < 200'000'000; ++spin) std::this_thread::yield();
    return inside.load() >= n;
  }
};

}  // namespace

TEST_CASE("a commit while a write runs on another thread waits for it, then commits", "[step][concurrency]") {
  asio::io_context io;
  sequence_kv_cache seq(io, layers, small_config());
  const step st(layers, seq.config().token_width(), 0, 6, 2);
  auto open = begun(io, seq, 2);
  for (std::size_t l = 1; l < layers; ++l) REQUIRE_FALSE(open.write(l, st.key_spans[l], st.value_spans[l]));
  ghostlink::error_code written = kv_errc::invalid_config;
  std::optional<ghostlink::error_code> committed;
  {
    held_writes hold;
    std::thread writer([&] { written = open.write(0, st.key_spans[0], st.value_spans[0]); });
    REQUIRE(held_writes::wait_for(1));
    open.async_commit([&](ghostlink::error_code ec) { committed = ec; });
    // While the commit waits, the step's writes, commits and abandons are refused.
    CHECK(open.write(0, st.key_spans[0], st.value_spans[0]) == kv_errc::operation_in_progress);
    std::vector<ghostlink::error_code> refused;
    const auto note = [&](ghostlink::error_code ec) { refused.push_back(ec); };
    open.async_commit(note);
    open.async_abandon(note);
    io.restart();
    io.poll();  // everything ready runs: the commit is not, while the write is held
    CHECK(refused == std::vector<ghostlink::error_code>(2, kv_errc::operation_in_progress));
    CHECK_FALSE(committed.has_value());
    CHECK(seq.size() == 0);
    held_writes::released = true;
    writer.join();
  }
  CHECK_FALSE(written);
  io.restart();
  io.run();
  REQUIRE(committed == ghostlink::error_code());
  CHECK(seq.size() == 2);
  CHECK(diff_snapshot(seq.snapshot(), {6, 6}).empty());
}

TEST_CASE("a step destroyed after some layers were written leaves the sequence as before", "[step]") {
  asio::io_context io;
  sequence_kv_cache seq(io, layers, small_config());
  const std::size_t width = seq.config().token_width();
  const step first(layers, width, 0, 1, 3);
  std::optional<ghostlink::error_code> appended;
  seq.async_append(first.key_spans, first.value_spans, [&](ghostlink::error_code ec) { appended = ec; });
  io.run();
  REQUIRE(appended == ghostlink::error_code());
  const observed before = observe(seq);
  const std::size_t in_use = seq.pool().stats().blocks_in_use;
  const std::size_t written = GENERATE(std::size_t{0}, std::size_t{1}, layers - 1);
  INFO(written << " layers written");
  const step st(layers, width, 3, 7, 2);  // crosses into a second block
  {
    auto open = begun(io, seq, 2);
    for (std::size_t l = 0; l < written; ++l) REQUIRE_FALSE(open.write(l, st.key_spans[l], st.value_spans[l]));
    CHECK(open.snapshot(0).size() == (written > 0 ? 5u : 3u));
  }  // destroyed uncommitted
  io.restart();
  io.run();  // the sequence's actor cuts the step's tokens
  CHECK(observe(seq) == before);
  CHECK(seq.pool().stats().blocks_in_use == in_use);
  for (std::size_t l = 0; l < layers; ++l) CHECK(seq.layer(l).size() == 3);
  // Free for the next operation, which reads back only its own tokens.
  const step next(layers, width, 3, 4);
  appended.reset();
  seq.async_append(next.key_spans, next.value_spans, [&](ghostlink::error_code ec) { appended = ec; });
  io.restart();
  io.run();
  CHECK(appended == ghostlink::error_code());
  CHECK(diff_snapshot(seq.snapshot(), {1, 1, 1, 4}).empty());
}

TEST_CASE("forward passes on two threads start their writes unawaited and await them once, by the commit",
          "[step][concurrency]") {
  asio::thread_pool pool{2};
  std::vector<sequence_kv_cache> seqs;
  for (int i = 0; i < 2; ++i) seqs.emplace_back(pool, layers, small_config());
  const std::size_t width = seqs[0].config().token_width(), steps = 10;
  std::atomic<int> failures{0};
  std::thread drivers[2];
  for (int d = 0; d < 2; ++d)
    drivers[d] = std::thread([&, d] {
      auto& seq = seqs[static_cast<std::size_t>(d)];
      for (std::size_t i = 0; i < steps; ++i) {
        const step st(layers, width, i, 1 + d);
        auto [ec, open] = begin_step(seq, 1);
        if (ec) {
          ++failures;
          return;
        }
        for (std::size_t l = 0; l < layers; ++l)
          open.async_write(l, st.key_spans[l], st.value_spans[l], [&](ghostlink::error_code e) {
            if (e) ++failures;
          });
        if (commit(open)) ++failures;  // st's spans are free once it completes
      }
    });
  for (auto& d : drivers) d.join();
  CHECK(failures == 0);
  for (int d = 0; d < 2; ++d) {
    const auto& seq = seqs[static_cast<std::size_t>(d)];
    CHECK(seq.size() == steps);
    CHECK(diff_snapshot(seq.snapshot(), std::vector<int>(steps, 1 + d)).empty());
  }
}

}  // namespace sequence_step_tests
