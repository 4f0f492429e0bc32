// The prefix cache's contract (include/ghostlink/prefix_cache.hpp, docs/API.md): the
// block hash, match, attach, insert, eviction, cached data never changing,
// clear, stats, events, one cache per pool, admission control.

#include "common/prefix_support.hpp"

#include <atomic>
#include <latch>
#include <mutex>
#include <thread>

namespace prefix_cache_tests {

using namespace ghostlink;
using namespace ghostlink::test::prefix;

namespace {

constexpr std::size_t bt = 4;  // config().block_tokens

}  // namespace

TEST_CASE("block_hashes: one per full block; a block's hash depends on it and every block before", "[prefix]") {
  fixture f;
  const auto t = run(1, 11);  // two full blocks and 3 tokens
  const auto h = f.cache.block_hashes(t);
  REQUIRE(h.size() == t.size() / bt);
  CHECK(f.cache.block_hashes(std::span(t).first(3)).empty());
  // The hashes of a prefix are a prefix of the hashes.
  CHECK(f.cache.block_hashes(std::span(t).first(4)) == std::vector(h.begin(), h.begin() + 1));
  CHECK(h[0] != h[1]);
  CHECK(h[0].hex().size() == 64);
  CHECK(h[0].hex().find_first_not_of("0123456789abcdef") == std::string::npos);
  // A token changed in block 1 changes block 1's hash, not block 0's.
  auto u = run(1, 12);
  u[5] = 99;
  const auto hu = f.cache.block_hashes(u);
  CHECK(hu[0] == h[0]);
  CHECK(hu[1] != h[1]);
  // A token changed in block 0 changes every later hash.
  auto v = run(1, 12);
  v[0] = 99;
  const auto hv = f.cache.block_hashes(v);
  CHECK(hv[0] != h[0]);
  CHECK(hv[1] != h[1]);
}

TEST_CASE("block_hashes: the salt, the model, the layers, the geometry and the element type change every hash",
          "[prefix]") {
  const auto t = run(1, 8);
  std::vector<std::vector<kv_block_hash>> seen;
  {
    fixture f;
    seen.push_back(f.cache.block_hashes(t));
    seen.push_back(f.cache.block_hashes(t, "tenant-a"));
    seen.push_back(f.cache.block_hashes(t, "tenant-b"));
    CHECK(f.cache.block_hashes(t, "tenant-a") == seen[1]);  // deterministic
  }
  {
    fixture f(1000, 2, {.model = "llama-3-8b"});
    seen.push_back(f.cache.block_hashes(t));
  }
  {
    fixture f(1000, 3);
    seen.push_back(f.cache.block_hashes(t));
  }
  for (kv_cache_config c : {kv_cache_config{.num_heads = 1, .head_dim = 8, .block_tokens = 4},
                            kv_cache_config{.num_heads = 2, .head_dim = 8, .block_tokens = 4},
                            kv_cache_config{.num_heads = 2, .head_dim = 4, .block_tokens = 2}}) {
    c.max_tokens_per_seq = 64;
    const kv_block_pool pool = kv_block_pool::for_caches(c);
    const kv_prefix_cache cache(2, c, pool);
    auto h = cache.block_hashes(t);
    h.resize(2);
    seen.push_back(h);
  }
  {
    fixture<half> f;
    seen.push_back(f.cache.block_hashes(t));
  }
  {
    fixture<bfloat16> f;
    seen.push_back(f.cache.block_hashes(t));
  }
  check_apart(seen);
}

TEST_CASE("match: the tokens of the longest run of cached blocks from block 0; pins nothing", "[prefix]") {
  fixture f;
  const auto t = run(1, 10);
  CHECK(f.cache.match(t) == 0);
  CHECK(f.insert_idle(std::span(t).first(8)) == 2);
  CHECK(f.cache.match(t) == 8);
  CHECK(f.cache.match(std::span(t).first(7)) == 4);  // only full blocks
  CHECK(f.cache.match(std::span(t).first(3)) == 0);
  auto other = t;
  other[1] = 77;  // block 0 differs: nothing matches, though block 1 is the same
  CHECK(f.cache.match(other) == 0);
  CHECK(f.cache.match(t, "salt") == 0);
  // Pins nothing: every entry is still idle.
  CHECK(f.cache.stats().idle_blocks == 2);
  CHECK(f.pool.stats().blocks_cached_idle == 2 * f.cache.num_layers());
}

TEST_CASE("match: does not change what is least recently used", "[prefix]") {
  fixture f(4);  // 2 layers: room for two entries
  const auto a = run(1, 4), b = run(100, 4);
  f.insert_idle(a);
  f.insert_idle(b);  // a is the least recently used
  CHECK(f.cache.match(a) == 4);
  // A new sequence needs a block: a goes, though it was matched last.
  auto seq = f.prefill(run(200, 1));
  CHECK(f.cache.match(a) == 0);
  CHECK(f.cache.match(b) == 4);
  CHECK(f.cache.stats().evicted_blocks == 1);
}

TEST_CASE("attach: the cached blocks of every layer, shared: no copy, no block allocated", "[prefix]") {
  fixture f;
  const auto t = run(5, 10);
  auto source = f.prefill(t);
  REQUIRE(f.cache.insert(source, t) == 2);
  const kv_pool_stats before = f.pool.stats();
  auto seq = f.cache.attach(f.threads, t);
  CHECK(seq.size() == 8);
  CHECK(seq.num_layers() == f.cache.num_layers());
  CHECK(seq.pool() == f.pool);
  CHECK(seq.config().token_width() == config().token_width());
  CHECK(diff(seq, std::span(t).first(8)) == "");
  const kv_pool_stats after = f.pool.stats();
  CHECK(after.blocks_in_use == before.blocks_in_use);
  CHECK(after.blocks_allocated == before.blocks_allocated);
  CHECK(after.cow_copies == before.cow_copies);
  // The same blocks: the source's snapshot and the attached one read one memory.
  const auto a = source.snapshot(), b = seq.snapshot();
  const float* pa = nullptr;
  const float* pb = nullptr;
  REQUIRE_FALSE(a.layer(1).for_each_block(4, 8, [&](std::size_t, std::size_t, auto k, auto) { pa = k.data(); }));
  REQUIRE_FALSE(b.layer(1).for_each_block(4, 8, [&](std::size_t, std::size_t, auto k, auto) { pb = k.data(); }));
  CHECK(pa == pb);
}

TEST_CASE("attach: a miss is an empty sequence, usable as any other", "[prefix]") {
  fixture f;
  const auto t = run(1, 6);
  auto seq = f.cache.attach(f.threads, t);
  REQUIRE(seq.valid());
  CHECK(seq.size() == 0);
  REQUIRE(append(seq, t) == ghostlink::error_code());
  CHECK(diff(seq, t) == "");
  const kv_prefix_stats s = f.cache.stats();
  CHECK(s.queries == 1);
  CHECK(s.query_tokens == 4);
  CHECK(s.hit_tokens == 0);
}

TEST_CASE("attach: the sequence appends, forks and truncates; a write into a shared block copies it", "[prefix]") {
  fixture f;
  const auto t = run(1, 8);
  f.insert_idle(t);
  auto seq = f.cache.attach(f.threads, t);
  REQUIRE(seq.size() == 8);
  const auto more = run(50, 3);
  REQUIRE(append(seq, more) == ghostlink::error_code());
  CHECK(diff(seq, cat(t, more)) == "");
  auto child = fork(seq);
  CHECK(diff(child, cat(t, more)) == "");
  // Truncate into block 1 and write there: the cached block is copied.
  const std::uint64_t copies = f.pool.stats().cow_copies;
  REQUIRE(truncate(seq, 6) == ghostlink::error_code());
  const auto other = run(70, 2);
  REQUIRE(append(seq, other) == ghostlink::error_code());
  CHECK(f.pool.stats().cow_copies > copies);
  CHECK(diff(seq, cat(std::vector(t.begin(), t.begin() + 6), other)) == "");
  // The cache still serves what was inserted.
  auto again = f.cache.attach(f.threads, t);
  CHECK(diff(again, t) == "");
}

TEST_CASE("attach: the entries become the most recently used", "[prefix]") {
  fixture f(4);  // room for two entries of 2 layers
  const auto a = run(1, 4), b = run(100, 4);
  f.insert_idle(a);
  f.insert_idle(b);
  {
    auto seq = f.cache.attach(f.threads, a);  // a is now the most recently used
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  }
  auto seq = f.prefill(run(200, 1));  // needs a block: b goes
  CHECK(f.cache.match(a) == 4);
  CHECK(f.cache.match(b) == 0);
}

TEST_CASE("insert: full blocks of the first min(tokens, size) tokens; an entry kept, not duplicated", "[prefix]") {
  fixture f;
  const auto t = run(1, 14);
  auto seq = f.prefill(std::span(t).first(9));  // holds 9 tokens: 2 full blocks
  CHECK(f.cache.insert(seq, t) == 2);           // tokens past size() are ignored
  CHECK(f.cache.match(t) == 8);
  CHECK(f.cache.insert(seq, t) == 0);  // already cached
  CHECK(f.cache.stats().cached_blocks == 2);
  CHECK(f.cache.stats().inserted_blocks == 2);
  REQUIRE(append(seq, std::span(t).subspan(9, 5)) == ghostlink::error_code());
  CHECK(f.cache.insert(seq, std::span(t).first(5)) == 0);  // fewer tokens given: block 0 only, cached
  CHECK(f.cache.insert(seq, t) == 1);                      // block 2 now full
  CHECK(f.cache.match(t) == 12);
  CHECK(diff(seq, t) == "");  // seq unchanged
  // A block cached from another sequence keeps its entry.
  auto other = f.prefill(std::span(t).first(4));
  CHECK(f.cache.insert(other, t) == 0);
  CHECK(f.cache.stats().cached_blocks == 3);
}

TEST_CASE("insert: a sequence of another layer count, pool or geometry throws and inserts nothing", "[prefix]") {
  fixture f;
  const auto t = run(1, 8);
  {
    sequence_kv_cache three(f.threads, 3, config(), f.pool);
    REQUIRE(append(three, t) == ghostlink::error_code());
    try {
      f.cache.insert(three, t);
      FAIL("no throw");
    } catch (const std::system_error& e) {
      CHECK(e.code() == kv_errc::layer_mismatch);
    }
  }
  {
    sequence_kv_cache elsewhere(f.threads, 2, config());  // a pool of its own
    REQUIRE(append(elsewhere, t) == ghostlink::error_code());
    try {
      f.cache.insert(elsewhere, t);
      FAIL("no throw");
    } catch (const std::system_error& e) {
      CHECK(e.code() == kv_errc::invalid_config);
    }
  }
  {
    kv_cache_config c = config();
    c.block_tokens = 2;
    c.num_heads = 4;  // same block bytes, another geometry
    sequence_kv_cache shaped(f.threads, 2, c, f.pool);
    REQUIRE(append(shaped, std::span(t).first(2)) == ghostlink::error_code());
    CHECK_THROWS_AS(f.cache.insert(shaped, t), std::system_error);
  }
  {
    kv_cache_config c = config();
    c.max_tokens_per_seq = 32;  // may differ
    c.max_pending = 7;
    sequence_kv_cache fine(f.threads, 2, c, f.pool);
    REQUIRE(append(fine, t) == ghostlink::error_code());
    CHECK(f.cache.insert(fine, t) == 2);
    REQUIRE(truncate(fine, 0) == ghostlink::error_code());
    f.cache.clear();
  }
  CHECK(f.cache.stats().cached_blocks == 0);
  CHECK(f.cache.stats().inserted_blocks == 2);
  CHECK_THROWS_AS(f.cache.insert(sequence_kv_cache(), t), std::system_error);
}

TEST_CASE("match and attach stop at the cache's max_tokens_per_seq, whatever was inserted", "[prefix]") {
  const kv_block_pool pool = kv_block_pool::for_caches(config());
  kv_cache_config small = config();
  small.max_tokens_per_seq = 6;  // a block and a half
  kv_prefix_cache cache(2, small, pool);
  asio::thread_pool threads(2);
  const auto t = run(1, 12);
  sequence_kv_cache seq(threads, 2, config(), pool);  // max 64 tokens
  REQUIRE(append(seq, t) == ghostlink::error_code());
  CHECK(cache.insert(seq, t) == 3);
  CHECK(cache.match(t) == 4);
  auto attached = cache.attach(threads, t);
  CHECK(diff(attached, std::span(t).first(4)) == "");
  CHECK(append(attached, std::span(t).subspan(4, 2)) == ghostlink::error_code());
  CHECK(append(attached, std::span(t).subspan(6, 1)) == kv_errc::index_out_of_range);
  REQUIRE(truncate(seq, 0) == ghostlink::error_code());
}

TEST_CASE("insert_stored_tokens: from the ids the sequence stores, up to a token stored without one", "[prefix]") {
  fixture f;
  const auto t = run(1, 10);
  auto seq = f.prefill(t);
  CHECK(f.cache.insert_stored_tokens(seq) == 2);
  CHECK(f.cache.match(t) == 8);
  CHECK(f.cache.insert_stored_tokens(seq, "salted") == 2);
  CHECK(f.cache.match(t, "salted") == 8);
  // Tokens appended without ids end it.
  auto plain = f.prefill(std::span(t).first(4));
  const std::size_t w = config().token_width();
  std::vector<std::vector<float>> keys(2, std::vector<float>(4 * w, 1.0f));
  std::vector<std::span<const float>> ks(keys.begin(), keys.end());
  REQUIRE(wait_ec([&](auto tk) { return plain.async_append(ks, ks, tk); }) == ghostlink::error_code());
  CHECK(f.cache.insert_stored_tokens(plain, "other") == 1);
}

TEST_CASE("cached data never changes: a truncate and rewrite by the owner copies the cached block", "[prefix]") {
  fixture f;
  const auto t = run(1, 8);
  auto seq = f.prefill(t);
  REQUIRE(f.cache.insert(seq, t) == 2);
  // Rollback into block 1 and rewrite in place, as speculative decoding does:
  // without the cache, no snapshot or fork holds the block and it would be
  // rewritten in place.
  REQUIRE(truncate(seq, 5) == ghostlink::error_code());
  const auto rewrite = run(90, 3);
  REQUIRE(append(seq, rewrite) == ghostlink::error_code());
  CHECK(diff(seq, cat(run(1, 5), rewrite)) == "");
  auto attached = f.cache.attach(f.threads, t);
  CHECK(diff(attached, t) == "");
}

TEST_CASE("eviction: least recently used first, only idle entries, a child before its parent", "[prefix]") {
  fixture f(6);  // 2 layers: three entries
  const auto a = run(1, 8);     // two entries: a0 <- a1
  const auto b = run(100, 4);   // one entry
  f.insert_idle(a);
  f.insert_idle(b);
  REQUIRE(f.pool.stats().blocks_in_use == 6);
  // Within one insert the later block counts as used first; a1 is the least
  // recently used, then a0, then b.
  event_log log;
  f.cache.set_event_handler(log.handler());
  auto s1 = f.prefill(run(300, 1));  // evicts a1
  CHECK(f.cache.match(a) == 4);
  auto s2 = f.prefill(run(400, 1));  // evicts a0
  CHECK(f.cache.match(a) == 0);
  CHECK(f.cache.match(b) == 4);
  REQUIRE(log.events.size() == 2);
  CHECK(log.events[0].what == kv_prefix_event::kind::removed);
  CHECK(log.events[0].hash == f.cache.block_hashes(a)[1]);
  CHECK(log.events[1].hash == f.cache.block_hashes(a)[0]);
  CHECK(f.cache.stats().evicted_blocks == 2);
}

TEST_CASE("eviction: attached entries stay; with nothing idle left, capacity_exhausted stores nothing", "[prefix]") {
  fixture f(6);
  const auto a = run(1, 8), b = run(100, 4);
  f.insert_idle(a);
  f.insert_idle(b);
  auto seq = f.cache.attach(f.threads, a);
  REQUIRE(seq.size() == 8);
  // b, idle and childless, goes first; then nothing of a can go.
  auto s1 = f.prefill(run(300, 1));
  CHECK(f.cache.match(b) == 0);
  CHECK(f.cache.match(a) == 8);
  sequence_kv_cache s2(f.threads, 2, config(), f.pool);
  CHECK(append(s2, run(400, 1)) == kv_errc::capacity_exhausted);
  CHECK(s2.size() == 0);
  CHECK(f.cache.match(a) == 8);
}

TEST_CASE("eviction: blocks a sequence or a snapshot holds are never evicted", "[prefix]") {
  fixture f(4);
  const auto a = run(1, 4), b = run(100, 4);
  auto holder = f.prefill(a);
  REQUIRE(f.cache.insert(holder, a) == 1);
  basic_sequence_snapshot<float> pinned;
  {
    auto other = f.prefill(b);
    REQUIRE(f.cache.insert(other, b) == 1);
    pinned = other.snapshot();
    REQUIRE(truncate(other, 0) == ghostlink::error_code());
  }
  // Both entries are in use (a by its sequence, b by a snapshot): nothing
  // can be evicted, and a write that needs a block fails, storing nothing.
  CHECK(f.cache.stats().idle_blocks == 0);
  sequence_kv_cache s(f.threads, 2, config(), f.pool);
  CHECK(append(s, run(7, 1)) == kv_errc::capacity_exhausted);
  CHECK(s.size() == 0);
  CHECK(f.cache.stats().evicted_blocks == 0);
  CHECK(diff(holder, a) == "");
  // The snapshot released, b's entry is idle and goes for the next write.
  pinned = {};
  CHECK(f.cache.stats().idle_blocks == 1);
  CHECK(append(s, run(7, 1)) == ghostlink::error_code());
  CHECK(f.cache.match(b) == 0);
  CHECK(f.cache.match(a) == 4);
}

TEST_CASE("eviction: one token appended to every layer evicts one entry", "[prefix]") {
  fixture f(6, 3);  // 3 layers: two entries
  f.insert_idle(run(1, 4));
  f.insert_idle(run(100, 4));
  REQUIRE(f.pool.stats().blocks_in_use == 6);
  auto seq = f.prefill(run(200, 1));  // needs 3 blocks: one entry frees 3
  CHECK(f.cache.stats().evicted_blocks == 1);
  CHECK(f.cache.stats().cached_blocks == 1);
}

TEST_CASE("eviction: an entry whose blocks another entry also references frees none; eviction goes on", "[prefix]") {
  fixture f(6);
  const auto t = run(1, 4);
  {
    auto seq = f.prefill(t);
    REQUIRE(f.cache.insert(seq, t, "x") == 1);
    REQUIRE(f.cache.insert(seq, t, "y") == 1);  // the same blocks under another salt
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  }
  f.insert_idle(run(100, 4));  // x, y, then this one; 4 blocks in use
  REQUIRE(f.pool.stats().blocks_in_use == 4);
  REQUIRE(f.pool.stats().blocks_cached == 4);
  auto s1 = f.prefill(run(200, 8));  // needs 4 blocks: 2 free, then x (frees none), y (frees 2)
  CHECK(f.cache.stats().evicted_blocks == 2);
  CHECK(f.cache.match(t, "x") == 0);
  CHECK(f.cache.match(t, "y") == 0);
  CHECK(f.cache.match(run(100, 4)) == 4);
}

TEST_CASE("eviction: an entry becomes idle when a snapshot is released on another thread", "[prefix]") {
  fixture f(4);
  const auto a = run(1, 4);
  auto seq = f.prefill(a);
  REQUIRE(f.cache.insert(seq, a) == 1);
  auto snap = seq.snapshot();
  REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  CHECK(f.cache.stats().idle_blocks == 0);
  std::thread([s = std::move(snap)]() mutable { s = {}; }).join();
  CHECK(f.cache.stats().idle_blocks == 1);
  CHECK(f.pool.stats().blocks_cached_idle == 2);
}

TEST_CASE("clear: every entry dropped; blocks in use stay with their users; one cleared event", "[prefix]") {
  fixture f;
  const auto a = run(1, 8), b = run(100, 4);
  f.insert_idle(a);
  auto holder = f.prefill(b);
  REQUIRE(f.cache.insert(holder, b) == 1);
  event_log log;
  f.cache.set_event_handler(log.handler());
  REQUIRE(f.pool.stats().blocks_in_use == 6);
  f.cache.clear();
  CHECK(f.cache.stats().cached_blocks == 0);
  CHECK(f.cache.stats().idle_blocks == 0);
  CHECK(f.cache.stats().evicted_blocks == 0);
  CHECK(f.pool.stats().blocks_in_use == 2);  // holder's
  CHECK(f.pool.stats().blocks_cached == 0);
  CHECK(diff(holder, b) == "");
  CHECK(f.cache.match(a) == 0);
  f.cache.clear();  // on an empty cache too
  REQUIRE(log.events.size() == 2);
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(log.events[i].what == kv_prefix_event::kind::cleared);
    CHECK(log.events[i].sequence == i + 1);
    CHECK(log.events[i].hash == kv_block_hash{});
  }
}

