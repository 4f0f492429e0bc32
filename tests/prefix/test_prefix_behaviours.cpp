// The prefix cache against the behaviours that vLLM's automatic prefix
// caching (tests/v1/core/test_prefix_caching.py) and SGLang's radix cache
// (test/srt/test_radix_cache_unit.py) test, as far as they apply to
// ghostlink: full blocks only, at prefill and through decode; eviction
// order; what is in use stays; salts; events; partial matches; pinning; and
// the pool's accounting, back to zero blocks in use at the end of each test.

#include "common/prefix_support.hpp"

#include <array>
#include <atomic>
#include <latch>
#include <mutex>
#include <set>
#include <thread>

namespace prefix_behaviours_tests {

using namespace ghostlink;
using namespace ghostlink::test::prefix;

namespace {

constexpr std::size_t bt = 4;  // config().block_tokens

/// What a cache-aware router keeps from the events alone: the cached
/// hashes, each event checked against what came before it (the shared
/// event_mirror keeps entries, unchecked).
struct checked_mirror {
  std::set<kv_block_hash> hashes;
  std::string error;  // the first event that did not fit what came before
  void apply(const kv_prefix_event& e) {
    switch (e.what) {
      case kv_prefix_event::kind::stored:
        if (e.parent && !hashes.contains(*e.parent) && error.empty()) error = str("stored ", e.sequence, ": no parent");
        if (!hashes.insert(e.hash).second && error.empty()) error = str("stored ", e.sequence, " twice");
        break;
      case kv_prefix_event::kind::removed:
        if (hashes.erase(e.hash) == 0 && error.empty()) error = str("removed ", e.sequence, ": not stored");
        break;
      case kv_prefix_event::kind::cleared: hashes.clear(); break;
    }
  }
};

/// An empty sequence on the fixture's pool.
sequence_kv_cache empty_sequence(fixture<>& f) {
  return sequence_kv_cache(f.threads, f.cache.num_layers(), config(), f.pool);
}

/// `t` with token `i` replaced by `id`.
std::vector<token_id> with(std::vector<token_id> t, std::size_t i, token_id id) {
  t[i] = id;
  return t;
}

/// The end of every test: every sequence let go (truncated to 0 or out of
/// scope), the entries dropped, the pool has no block in use.
void expect_balanced(fixture<>& f) {
  f.cache.clear();
  f.threads.join();  // a destroyed sequence's actors may still be letting go of its blocks
  CHECK(f.cache.stats().cached_blocks == 0);
  CHECK(f.pool.stats().blocks_cached == 0);
  CHECK(f.pool.stats().blocks_reserved == 0);
  CHECK(f.pool.stats().blocks_in_use == 0);
}

}  // namespace

TEST_CASE("cached_entries counts entries, as cached_blocks does, while the pool counts blocks of every layer",
          "[prefix][behaviour]") {
  fixture f;
  const auto t = run(1, 15);  // 3 full blocks and 3 tokens
  {
    auto seq = f.prefill(t);
    REQUIRE(f.cache.insert(seq, t) == 3);
    const kv_prefix_stats s = f.cache.stats();
    CHECK(s.cached_entries == 3);
    CHECK(s.cached_blocks == s.cached_entries);
    CHECK(f.pool.stats().blocks_cached == s.cached_entries * f.cache.num_layers());
  }
  f.cache.clear();
  CHECK(f.cache.stats().cached_entries == 0);
  CHECK(f.cache.stats().cached_blocks == 0);
}

TEST_CASE("a pool's stats() and blocks_available() may be read from handlers that an eviction calls",
          "[prefix][behaviour]") {
  // Evictions run under the pool's reclaimer lock; the pool's readings do
  // not take it, so a handler called inside one (a block freed, an entry
  // removed) can read them without deadlocking.
  fixture f(8);  // 2 layers: 4 entries fill the budget
  REQUIRE(f.insert_idle(run(1, 4 * bt)) == 4);
  REQUIRE(f.pool.stats().blocks_available == 8);
  std::atomic<std::size_t> freed_reads{0}, removed_reads{0}, wrong{0};
  // Each reading is read separately (exact when the pool is idle): inside an
  // eviction only what never passes the budget is checked.
  f.pool.set_event_handler([&](const kv_event& e) {
    if (e.what != kv_event::kind::block_freed) return;
    const kv_pool_stats s = f.pool.stats();
    (void)f.pool.blocks_available();
    if (s.blocks_cached > 8 || s.blocks_in_use > 8) ++wrong;
    ++freed_reads;
  });
  f.cache.set_event_handler([&](const kv_prefix_event& e) {
    if (e.what != kv_prefix_event::kind::removed) return;
    if (f.pool.stats().blocks_in_use > 8) ++wrong;
    ++removed_reads;
  });
  {
    auto seq = f.prefill(run(100, 2 * bt));  // 4 blocks: two entries go
    CHECK(seq.size() == 2 * bt);
  }
  CHECK(removed_reads.load() >= 2);
  CHECK(freed_reads.load() >= 4);
  CHECK(wrong.load() == 0);
  f.pool.set_event_handler({});
  f.cache.set_event_handler({});
  expect_balanced(f);
}

// vLLM: test_prefill
TEST_CASE("only full blocks are hashed at prefill: the partial tail block is never cached", "[prefix][behaviour]") {
  fixture f;
  const auto t = run(1, 15);  // 3 full blocks and 3 tokens
  {
    auto seq = f.prefill(t);
    REQUIRE(f.pool.stats().blocks_in_use == 4 * f.cache.num_layers());
    CHECK(f.cache.block_hashes(t).size() == 3);
    CHECK(f.cache.insert(seq, t) == 3);
    CHECK(f.cache.insert_stored_tokens(seq) == 0);  // the same 3, and still no 4th
    CHECK(f.cache.stats().cached_blocks == 3);
    CHECK(f.pool.stats().blocks_cached == 3 * f.cache.num_layers());  // not the 4th block of any layer
    CHECK(f.cache.match(t) == 12);
    auto attached = f.cache.attach(f.threads, t);
    CHECK(attached.size() == 12);
    CHECK(diff(attached, std::span(t).first(12)) == "");
    REQUIRE(truncate(attached, 0) == ghostlink::error_code());
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  }
  // The partial block went back to the pool with its sequence; the full ones stay, idle.
  CHECK(f.pool.stats().blocks_in_use == 3 * f.cache.num_layers());
  CHECK(f.pool.stats().blocks_cached_idle == 3 * f.cache.num_layers());
  CHECK(f.cache.stats().idle_blocks == 3);
  expect_balanced(f);
}

// vLLM: test_decode, test_cache_blocks
TEST_CASE("decode: a sequence growing token by token adds each block once it is full, never a partial one",
          "[prefix][behaviour]") {
  fixture f;
  std::vector<token_id> tokens = run(1, 6);  // prompt: 1 full block and 2 tokens
  {
    auto seq = f.prefill(tokens);
    REQUIRE(f.cache.insert(seq, tokens) == 1);
    event_log log;
    f.cache.set_event_handler(log.handler());
    // Decode: one token per step, inserting after every step as an engine would.
    std::vector<std::size_t> added, expected, matched, expected_match;
    for (token_id step = 0; step < 14; ++step) {
      const token_id next = 200 + step;
      REQUIRE(append(seq, std::span(&next, 1)) == ghostlink::error_code());
      tokens.push_back(next);
      added.push_back(f.cache.insert(seq, tokens));
      expected.push_back(tokens.size() % bt == 0 ? 1 : 0);
      matched.push_back(f.cache.match(tokens));
      expected_match.push_back(tokens.size() / bt * bt);
    }
    CHECK(added == expected);
    CHECK(matched == expected_match);
    CHECK(tokens.size() == 20);
    CHECK(f.cache.stats().cached_blocks == 5);
    // One stored event per block filled, in order, each naming its parent.
    const auto h = f.cache.block_hashes(tokens);
    REQUIRE(log.events.size() == 4);
    for (std::size_t i = 0; i < 4; ++i) {
      CHECK(log.events[i].what == kv_prefix_event::kind::stored);
      CHECK(log.events[i].hash == h[i + 1]);
      CHECK(log.events[i].parent == h[i]);
    }
    // A multi-token step filling one block and starting the next: one entry.
    const auto burst = run(300, 7);
    REQUIRE(append(seq, burst) == ghostlink::error_code());
    tokens = cat(tokens, burst);  // 27 tokens: 6 full blocks
    CHECK(f.cache.insert(seq, tokens) == 1);
    CHECK(f.cache.stats().cached_blocks == 6);
    CHECK(f.cache.match(tokens) == 24);
    CHECK(diff(seq, tokens) == "");
    f.cache.set_event_handler({});
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  }
  CHECK(f.pool.stats().blocks_in_use == 6 * f.cache.num_layers());  // the cached blocks, not the partial one
  {
    // The same from the ids the sequence stores (the engine passes no tokens).
    auto seq = f.prefill(run(1, 3));
    std::vector<std::size_t> added, expected;
    for (token_id step = 0; step < 9; ++step) {
      const token_id next = 400 + step;
      REQUIRE(append(seq, std::span(&next, 1)) == ghostlink::error_code());
      added.push_back(f.cache.insert_stored_tokens(seq, "ids"));
      expected.push_back(seq.size() % bt == 0 ? 1 : 0);
    }
    CHECK(added == expected);
    CHECK(f.cache.match(seq.snapshot().token_ids(), "ids") == 12);
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  }
  CHECK(f.cache.stats().cached_blocks == 6 + 3);
  expect_balanced(f);
}

// vLLM: test_prefill
TEST_CASE("a hit on the common prefix while its first request runs and after it is gone; a miss then evicts it",
          "[prefix][behaviour]") {
  fixture f(10);  // 2 layers: 5 blocks a layer
  const auto common = run(1, 12);  // 3 full blocks
  const auto h = f.cache.block_hashes(common);
  const auto t0 = cat(common, run(50, 3)), t1 = cat(common, run(60, 1)), t2 = cat(common, run(70, 2));
  {
    auto req0 = f.prefill(t0);
    REQUIRE(f.cache.insert(req0, t0) == 3);
    // Hit while req0 still holds the blocks: shared, nothing allocated.
    auto req1 = f.cache.attach(f.threads, t1);
    CHECK(req1.size() == 12);
    CHECK(f.pool.stats().blocks_in_use == 8);
    REQUIRE(append(req1, std::span(t1).subspan(12)) == ghostlink::error_code());
    CHECK(diff(req1, t1) == "");
    CHECK(f.pool.stats().blocks_in_use == 10);  // one new block a layer for the last token
    CHECK(f.pool.blocks_available() == 0);
    CHECK(f.cache.stats().hit_tokens == 12);
    REQUIRE(truncate(req0, 0) == ghostlink::error_code());
    REQUIRE(truncate(req1, 0) == ghostlink::error_code());
  }
  // Both gone: the common blocks stay, idle; the partial ones are free.
  CHECK(f.pool.stats().blocks_in_use == 6);
  CHECK(f.cache.stats().idle_blocks == 3);
  CHECK(f.pool.blocks_available() == 10);
  {
    auto req2 = f.cache.attach(f.threads, t2);  // hit after the first request is gone
    CHECK(req2.size() == 12);
    REQUIRE(append(req2, std::span(t2).subspan(12)) == ghostlink::error_code());
    CHECK(diff(req2, t2) == "");
    REQUIRE(truncate(req2, 0) == ghostlink::error_code());
  }
  event_log log;
  f.cache.set_event_handler(log.handler());
  {
    // A miss that needs the whole pool: every entry goes, the tail first.
    const auto t3 = run(500, 20);
    auto req3 = f.prefill(t3);
    CHECK(diff(req3, t3) == "");
    REQUIRE(log.events.size() == 3);
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK(log.events[i].what == kv_prefix_event::kind::removed);
      CHECK(log.events[i].hash == h[2 - i]);
    }
    CHECK(f.cache.stats().cached_blocks == 0);
    CHECK(f.pool.stats().blocks_in_use == 10);
    CHECK(f.cache.match(t0) == 0);
    REQUIRE(truncate(req3, 0) == ghostlink::error_code());
  }
  f.cache.set_event_handler({});
  expect_balanced(f);
}

