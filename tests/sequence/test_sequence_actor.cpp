// One actor per sequence: every operation of a sequence is one request to
// one actor, whatever its number of layers; a sequence snapshot is one
// state of every layer; a step's writes need no actor; a decode batch
// begins and commits with one completion each.

#include "common/sequence_support.hpp"

#include "common/asio_compat.hpp"

#ifdef GHOSTLINK_CATCH2_V3
#include <catch2/generators/catch_generators.hpp>
#endif

#include <atomic>
#include <future>
#include <optional>
#include <thread>

namespace sequence_actor_tests {

using namespace ghostlink;
using namespace ghostlink::test::seq;
using ghostlink::test::small_config;
using ghostlink::test::wait_ec;

namespace {

/// The actor's counters, as every layer of the sequence reports them.
struct counters {
  std::uint64_t applied = 0, drains = 0;
  static counters of(const sequence_kv_cache& seq, std::size_t layer) {
    const kv_cache_stats s = seq.layer(layer).stats();
    return {s.requests_applied, s.drains};
  }
};

/// Handlers an io_context runs for one whole step of a sequence of `n`
/// layers (begin, every layer written, commit), with the requests that
/// step added to the actor's count in `requests`.
std::size_t handlers_of_one_step(std::size_t n, std::uint64_t& requests) {
  asio::io_context io;
  sequence_kv_cache seq(io, n, small_config());
  const std::uint64_t before = counters::of(seq, 0).applied;
  std::optional<sequence_kv_cache::step_type> open;
  seq.async_begin_step(1, [&](ghostlink::error_code ec, sequence_kv_cache::step_type s) {
    CHECK_FALSE(ec);
    open = std::move(s);
  });
  std::size_t handlers = io.run();
  REQUIRE(open.has_value());
  const step st(n, seq.config().token_width(), 0, 1);
  for (std::size_t l = 0; l < n; ++l) REQUIRE_FALSE(open->write(l, st.key_spans[l], st.value_spans[l]));
  std::optional<ghostlink::error_code> committed;
  open->async_commit([&](ghostlink::error_code ec) { committed = ec; });
  io.restart();
  handlers += io.run();
  REQUIRE(committed == ghostlink::error_code());
  requests = counters::of(seq, 0).applied - before;
  return handlers;
}

/// The tag of token `index` of layer `layer` in `r` (width `w`): the first
/// of 1..`max_tag` it matches, or 0.
int tag_of(std::size_t layer, std::size_t index, const kv_range& r, std::size_t w, int max_tag) {
  for (int tag = 1; tag <= max_tag; ++tag)
    if (diff_token<float>(layer, index, tag, std::span(r.keys).subspan(index * w, w),
                          std::span(r.values).subspan(index * w, w))
            .empty())
      return tag;
  return 0;
}

}  // namespace

TEST_CASE("a sequence operation is one request to its actor whatever the number of layers", "[sequence][actor]") {
  const std::size_t n = GENERATE(std::size_t{1}, std::size_t{8}, std::size_t{32}, std::size_t{80});
  INFO(n << " layers");
  asio::thread_pool threads{2};
  sequence_kv_cache seq(threads, n, small_config());
  const std::size_t width = seq.config().token_width();
  const auto one_more = [&](const char* what, auto op) {
    INFO(what);
    const counters before = counters::of(seq, 0);
    REQUIRE_FALSE(op());
    const counters after = counters::of(seq, 0);
    CHECK(after.applied == before.applied + 1);
    CHECK(after.drains == before.drains + 1);
    // Every layer reports the one actor's counters.
    CHECK(counters::of(seq, n - 1).applied == after.applied);
  };
  const step first(n, width, 0, 1), chunk(n, width, 1, 2, 3);
  one_more("an append", [&] { return append(seq, first); });
  one_more("a prefill chunk", [&] { return append(seq, chunk); });
  one_more("a truncate", [&] { return truncate(seq, 2); });
  one_more("a fork", [&] { return fork(seq).first; });
  std::optional<sequence_kv_cache::step_type> open;
  one_more("a step's begin", [&] {
    auto [ec, s] = begin_step(seq, 1);
    open = std::move(s);
    return ec;
  });
  const step st(n, width, 2, 3);
  const counters before_writes = counters::of(seq, 0);
  for (std::size_t l = 0; l < n; ++l) REQUIRE_FALSE(open->write(l, st.key_spans[l], st.value_spans[l]));
  CHECK(counters::of(seq, 0).applied == before_writes.applied);  // the writes needed no actor
  one_more("a step's commit", [&] { return commit(*open); });
  auto [ec, ended] = begin_step(seq, 1);
  REQUIRE_FALSE(ec);
  one_more("a step's end", [&] { return abandon(ended); });
  CHECK(seq.size() == 3);
}

TEST_CASE("a sequence step takes the same requests and handlers at 8, 32 and 80 layers", "[sequence][actor]") {
  std::uint64_t requests_8 = 0, requests_32 = 0, requests_80 = 0;
  const std::size_t handlers_8 = handlers_of_one_step(8, requests_8);
  const std::size_t handlers_32 = handlers_of_one_step(32, requests_32);
  const std::size_t handlers_80 = handlers_of_one_step(80, requests_80);
  INFO("handlers " << handlers_8 << ", " << handlers_32 << ", " << handlers_80 << "; requests " << requests_8 << ", "
                   << requests_32 << ", " << requests_80);
  CHECK(handlers_8 == handlers_32);
  CHECK(handlers_8 == handlers_80);
  CHECK(requests_8 == requests_32);
  CHECK(requests_8 == requests_80);
  CHECK(requests_8 == 2);  // the begin and the commit
}

TEST_CASE("a sequence snapshot is one state of every layer under writers on two threads",
          "[sequence][actor][concurrency]") {
  fixture f;  // 3 layers, 16 tokens of 4-token blocks, actors on 2 threads
  constexpr int rounds = 40;
  std::atomic<bool> done{false};
  shared_mismatches bad;
  std::atomic<std::size_t> looked{0};
  // Readers: every layer of a snapshot shows its size() tokens, and token i
  // is the same write (one tag) in every layer, with that write's id.
  auto reader = [&] {
    while (!done.load(std::memory_order_acquire)) {
      const auto snap = f.seq.snapshot();
      const std::vector<token_id> ids = snap.token_ids();
      std::vector<kv_range> ranges(layers);
      for (std::size_t l = 0; l < layers; ++l) {
        if (snap.layer(l).size() != snap.size())
          bad.add(str("layer ", l, " shows ", snap.layer(l).size(), " of ", snap.size()));
        else if (ghostlink::error_code ec = snap.layer(l).read_range(0, snap.size(), ranges[l]))
          bad.add(str("layer ", l, ": ", ec.message()));
      }
      for (std::size_t i = 0; i < snap.size(); ++i) {
        const int tag = tag_of(0, i, ranges[0], f.width, rounds);
        if (tag == 0) bad.add(str("token ", i, " of layer 0 is no write's"));
        for (std::size_t l = 1; l < layers; ++l)
          if (tag_of(l, i, ranges[l], f.width, rounds) != tag)
            bad.add(str("token ", i, ": layer ", l, " holds another write than layer 0 (tag ", tag, ")"));
        if (ids[i] != static_cast<token_id>(1000 + tag)) bad.add(str("token ", i, " has id ", ids[i], ", tag ", tag));
      }
      looked.fetch_add(1, std::memory_order_relaxed);
    }
  };
  std::thread readers[2] = {std::thread(reader), std::thread(reader)};
  // The writers: truncates and re-appends that rewrite the same positions
  // with new tags, and steps whose layers two threads write at once.
  for (int round = 1; round <= rounds; ++round) {
    const std::size_t keep = static_cast<std::size_t>(round) % 3;
    if (f.seq.size() > keep) REQUIRE_FALSE(truncate(f.seq, keep));
    const token_id id = static_cast<token_id>(1000 + round);
    while (f.seq.size() + 2 <= 12) {
      const std::size_t at = f.seq.size();
      const step st(layers, f.width, at, round, 2);
      const std::vector<token_id> ids(2, id);
      if (round % 2 == 1) {
        REQUIRE_FALSE(wait_ec([&](auto token) {
          return f.seq.async_append(std::span<const token_id>(ids), st.key_spans, st.value_spans, token);
        }));
        continue;
      }
      auto [ec, open] = begin_step(f.seq, std::span<const token_id>(ids));
      REQUIRE_FALSE(ec);
      ghostlink::error_code other_ec;
      std::thread other([&] { other_ec = open.write(1, st.key_spans[1], st.value_spans[1]); });
      const ghostlink::error_code e0 = open.write(0, st.key_spans[0], st.value_spans[0]);
      const ghostlink::error_code e2 = open.write(2, st.key_spans[2], st.value_spans[2]);
      other.join();
      REQUIRE_FALSE(e0);
      REQUIRE_FALSE(e2);
      REQUIRE_FALSE(other_ec);
      REQUIRE_FALSE(commit(open));
    }
  }
  const std::size_t seen = looked.load();
  for (int spin = 0; looked.load() < seen + 2 && spin < 100'000'000; ++spin) std::this_thread::yield();
  done.store(true, std::memory_order_release);
  for (auto& r : readers) r.join();
  INFO(bad.log.first);
  CHECK(bad.log.count == 0);
  CHECK(looked.load() > 0);
}

TEST_CASE("a step's write() errors change nothing, and come before any actor", "[step][actor]") {
  fixture f;
  f.append_ok(1);
  auto [ec, open] = begin_step(f.seq, 2);
  REQUIRE_FALSE(ec);
  const step st(layers, f.width, 1, 5, 2), one(layers, f.width, 1, 5, 1);
  const std::vector<float> longer(st.keys[0].size() + f.width);
  const auto check = [&](kv_errc expected, std::size_t l, std::span<const float> k, std::span<const float> v) {
    const observed before = observe(f.seq);
    const std::size_t shown = open.snapshot(0).size();
    const std::uint64_t applied = counters::of(f.seq, 0).applied;
    const ghostlink::error_code got = open.write(l, k, v);
    INFO("got " << got.message());
    CHECK(got == expected);
    CHECK(observe(f.seq) == before);
    CHECK(open.snapshot(0).size() == shown);
    CHECK(counters::of(f.seq, 0).applied == applied);
  };
  check(kv_errc::layer_mismatch, layers, st.keys[0], st.values[0]);
  check(kv_errc::length_mismatch, 0, st.keys[0], longer);
  check(kv_errc::width_mismatch, 0, one.keys[0], one.values[0]);  // 1 token of 2
  check(kv_errc::width_mismatch, 0, longer, longer);              // 3 tokens of 2
  CHECK(open.snapshot(0).size() == 1);                            // unwritten: the sequence's tokens
  REQUIRE_FALSE(open.write(0, st.key_spans[0], st.value_spans[0]));
  CHECK(open.snapshot(0).size() == 3);
  check(kv_errc::operation_in_progress, 0, st.key_spans[0], st.value_spans[0]);  // written once
  for (std::size_t l = 1; l < layers; ++l) REQUIRE_FALSE(open.write(l, st.key_spans[l], st.value_spans[l]));
  REQUIRE_FALSE(commit(open));
  check(kv_errc::step_closed, 1, st.key_spans[1], st.value_spans[1]);
  f.tags = {1, 5, 5};
  f.check_contents();
}

namespace {

using step_type = sequence_kv_cache::step_type;

/// async_begin_steps(seqs, ids), waited for: its error and its steps.
std::pair<ghostlink::error_code, std::vector<step_type>> begin_steps(std::span<const sequence_kv_cache> seqs,
                                                                     std::span<const std::span<const token_id>> ids) {
  std::promise<std::pair<ghostlink::error_code, std::vector<step_type>>> done;
  sequence_kv_cache::async_begin_steps(seqs, ids, [&](ghostlink::error_code ec, std::vector<step_type> steps) {
    done.set_value({ec, std::move(steps)});
  });
  return done.get_future().get();
}

/// async_commit_all(steps), waited for: its error and each commit's.
std::pair<ghostlink::error_code, std::vector<ghostlink::error_code>> commit_all(std::span<const step_type> steps) {
  std::promise<std::pair<ghostlink::error_code, std::vector<ghostlink::error_code>>> done;
  step_type::async_commit_all(steps, [&](ghostlink::error_code ec, std::vector<ghostlink::error_code> results) {
    done.set_value({ec, std::move(results)});
  });
  return done.get_future().get();
}

}  // namespace

TEST_CASE("a batch's begins and commits complete once, with each sequence's result in order", "[step][actor]") {
  const kv_cache_config config = small_config();  // 4 tokens a block
  // Blocks for two steps of one token: one block in each layer of two sequences.
  const kv_block_pool pool = kv_block_pool::for_caches<float>(config, {.max_blocks = 2 * layers});
  asio::thread_pool threads{2};
  std::vector<sequence_kv_cache> seqs;
  for (int i = 0; i < 3; ++i) seqs.emplace_back(threads, layers, config, pool);
  const std::size_t width = seqs[0].config().token_width();
  // Sequence 1 is busy with a step of its own, which takes half the pool.
  auto [busy_ec, busy] = begin_step(seqs[1], 1);
  REQUIRE_FALSE(busy_ec);
  const observed before_2 = observe(seqs[2]);

  SECTION("ids of another number than the sequences: length_mismatch, and no begin") {
    const std::vector<token_id> id = {7};
    const std::vector<std::span<const token_id>> ids = {id, id};
    auto [ec, steps] = begin_steps(seqs, ids);
    CHECK(ec == kv_errc::length_mismatch);
    CHECK(steps.empty());
    CHECK(pool.stats().blocks_in_use == layers);
  }
  SECTION("sequence 0 begins, 1 is busy, 2 finds the pool spent") {
    const std::vector<token_id> id0 = {7}, id1 = {8}, id2 = {9};
    const std::vector<std::span<const token_id>> ids = {id0, id1, id2};
    auto [ec, steps] = begin_steps(seqs, ids);
    CHECK(ec == kv_errc::operation_in_progress);  // the first failure in order
    REQUIRE(steps.size() == 3);
    CHECK(steps[0].valid());
    CHECK_FALSE(steps[1].valid());
    CHECK_FALSE(steps[2].valid());
    CHECK(observe(seqs[2]) == before_2);  // capacity_exhausted changed nothing
    CHECK(begin_step(seqs[2], 1).first == kv_errc::capacity_exhausted);

    // Commits: sequence 0's written step, sequence 1's unwritten one, an empty handle.
    const step st(layers, width, 0, 4);
    for (std::size_t l = 0; l < layers; ++l) REQUIRE_FALSE(steps[0].write(l, st.key_spans[l], st.value_spans[l]));
    std::vector<step_type> batch;
    batch.push_back(std::move(steps[0]));
    batch.push_back(std::move(busy));
    batch.emplace_back();
    auto [cec, results] = commit_all(batch);
    CHECK(cec == kv_errc::step_incomplete);
    CHECK(results == std::vector<ghostlink::error_code>{{}, kv_errc::step_incomplete, kv_errc::step_closed});
    CHECK(seqs[0].size() == 1);
    CHECK(seqs[0].snapshot().token_ids() == std::vector<token_id>{7});
    CHECK(diff_snapshot(seqs[0].snapshot(), {4}).empty());
    CHECK(seqs[1].size() == 0);
    CHECK(batch[1].valid());  // still open: written, it commits
    for (std::size_t l = 0; l < layers; ++l) REQUIRE_FALSE(batch[1].write(l, st.key_spans[l], st.value_spans[l]));
    CHECK_FALSE(commit(batch[1]));
    CHECK(diff_snapshot(seqs[1].snapshot(), {4}).empty());
  }
}

}  // namespace sequence_actor_tests