TEST_CASE("stats: queries, tokens asked for and hit, inserted, evicted, cached and idle entries", "[prefix]") {
  fixture f(6);
  const auto a = run(1, 10);
  CHECK(f.cache.match(a) == 0);
  auto seq = f.prefill(std::span(a).first(8));
  CHECK(f.cache.insert(seq, a) == 2);
  CHECK(f.cache.stats().idle_blocks == 0);
  CHECK(f.cache.match(a) == 8);
  auto attached = f.cache.attach(f.threads, std::span(a).first(5));
  kv_prefix_stats s = f.cache.stats();
  CHECK(s.queries == 3);
  CHECK(s.query_tokens == 8 + 8 + 4);
  CHECK(s.hit_tokens == 0 + 8 + 4);
  CHECK(s.inserted_blocks == 2);
  CHECK(s.cached_blocks == 2);
  CHECK(s.idle_blocks == 0);
  REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  CHECK(f.cache.stats().idle_blocks == 1);  // block 1; block 0 is attached
  REQUIRE(truncate(attached, 0) == ghostlink::error_code());
  s = f.cache.stats();
  CHECK(s.idle_blocks == 2);
  CHECK(s.cached_blocks - s.idle_blocks == 0);
  CHECK(s.evicted_blocks == 0);
}