// vLLM: test_evict
TEST_CASE("eviction order: least recently used first, a request's blocks tail first, touched blocks last",
          "[prefix][behaviour]") {
  fixture f(16);  // 2 layers: 8 entries
  const auto a = run(1, 22);   // 5 full blocks and 2 tokens
  const auto b = run(100, 12); // 3 full blocks
  const auto ha = f.cache.block_hashes(a), hb = f.cache.block_hashes(b);
  REQUIRE(f.insert_idle(a) == 5);
  REQUIRE(f.insert_idle(b) == 3);
  REQUIRE(f.pool.stats().blocks_in_use == 16);
  event_log log;
  f.cache.set_event_handler(log.handler());
  {
    // Touch a's first 2 blocks: attach them and write one more block, which
    // evicts the least recently used entry, a's tail.
    const auto touch = std::vector(a.begin(), a.begin() + 11);
    auto req = f.cache.attach(f.threads, touch);
    REQUIRE(req.size() == 8);
    REQUIRE(append(req, std::span(touch).subspan(8)) == ghostlink::error_code());
    REQUIRE(log.size() == 1);
    CHECK(log.events[0].hash == ha[4]);
    REQUIRE(truncate(req, 0) == ghostlink::error_code());  // its partial block is free again
  }
  CHECK(f.pool.stats().blocks_in_use == 14);
  {
    auto filler = empty_sequence(f);
    // The free blocks go first, then one entry per block a layer.
    REQUIRE(append(filler, run(1000, 4)) == ghostlink::error_code());
    CHECK(log.size() == 1);
    std::vector<kv_block_hash> order;
    for (token_id i = 1; i < 8; ++i) {
      REQUIRE(append(filler, run(1000 + 4 * i, 4)) == ghostlink::error_code());
      REQUIRE(log.size() == 1 + static_cast<std::size_t>(i));
      order.push_back(log.events.back().hash);
    }
    // a's rest tail first, then b (older than a's touched blocks), tail first, then a's touched blocks.
    CHECK(order == std::vector<kv_block_hash>{ha[3], ha[2], hb[2], hb[1], hb[0], ha[1], ha[0]});
    for (const kv_prefix_event& e : log.events) CHECK(e.what == kv_prefix_event::kind::removed);
    CHECK(f.cache.stats().evicted_blocks == 8);
    CHECK(f.cache.stats().cached_blocks == 0);
    REQUIRE(truncate(filler, 0) == ghostlink::error_code());
  }
  f.cache.set_event_handler({});
  expect_balanced(f);
}

// vLLM: test_computed_blocks_not_evicted
TEST_CASE("a request's cache hit is not evicted for its own next block, though least recently used",
          "[prefix][behaviour]") {
  fixture f(4);  // 2 layers: 2 entries
  const auto a = run(1, 4), b = run(100, 4);
  f.insert_idle(a);  // a is the least recently used
  f.insert_idle(b);
  {
    const auto t = cat(a, run(200, 4));
    auto req = f.cache.attach(f.threads, t);
    REQUIRE(req.size() == 4);
    REQUIRE(append(req, std::span(t).subspan(4)) == ghostlink::error_code());  // needs a block a layer: b goes
    CHECK(diff(req, t) == "");
    CHECK(f.cache.match(a) == 4);
    CHECK(f.cache.match(b) == 0);
    CHECK(f.cache.stats().evicted_blocks == 1);
    REQUIRE(truncate(req, 0) == ghostlink::error_code());
  }
  CHECK(f.pool.stats().blocks_in_use == 2);
  expect_balanced(f);
}

// vLLM: test_prefill_not_enough_free_blocks_with_computed_blocks
TEST_CASE("a request that cannot get its blocks leaves its cache hit untouched", "[prefix][behaviour]") {
  fixture f(12);  // 2 layers: 6 entries
  const auto p = run(1, 24);  // 6 full blocks
  REQUIRE(f.insert_idle(p) == 6);
  {
    auto other = f.prefill(run(500, 8));  // 2 blocks a layer: evicts p's last two
    REQUIRE(f.cache.match(p) == 16);
    const auto t = run(1, 28);  // p's first 4 blocks cached, 3 blocks more to compute
    auto req = f.cache.attach(f.threads, t);
    REQUIRE(req.size() == 16);
    CHECK(f.pool.blocks_available() == 0);  // every entry is in use now
    // Admission control: the 6 blocks cannot be had; nothing evicted, nothing reserved.
    ghostlink::error_code ec;
    kv_block_reservation r = f.pool.reserve(6, ec);
    CHECK(ec == kv_errc::capacity_exhausted);
    CHECK(r.empty());
    // Written without one, the append fails and stores nothing.
    CHECK(append(req, std::span(t).subspan(16)) == kv_errc::capacity_exhausted);
    CHECK(req.size() == 16);
    CHECK(diff(req, std::span(t).first(16)) == "");
    CHECK(f.cache.stats().evicted_blocks == 2);
    CHECK(f.cache.match(t) == 16);
    REQUIRE(truncate(req, 0) == ghostlink::error_code());
    // Let go of, the hit is idle again, as before the attach.
    CHECK(f.cache.stats().idle_blocks == 4);
    CHECK(f.pool.blocks_available() == 8);
    REQUIRE(truncate(other, 0) == ghostlink::error_code());
  }
  CHECK(f.pool.stats().blocks_in_use == 8);
  expect_balanced(f);
}