TEST_CASE("events: stored in block order with parents, removed, numbered from 1 without gaps per handler", "[prefix]") {
  fixture f(8);
  event_log log;
  f.cache.set_event_handler(log.handler());
  const auto a = run(1, 12);
  f.insert_idle(a);
  const auto h = f.cache.block_hashes(a);
  REQUIRE(log.events.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(log.events[i].what == kv_prefix_event::kind::stored);
    CHECK(log.events[i].sequence == i + 1);
    CHECK(log.events[i].hash == h[i]);
    if (i == 0)
      CHECK_FALSE(log.events[i].parent.has_value());
    else
      CHECK(log.events[i].parent == h[i - 1]);
  }
  {
    auto attached = f.cache.attach(f.threads, a);
    CHECK(f.cache.insert(attached, a) == 0);  // nothing new: no event
    REQUIRE(truncate(attached, 0) == ghostlink::error_code());
  }
  CHECK(log.events.size() == 3);
  {
    auto s = f.prefill(run(100, 8));  // 4 blocks, 2 free: evicts block 2
    REQUIRE(log.events.size() == 4);
    CHECK(log.events[3].what == kv_prefix_event::kind::removed);
    CHECK(log.events[3].hash == h[2]);
    CHECK(log.events[3].sequence == 4);
    REQUIRE(truncate(s, 0) == ghostlink::error_code());
  }
  // A new handler starts again at 1; an empty one turns events off.
  event_log second;
  f.cache.set_event_handler(second.handler());
  f.cache.clear();
  REQUIRE(second.events.size() == 1);
  CHECK(second.events[0].sequence == 1);
  f.cache.set_event_handler({});
  f.insert_idle(a);
  CHECK(second.events.size() == 1);
  CHECK(log.events.size() == 4);
}