// vLLM: test_hash_block_correct_reuse
TEST_CASE("an evicted block reused for a partial block carries no stale entry", "[prefix][behaviour]") {
  fixture f(2);  // 2 layers: 1 entry
  const auto a = run(1, 4);
  REQUIRE(f.insert_idle(a) == 1);
  {
    const auto t = run(100, 4);
    auto seq = f.prefill(std::span(t).first(3));  // takes a's blocks
    CHECK(f.cache.stats().evicted_blocks == 1);
    CHECK(f.cache.match(a) == 0);
    CHECK(f.cache.insert(seq, t) == 0);  // 3 tokens: no full block
    CHECK(f.cache.stats().cached_blocks == 0);
    CHECK(f.pool.stats().blocks_cached == 0);
    CHECK(diff(seq, std::span(t).first(3)) == "");
    REQUIRE(append(seq, std::span(t).subspan(3)) == ghostlink::error_code());
    CHECK(f.cache.insert(seq, t) == 1);  // full now, under its own tokens' hash
    CHECK(f.cache.match(t) == 4);
    CHECK(f.cache.match(a) == 0);
    CHECK(diff(seq, t) == "");
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  }
  expect_balanced(f);
}

// vLLM: test_cache_key_salting
TEST_CASE("salting: the same salt shares, another salt or none never does, at prefill and through decode",
          "[prefix][behaviour]") {
  fixture f;
  const auto common = run(1, 12);
  auto t0 = cat(common, run(40, 3));  // 3 full blocks and 3 tokens
  // Every block's hash depends on the salt, not only block 0's.
  const auto h1 = f.cache.block_hashes(t0, "salt1"), h2 = f.cache.block_hashes(t0, "salt2"),
             h0 = f.cache.block_hashes(t0);
  REQUIRE(h1.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(h1[i] != h2[i]);
    CHECK(h1[i] != h0[i]);
    CHECK(h2[i] != h0[i]);
  }
  {
    auto req0 = f.prefill(t0);
    REQUIRE(f.cache.insert(req0, t0, "salt1") == 3);
    // Decode fills block 3, cached under the request's salt.
    const token_id next = 8;
    REQUIRE(append(req0, std::span(&next, 1)) == ghostlink::error_code());
    t0.push_back(next);
    CHECK(f.cache.insert(req0, t0, "salt1") == 1);
    CHECK(f.cache.match(t0, "salt1") == 16);
    CHECK(f.cache.match(t0, "salt2") == 0);
    CHECK(f.cache.match(t0) == 0);

    // The same salt: shares the common blocks.
    const auto t1 = cat(common, run(60, 11));
    auto same = f.cache.attach(f.threads, t1, "salt1");
    CHECK(same.size() == 12);
    CHECK(diff(same, common) == "");
    // Another salt: a miss; computed again, cached apart, not mixed with salt1's.
    auto other = f.cache.attach(f.threads, t1, "salt2");
    CHECK(other.size() == 0);
    REQUIRE(append(other, t1) == ghostlink::error_code());
    CHECK(f.cache.insert(other, t1, "salt2") == 5);
    CHECK(f.cache.match(t1, "salt2") == 20);
    CHECK(f.cache.match(t1, "salt1") == 12);
    CHECK(f.cache.match(t1) == 0);
    CHECK(f.cache.match(t1, "salt3") == 0);
    CHECK(f.cache.stats().cached_blocks == 4 + 5);
    for (auto* s : {&req0, &same, &other}) REQUIRE(truncate(*s, 0) == ghostlink::error_code());
  }
  expect_balanced(f);
}

// vLLM: test_kv_cache_events
TEST_CASE("events: stored with parents in block order, removed tail first; a mirror of them is the cached set",
          "[prefix][behaviour]") {
  fixture f(6);  // 2 layers: 3 entries
  event_log log;
  f.cache.set_event_handler(log.handler());
  const auto p = run(1, 12), q = run(100, 12);
  const auto hp = f.cache.block_hashes(p), hq = f.cache.block_hashes(q);
  REQUIRE(f.insert_idle(p) == 3);
  {
    auto seq = f.prefill(q);  // the whole pool: p's entries go, its tail first
    REQUIRE(f.cache.insert(seq, q) == 3);
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  }
  f.cache.clear();
  REQUIRE(log.events.size() == 10);
  using kind = kv_prefix_event::kind;
  const std::vector<std::pair<kind, kv_block_hash>> expected = {
      {kind::stored, hp[0]},  {kind::stored, hp[1]},  {kind::stored, hp[2]}, {kind::removed, hp[2]},
      {kind::removed, hp[1]}, {kind::removed, hp[0]}, {kind::stored, hq[0]}, {kind::stored, hq[1]},
      {kind::stored, hq[2]},  {kind::cleared, {}}};
  checked_mirror mirror;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    INFO("event " << i);
    const kv_prefix_event& e = log.events[i];
    CHECK(e.sequence == i + 1);
    CHECK(e.what == expected[i].first);
    CHECK(e.hash == expected[i].second);
    if (e.what == kind::stored) {
      const auto& h = i < 3 ? hp : hq;
      const std::size_t b = i < 3 ? i : i - 6;
      if (b == 0)
        CHECK_FALSE(e.parent.has_value());
      else
        CHECK(e.parent == h[b - 1]);
    } else {
      CHECK_FALSE(e.parent.has_value());
    }
    mirror.apply(e);
    // Before the clear, the mirror holds what the cache holds.
    if (i == 8) {
      CHECK(mirror.hashes == std::set<kv_block_hash>(hq.begin(), hq.end()));
      CHECK(mirror.hashes.size() == 3);
    }
  }
  CHECK(mirror.error == "");
  CHECK(mirror.hashes.empty());
  CHECK(f.cache.stats().cached_blocks == 0);
  f.cache.set_event_handler({});
  expect_balanced(f);
}

// vLLM: test_null_parent_block_hash
TEST_CASE("events: an insert continuing a cached prefix names the last cached block as its first parent",
          "[prefix][behaviour]") {
  fixture f;
  const auto t = run(1, 16);
  const auto h = f.cache.block_hashes(t);
  {
    auto seq = f.prefill(t);
    REQUIRE(f.cache.insert(seq, std::span(t).first(8)) == 2);
    event_log log;
    f.cache.set_event_handler(log.handler());
    // Another request attached to the 2 cached blocks computes and inserts the rest.
    auto req = f.cache.attach(f.threads, t);
    REQUIRE(req.size() == 8);
    REQUIRE(append(req, std::span(t).subspan(8)) == ghostlink::error_code());
    CHECK(f.cache.insert(req, t) == 2);
    REQUIRE(log.events.size() == 2);
    CHECK(log.events[0].hash == h[2]);
    REQUIRE(log.events[0].parent.has_value());
    CHECK(*log.events[0].parent == h[1]);
    CHECK(log.events[1].hash == h[3]);
    CHECK(log.events[1].parent == h[2]);
    CHECK(f.cache.insert(seq, t) == 0);  // the first request's own blocks 2, 3: cached already
    CHECK(log.events.size() == 2);
    f.cache.set_event_handler({});
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
    REQUIRE(truncate(req, 0) == ghostlink::error_code());
  }
  expect_balanced(f);
}

// vLLM: test_masked_block_does_not_emit_empty_stored_event, test_emit_cached_block_events
TEST_CASE("events: an insert with no new full block, a match or an attach emits nothing", "[prefix][behaviour]") {
  fixture f;
  event_log log;
  f.cache.set_event_handler(log.handler());
  const auto t = run(1, 8);
  {
    auto partial = f.prefill(run(1, 3));
    CHECK(f.cache.insert(partial, t) == 0);
    CHECK(f.cache.attach(f.threads, t).size() == 0);
    CHECK(log.size() == 0);
    REQUIRE(truncate(partial, 0) == ghostlink::error_code());
  }
  REQUIRE(f.insert_idle(t) == 2);
  CHECK(log.size() == 2);
  {
    CHECK(f.cache.match(t) == 8);
    auto attached = f.cache.attach(f.threads, t);  // a reuse is not a store
    REQUIRE(attached.size() == 8);
    CHECK(f.cache.insert(attached, t) == 0);
    CHECK(log.size() == 2);
    REQUIRE(truncate(attached, 0) == ghostlink::error_code());
  }
  CHECK(log.size() == 2);
  f.cache.set_event_handler({});
  expect_balanced(f);
}