TEST_CASE("one prefix cache per pool; bad configs throw invalid_config and claim nothing", "[prefix]") {
  const kv_block_pool pool = kv_block_pool::for_caches(config(), {.max_blocks = 100});
  auto expect_invalid = [&](auto make) {
    try {
      make();
      FAIL("no throw");
    } catch (const std::system_error& e) {
      CHECK(e.code() == kv_errc::invalid_config);
    }
  };
  expect_invalid([&] { kv_prefix_cache(0, config(), pool); });
  kv_cache_config budgeted = config();
  budgeted.max_blocks = 10;
  expect_invalid([&] { kv_prefix_cache(2, budgeted, pool); });
  kv_cache_config wider = config();
  wider.head_dim = 8;
  expect_invalid([&] { kv_prefix_cache(2, wider, pool); });
  expect_invalid([&] { basic_kv_prefix_cache<half>(2, config(), pool); });  // half the block bytes
  kv_cache_config zero = config();
  zero.num_heads = 0;
  expect_invalid([&] { kv_prefix_cache(2, zero, pool); });
  {
    kv_prefix_cache first(2, config(), pool);
    kv_prefix_cache copy = first;  // a handle on the same cache
    expect_invalid([&] { kv_prefix_cache(2, config(), pool); });
    CHECK(copy.pool() == pool);
    copy.clear();
  }
  // Every handle gone: another may be made.
  kv_prefix_cache again(2, config(), pool);
  CHECK(again.num_layers() == 2);
}