// vLLM: test_reset_prefix_cache; SGLang: test_reset
TEST_CASE("clear while a request uses cached blocks: it keeps reading them, and they return when it lets go",
          "[prefix][behaviour]") {
  fixture f;
  const auto t = run(1, 8);
  REQUIRE(f.insert_idle(t) == 2);
  {
    auto req = f.cache.attach(f.threads, t);
    REQUIRE(req.size() == 8);
    const auto snap = req.snapshot();
    f.cache.clear();
    const kv_prefix_stats s = f.cache.stats();
    CHECK(s.cached_blocks == 0);
    CHECK(s.idle_blocks == 0);
    CHECK(s.evicted_blocks == 0);
    CHECK(f.pool.stats().blocks_cached == 0);
    CHECK(f.pool.stats().blocks_cached_idle == 0);
    CHECK(f.pool.stats().blocks_in_use == 4);  // the request's
    CHECK(f.cache.match(t) == 0);
    CHECK(diff(req, t) == "");
    CHECK(snap.size() == 8);
    // The request goes on, and its blocks may be cached again, not copied.
    const auto more = run(50, 2);
    REQUIRE(append(req, more) == ghostlink::error_code());
    CHECK(diff(req, cat(t, more)) == "");
    CHECK(f.cache.insert(req, cat(t, more)) == 2);
    CHECK(f.pool.stats().blocks_in_use == 6);
    f.cache.clear();
    REQUIRE(truncate(req, 0) == ghostlink::error_code());
  }
  // Cleared before the request let go: nothing stays behind.
  CHECK(f.pool.stats().blocks_in_use == 0);
  expect_balanced(f);
}

// vLLM: test_maybe_evict_cached_block
TEST_CASE("a prefix computed twice is cached once: the duplicate's blocks return to the pool", "[prefix][behaviour]") {
  fixture f;
  const auto t = run(1, 8);
  {
    auto a = f.prefill(t);
    auto b = f.prefill(t);  // computed again, not attached
    CHECK(f.cache.insert(a, t) == 2);
    CHECK(f.cache.insert(b, t) == 0);
    CHECK(f.cache.stats().cached_blocks == 2);
    CHECK(f.pool.stats().blocks_in_use == 8);
    CHECK(f.pool.stats().blocks_cached == 4);  // a's only
    REQUIRE(truncate(b, 0) == ghostlink::error_code());
    CHECK(f.pool.stats().blocks_in_use == 4);
    REQUIRE(truncate(a, 0) == ghostlink::error_code());
    CHECK(f.pool.stats().blocks_in_use == 4);
    CHECK(f.cache.stats().idle_blocks == 2);
    auto attached = f.cache.attach(f.threads, t);
    CHECK(diff(attached, t) == "");
    REQUIRE(truncate(attached, 0) == ghostlink::error_code());
  }
  expect_balanced(f);
}

// SGLang: test_insert_and_match_basic, test_page_alignment_boundary
TEST_CASE("partial match: a prompt sharing only the first blocks matches and attaches those, block-aligned",
          "[prefix][behaviour]") {
  fixture f;
  const auto t = run(1, 14);  // 3 full blocks and 2 tokens
  REQUIRE(f.insert_idle(t) == 3);
  std::string wrong;
  for (std::size_t n = 0; n <= t.size(); ++n) {
    const std::size_t m = f.cache.match(std::span(t).first(n));
    if (m != std::min(n / bt, std::size_t{3}) * bt && wrong.empty()) wrong = str(n, " tokens match ", m);
  }
  CHECK(wrong == "");
  CHECK(f.cache.match(with(t, 9, 999)) == 8);  // diverges in block 2
  CHECK(f.cache.match(with(t, 4, 999)) == 4);  // in block 1
  CHECK(f.cache.match(with(t, 0, 999)) == 0);  // in block 0
  CHECK(f.cache.match(cat(t, run(90, 8))) == 12);
  // A block-aligned prompt that is all cached: an engine that needs the
  // last token's logits asks for one token less and recomputes the last block.
  CHECK(f.cache.match(std::span(t).first(11)) == 8);
  {
    const auto u = with(t, 9, 999);
    auto req = f.cache.attach(f.threads, u);
    REQUIRE(req.size() == 8);
    REQUIRE(append(req, std::span(u).subspan(8)) == ghostlink::error_code());
    CHECK(diff(req, u) == "");
    CHECK(f.cache.insert(req, u) == 1);  // its own block 2, a sibling of t's
    CHECK(f.cache.match(u) == 12);
    auto again = f.cache.attach(f.threads, t);  // t's block 2 is t's still
    CHECK(diff(again, std::span(t).first(12)) == "");
    REQUIRE(truncate(req, 0) == ghostlink::error_code());
    REQUIRE(truncate(again, 0) == ghostlink::error_code());
  }
  CHECK(f.cache.stats().cached_blocks == 4);
  expect_balanced(f);
}

// SGLang: test_total_size
TEST_CASE("a shared prefix is stored once: the entries are the distinct blocks of the prefix tree",
          "[prefix][behaviour]") {
  fixture f;
  const auto p = run(1, 8), x = cat(p, run(100, 4)), y = cat(p, run(200, 4)), z = run(300, 8);
  {
    auto a = f.prefill(x);
    auto b = f.prefill(y);
    CHECK(f.cache.insert(a, x) == 3);
    CHECK(f.cache.insert(b, y) == 1);  // p's 2 blocks are a's
    CHECK(f.cache.stats().cached_blocks == 4);
    CHECK(f.cache.stats().inserted_blocks == 4);
    REQUIRE(truncate(a, 0) == ghostlink::error_code());
    REQUIRE(truncate(b, 0) == ghostlink::error_code());
  }
  CHECK(f.pool.stats().blocks_in_use == 4 * f.cache.num_layers());
  CHECK(f.cache.match(x) == 12);
  CHECK(f.cache.match(y) == 12);
  REQUIRE(f.insert_idle(z) == 2);
  CHECK(f.cache.stats().cached_blocks == 6);
  CHECK(f.pool.stats().blocks_cached == 6 * f.cache.num_layers());
  expect_balanced(f);
}

// SGLang: test_extra_key_isolation
TEST_CASE("isolation by salt: the same tokens under three salts keep three tenants' KV apart", "[prefix][behaviour]") {
  fixture f;
  const auto t = run(1, 8);
  const std::array<std::pair<std::string_view, float>, 3> tenants = {{{"key1", 1.0f}, {"key2", 2.0f}, {"", 3.0f}}};
  for (const auto& [salt, tag] : tenants) {
    auto seq = empty_sequence(f);
    REQUIRE(append(seq, t, tag) == ghostlink::error_code());
    CHECK(f.cache.insert(seq, t, salt) == 2);
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  }
  CHECK(f.cache.stats().cached_blocks == 6);
  for (const auto& [salt, tag] : tenants) {
    INFO("salt \"" << salt << "\"");
    auto seq = f.cache.attach(f.threads, t, salt);
    CHECK(diff(seq, t, tag) == "");
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  }
  CHECK(f.cache.attach(f.threads, t, "nonexistent").size() == 0);
  CHECK(f.cache.match(t, "key3") == 0);
  expect_balanced(f);
}

// SGLang: test_lock_ref_operations
TEST_CASE("pinning: attaching takes entries out of the evictable ones, letting go puts them back, block for block",
          "[prefix][behaviour]") {
  fixture f(100);
  const auto t = run(1, 12);
  REQUIRE(f.insert_idle(t) == 3);
  const std::size_t layers = f.cache.num_layers();
  CHECK(f.cache.stats().idle_blocks == 3);
  CHECK(f.pool.stats().blocks_cached_idle == 3 * layers);
  CHECK(f.pool.blocks_available() == 100);
  {
    auto first = f.cache.attach(f.threads, std::span(t).first(8));  // pins 2 of 3
    CHECK(f.cache.stats().idle_blocks == 1);
    CHECK(f.pool.stats().blocks_cached_idle == 1 * layers);
    CHECK(f.pool.blocks_available() == 100 - 2 * layers);
    auto second = f.cache.attach(f.threads, std::span(t).first(4));  // pins block 0 twice
    CHECK(f.cache.stats().idle_blocks == 1);
    REQUIRE(truncate(first, 0) == ghostlink::error_code());
    CHECK(f.cache.stats().idle_blocks == 2);  // block 0 still pinned by the second
    CHECK(f.pool.stats().blocks_cached_idle == 2 * layers);
    REQUIRE(truncate(second, 0) == ghostlink::error_code());
  }
  CHECK(f.cache.stats().idle_blocks == 3);
  CHECK(f.pool.stats().blocks_cached_idle == 3 * layers);
  CHECK(f.pool.blocks_available() == 100);
  CHECK(f.pool.stats().blocks_in_use == 3 * layers);  // pinning allocated nothing
  expect_balanced(f);
}

// SGLang: test_lock_ref_operations, test_evict_functionality
TEST_CASE("pinning protects: a held sequence, a snapshot or a fork keeps entries from eviction",
          "[prefix][behaviour]") {
  fixture f(6);  // 2 layers: 3 entries
  const auto a = run(1, 4), b = run(100, 4), c = run(200, 4);
  for (const auto* t : {&a, &b, &c}) REQUIRE(f.insert_idle(*t) == 1);
  {
    auto held = f.cache.attach(f.threads, a);
    basic_sequence_snapshot<float> snap;
    {
      auto s = f.cache.attach(f.threads, b);
      snap = s.snapshot();
      REQUIRE(truncate(s, 0) == ghostlink::error_code());
    }
    auto forked = [&] {
      auto s = f.cache.attach(f.threads, c);
      auto child = fork(s);
      REQUIRE(truncate(s, 0) == ghostlink::error_code());
      return child;
    }();
    CHECK(f.cache.stats().idle_blocks == 0);
    CHECK(f.pool.blocks_available() == 0);
    auto writer = empty_sequence(f);
    CHECK(append(writer, run(7, 1)) == kv_errc::capacity_exhausted);
    CHECK(writer.size() == 0);
    CHECK(f.cache.stats().evicted_blocks == 0);
    // Each pin let go of frees exactly its entry for the next block.
    REQUIRE(truncate(forked, 0) == ghostlink::error_code());
    REQUIRE(append(writer, run(7, 1)) == ghostlink::error_code());
    CHECK(f.cache.match(c) == 0);
    CHECK(f.cache.match(b) == 4);
    CHECK(f.cache.match(a) == 4);
    CHECK(append(writer, run(8, 4)) == kv_errc::capacity_exhausted);  // needs a second block a layer
    snap = {};
    REQUIRE(append(writer, run(8, 4)) == ghostlink::error_code());
    CHECK(f.cache.match(b) == 0);
    CHECK(f.cache.match(a) == 4);
    CHECK(diff(held, a) == "");
    CHECK(f.cache.stats().evicted_blocks == 2);
    REQUIRE(truncate(held, 0) == ghostlink::error_code());
    REQUIRE(truncate(writer, 0) == ghostlink::error_code());
  }
  expect_balanced(f);
}