TEST_CASE("a cache destroyed with entries releases them: idle blocks go back, used ones stay", "[prefix]") {
  const kv_block_pool pool = kv_block_pool::for_caches(config(), {.max_blocks = 100});
  asio::thread_pool threads(2);
  sequence_kv_cache holder(threads, 2, config(), pool);
  const auto t = run(1, 8);
  REQUIRE(append(holder, t) == ghostlink::error_code());
  {
    kv_prefix_cache cache(2, config(), pool);
    REQUIRE(cache.insert(holder, t) == 2);
    REQUIRE(truncate(holder, 4) == ghostlink::error_code());  // block 1 is the cache's alone
    CHECK(pool.stats().blocks_in_use == 4);
  }
  CHECK(pool.stats().blocks_in_use == 2);
  CHECK(pool.stats().blocks_cached == 0);
  CHECK(diff(holder, std::span(t).first(4)) == "");
}

TEST_CASE("pool stats: cached and idle blocks apart from blocks in use; blocks_available", "[prefix]") {
  fixture f(10);
  const auto a = run(1, 8);
  auto seq = f.prefill(a);
  kv_pool_stats s = f.pool.stats();
  CHECK(s.blocks_in_use == 4);
  CHECK(s.blocks_cached == 0);
  CHECK(s.blocks_available == 6);
  REQUIRE(f.cache.insert(seq, a) == 2);
  s = f.pool.stats();
  CHECK(s.blocks_cached == 4);
  CHECK(s.blocks_cached_idle == 0);
  CHECK(s.blocks_available == 6);
  REQUIRE(truncate(seq, 4) == ghostlink::error_code());
  s = f.pool.stats();
  CHECK(s.blocks_in_use == 4);
  CHECK(s.blocks_cached_idle == 2);
  CHECK(s.blocks_available == 8);
  CHECK(f.pool.blocks_available() == 8);
  // Attaching turns idle entries into entries in use: they leave what is available.
  auto attached = f.cache.attach(f.threads, a);
  CHECK(f.pool.stats().blocks_cached_idle == 0);
  CHECK(f.pool.blocks_available() == 6);
}

TEST_CASE("blocks_available leaves out an idle entry whose child is in use: evicting cannot free it", "[prefix]") {
  fixture f(10);
  const auto t = run(1, 8);
  {
    auto a = f.prefill(std::span(t).first(4));  // block 0, computed here
    REQUIRE(f.cache.insert(a, t) == 1);
    auto b = f.prefill(t);  // blocks 0 and 1, computed again (a miss at its start)
    REQUIRE(f.cache.insert(b, t) == 1);  // block 0 keeps a's entry; block 1's parent is it
    REQUIRE(truncate(a, 0) == ghostlink::error_code());
    // a's block 0 is idle, but its child (b's block 1) is in use: not evictable.
    CHECK(f.pool.stats().blocks_cached_idle == 2);
    CHECK(f.pool.blocks_available() == 10 - 6);
    CHECK_THROWS_AS(f.pool.reserve(5), std::system_error);
    CHECK(f.cache.stats().evicted_blocks == 0);
    REQUIRE(truncate(b, 0) == ghostlink::error_code());
  }
  // Everything idle now: both entries can go.
  CHECK(f.pool.blocks_available() == 10);
  kv_block_reservation r = f.pool.reserve(10);
  CHECK(f.cache.stats().evicted_blocks == 2);
}

TEST_CASE("reservation: taken at once, evicting as needed, or refused whole", "[prefix]") {
  fixture f(6);
  f.insert_idle(run(1, 4));
  f.insert_idle(run(100, 4));
  auto holder = f.prefill(run(200, 1));  // 2 blocks in use; two idle entries (4 blocks)
  REQUIRE(f.pool.blocks_available() == 4);
  ghostlink::error_code ec;
  kv_block_reservation none = f.pool.reserve(5, ec);
  CHECK(ec == kv_errc::capacity_exhausted);
  CHECK(none.empty());
  CHECK(f.cache.stats().evicted_blocks == 0);  // refused whole: nothing evicted
  CHECK_THROWS_AS(f.pool.reserve(5), std::system_error);
  kv_block_reservation r = f.pool.reserve(2);  // evicts one entry
  CHECK(r.size() == 2);
  CHECK(f.cache.stats().evicted_blocks == 1);
  CHECK(f.pool.stats().blocks_reserved == 2);
  CHECK(f.pool.blocks_available() == 2);
  r.reset();
  CHECK(f.pool.stats().blocks_reserved == 0);
  CHECK(f.pool.blocks_available() == 4);
}