// SGLang: test_evict_functionality
TEST_CASE("eviction frees blocks: evicted entries' blocks are the ones reused, within the budget",
          "[prefix][behaviour]") {
  fixture f(8);  // 2 layers: 4 entries
  std::vector<std::vector<token_id>> p;
  for (token_id i = 0; i < 4; ++i) p.push_back(run(1 + 100 * i, 4));
  for (const auto& t : p) REQUIRE(f.insert_idle(t) == 1);
  kv_pool_stats s = f.pool.stats();
  REQUIRE(s.blocks_in_use == 8);
  CHECK(s.blocks_cached == 8);
  CHECK(s.blocks_cached_idle == 8);
  CHECK(s.blocks_available == 8);
  {
    auto seq = f.prefill(run(500, 8));  // 2 blocks a layer: the 2 least recently used entries go
    s = f.pool.stats();
    CHECK(s.blocks_in_use == 8);
    CHECK(s.peak_blocks_in_use == 8);
    CHECK(s.blocks_cached == 4);
    CHECK(s.blocks_cached_idle == 4);
    CHECK(s.blocks_available == 4);
    const kv_prefix_stats ps = f.cache.stats();
    CHECK(ps.evicted_blocks == 2);
    CHECK(ps.cached_blocks == 2);
    CHECK(ps.idle_blocks == 2);
    CHECK(f.cache.match(p[0]) == 0);
    CHECK(f.cache.match(p[1]) == 0);
    CHECK(f.cache.match(p[2]) == 4);
    CHECK(f.cache.match(p[3]) == 4);
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  }
  f.threads.join();  // the sequences' actors are done: the free list holds still
  s = f.pool.stats();
  CHECK(s.blocks_in_use == 4);
  CHECK(s.blocks_available == 8);
  f.cache.clear();  // the idle entries' blocks go to the free list, not to the system
  const kv_pool_stats after = f.pool.stats();
  CHECK(after.blocks_in_use == 0);
  CHECK(after.blocks_free == s.blocks_free + 4);
  CHECK(after.blocks_allocated == s.blocks_allocated);
  expect_balanced(f);
}

// SGLang: test_extra_key_isolation
TEST_CASE("concurrency: two tenants with the same prompts under their own salts never read each other's KV",
          "[prefix][behaviour][concurrency]") {
  // 2 layers, 24 blocks: room for 4 of the 6 (prompt, salt) pairs, so writes
  // evict. Each tenant asks for each prompt twice running, so that the second
  // ask mostly finds what the first inserted (cycling through more prompts
  // than fit, LRU would evict every one before it came round again).
  fixture f(24);
  constexpr std::size_t prompts = 3, rounds = 120;
  std::vector<std::vector<token_id>> prompt(prompts);
  for (std::size_t i = 0; i < prompts; ++i) prompt[i] = run(static_cast<token_id>(1 + 1000 * i), 12);
  const std::array<std::string, 2> salts = {"tenant-a", "tenant-b"};
  struct tally {
    std::size_t hit_tokens = 0, hits = 0, exhausted = 0;
    std::string failure;
  };
  std::array<tally, 2> out;
  std::latch go(2);
  auto worker = [&](std::size_t id) {
    tally& mine = out[id];
    const float tag = static_cast<float>(id + 1);
    go.arrive_and_wait();
    for (std::size_t r = 0; r < rounds && mine.failure.empty(); ++r) {
      const auto& t = prompt[(r / 2 + id) % prompts];
      auto seq = f.cache.attach(f.threads, t, salts[id]);
      mine.hit_tokens += seq.size();
      if (seq.size() > 0) ++mine.hits;
      std::string d = diff(seq, std::span(t).first(seq.size()), tag);
      if (d.empty() && seq.size() < t.size()) {
        const ghostlink::error_code ec = append(seq, std::span(t).subspan(seq.size()), tag);
        if (ec == kv_errc::capacity_exhausted) {
          ++mine.exhausted;
          continue;
        }
        if (ec) d = ec.message();
      }
      if (d.empty()) d = diff(seq, t, tag);
      if (d.empty()) f.cache.insert(seq, t, salts[id]);
      if (!d.empty()) mine.failure = str("round ", r, ": ", d);
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  CHECK(out[0].failure == "");
  CHECK(out[1].failure == "");
  CHECK(out[0].hits > 0);
  CHECK(out[1].hits > 0);
  const kv_prefix_stats s = f.cache.stats();
  CHECK(s.hit_tokens == out[0].hit_tokens + out[1].hit_tokens);
  CHECK(s.queries == 2 * rounds);
  CHECK(s.evicted_blocks > 0);
  f.threads.join();  // every sequence is gone: each entry is idle
  CHECK(f.cache.stats().idle_blocks == f.cache.stats().cached_blocks);
  CHECK(f.pool.stats().blocks_in_use == f.pool.stats().blocks_cached);
  CHECK(f.pool.stats().peak_blocks_in_use <= 24);
  expect_balanced(f);
}

}  // namespace prefix_behaviours_tests