TEST_CASE("reservation: a sequence draws on it first, and what is left returns with the sequence", "[prefix]") {
  fixture f(6);
  kv_block_reservation r = f.pool.reserve(4);
  {
    auto seq = f.prefill({});
    seq.use_reservation(std::move(r));
    // NOLINTNEXTLINE(bugprone-use-after-move): use_reservation documents what it leaves
    CHECK(r.empty());
    // Another sequence cannot take the reserved blocks.
    sequence_kv_cache other(f.threads, 2, config(), f.pool);
    CHECK(append(other, run(1, 5)) == kv_errc::capacity_exhausted);  // needs 4, 2 left
    REQUIRE(append(seq, run(1, 4)) == ghostlink::error_code());           // 2 blocks from the reservation
    CHECK(f.pool.stats().blocks_reserved == 2);
    CHECK(f.pool.stats().blocks_in_use == 4);
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
    CHECK(f.pool.stats().blocks_in_use == 2);  // the 2 still reserved
    // A reservation of another pool is refused, unchanged.
    const kv_block_pool elsewhere = kv_block_pool::for_caches(config());
    kv_block_reservation foreign = elsewhere.reserve(1);
    CHECK_THROWS_AS(seq.use_reservation(std::move(foreign)), std::system_error);
    // NOLINTNEXTLINE(bugprone-use-after-move): refused, it is documented unchanged
    CHECK(foreign.size() == 1);
  }
  // The sequence gone (its actors with it once their last drain ends).
  f.threads.join();
  CHECK(f.pool.stats().blocks_reserved == 0);
  CHECK(f.pool.stats().blocks_in_use == 0);
}

TEST_CASE("concurrency: attach, insert, append and release on 2 threads under budget-driven eviction",
          "[prefix][concurrency]") {
  // 2 layers, 24 blocks: room for 4 of the 8 prompts, so writes evict.
  fixture f(24);
  constexpr std::size_t prompts = 8, rounds = 150;
  std::vector<std::vector<token_id>> prompt(prompts);
  for (std::size_t p = 0; p < prompts; ++p) prompt[p] = run(static_cast<token_id>(1 + 1000 * p), 12);
  std::atomic<std::size_t> attached_tokens{0}, failures{0}, exhausted{0};
  std::mutex log_mutex;
  std::string first_failure;
  std::latch go(2);
  auto worker = [&](std::size_t id) {
    go.arrive_and_wait();
    for (std::size_t r = 0; r < rounds; ++r) {
      const auto& t = prompt[(r * 7 + id * 3) % prompts];
      auto seq = f.cache.attach(f.threads, t);
      attached_tokens += seq.size();
      std::string d = diff(seq, std::span(t).first(seq.size()));
      if (d.empty() && seq.size() < t.size()) {
        const ghostlink::error_code ec = append(seq, std::span(t).subspan(seq.size()));
        if (ec == kv_errc::capacity_exhausted) {
          ++exhausted;
          continue;
        }
        if (ec) d = ec.message();
      }
      if (d.empty()) d = diff(seq, t);
      if (d.empty()) f.cache.insert(seq, t);
      if (!d.empty()) {
        std::lock_guard lock(log_mutex);
        if (failures++ == 0) first_failure = d;
      }
    }
  };
  std::thread a(worker, 0), b(worker, 1);
  a.join();
  b.join();
  INFO(first_failure);
  CHECK(failures == 0);
  CHECK(attached_tokens > 0);
  const kv_prefix_stats s = f.cache.stats();
  CHECK(s.hit_tokens == attached_tokens);
  CHECK(s.evicted_blocks > 0);
  f.threads.join();
  CHECK(f.cache.stats().idle_blocks == f.cache.stats().cached_blocks);
  CHECK(f.pool.stats().blocks_in_use == f.pool.stats().blocks_cached);
  f.cache.clear();
  CHECK(f.pool.stats().blocks_in_use == 0);
}

}  // namespace prefix_cache_tests
