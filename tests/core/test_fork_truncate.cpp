// async_fork (copy-on-write prefix sharing) and async_truncate (rollback):
// every cache and every snapshot checked token by token against a model.
#include "common/pool_support.hpp"
#include "testing/hooks.hpp"

#include <array>
#include <future>
#include <string>

namespace fork_truncate_tests {

using namespace ghostlink;
using namespace ghostlink::test::pool;
using ghostlink::test::as_tuple;
using ghostlink::test::small_config;

TEST_CASE("a fork holds its parent's tokens, size, config and pool, and numbers its epochs on from the parent's",
          "[fork]") {
  const kv_block_pool pool = kv_block_pool::for_caches(small_config());
  asio::thread_pool io(2);
  tracked parent = make_written(io, pool, 6);
  const std::uint64_t parent_epoch = parent.cache.snapshot().epoch();
  tracked child = parent.fork();
  CHECK_FALSE(child.cache == parent.cache);
  CHECK(child.cache.size() == parent.cache.size());
  CHECK(child.cache.config() == parent.cache.config());
  CHECK(child.cache.pool() == pool);
  CHECK(child.diff() == "");
  const std::uint64_t child_epoch = child.cache.snapshot().epoch();
  INFO("parent epoch at the fork " << parent_epoch << ", child's first " << child_epoch);
  CHECK(child_epoch > parent_epoch);
  child.write(6, 2);
  CHECK(child.cache.snapshot().epoch() > child_epoch);
}

TEST_CASE("a const handle initializes, writes, forks, truncates and reads its cache, as a const std::shared_ptr",
          "[fork]") {
  asio::thread_pool io(2);
  const layer_kv_cache cache(io, small_config());  // e.g. a const member of the caller
  const std::vector<float> t0 = ghostlink::test::token_pattern(cache.config().token_width(), 0, 7);
  const std::vector<float> t1 = ghostlink::test::token_pattern(cache.config().token_width(), 1, 8);
  const std::array<kv_write, 1> batch{{{1, t1, t1}}};
  cache.async_initialize(1, asio::use_future).get();
  cache.async_write(0, t0, t0, asio::use_future).get();
  cache.async_write_batch(batch, asio::use_future).get();
  const layer_kv_cache child = cache.async_fork(asio::use_future).get();
  cache.async_truncate(1, asio::use_future).get();
  CHECK(cache.size() == 1);
  REQUIRE(child.size() == 2);
  CHECK(child.async_read_kv(1, asio::use_future).get().keys == t1);
  CHECK(cache.async_read_range(0, 1, asio::use_future).get().keys == t0);
}

TEST_CASE("after a fork, writes to either side are invisible to the other", "[fork]") {
  const kv_block_pool pool = kv_block_pool::for_caches(small_config());
  asio::thread_pool io(2);
  tracked parent = make_written(io, pool, 10);
  tracked child = parent.fork();
  parent.write(2, 2);    // a full shared block
  child.write(8, 3);     // the partially filled shared block
  parent.write(11, 2);   // past the fork point
  child.write(13, 3);    // past the fork point, skipping tokens
  child.write(0, 4, 3);  // a whole shared block
  CHECK(parent.diff() == "");
  CHECK(child.diff() == "");
}

TEST_CASE("fork then write into a shared block copies exactly that block", "[fork]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens, n = 2 * bt + 2;  // two full blocks and a partial one
  const kv_block_pool pool = kv_block_pool::for_caches(config);
  asio::thread_pool io(2);
  tracked parent = make_written(io, pool, n);
  tracked child = parent.fork();
  const std::size_t blocks = blocks_for(n, bt);
  const kv_pool_stats before = pool.stats();
  REQUIRE(before.blocks_in_use == blocks);
  REQUIRE(before.blocks_shared == blocks);

  auto check_one_copy = [&](const char* who) {
    const kv_pool_stats after = pool.stats();
    INFO(who << " wrote block 1: cow copies " << before.cow_copies << " -> " << after.cow_copies << ", in use "
             << before.blocks_in_use << " -> " << after.blocks_in_use << ", shared " << before.blocks_shared << " -> "
             << after.blocks_shared);
    CHECK(after.cow_copies == before.cow_copies + 1);
    CHECK(after.blocks_in_use == before.blocks_in_use + 1);
    CHECK(after.blocks_shared == before.blocks_shared - 1);
    CHECK(parent.diff() == "");
    CHECK(child.diff() == "");
  };
  SECTION("the child writes") {
    child.write(bt + 1, 2);
    check_one_copy("the child");
  }
  SECTION("the parent writes") {
    parent.write(bt + 1, 2);
    check_one_copy("the parent");
  }
}

TEST_CASE("appending past the fork point on both sides of a partially filled shared block never corrupts the other",
          "[fork]") {
  const kv_block_pool pool = kv_block_pool::for_caches(small_config());
  asio::thread_pool io(2);
  const std::size_t n = 6;  // block 1 holds tokens 4 and 5 of its 4 slots
  tracked parent = make_written(io, pool, n);
  tracked child = parent.fork();
  std::vector<pinned> pins;
  pin(pins, parent, "at the fork, parent");
  pin(pins, child, "at the fork, child");
  // Writes one token on one side, then pins both sides as they are now.
  auto step = [&](tracked& side, std::size_t index, int tag) {
    side.write(index, tag);
    const std::string what = "after token " + std::to_string(index) + " tag " + std::to_string(tag) + ", ";
    pin(pins, parent, what + "parent");
    pin(pins, child, what + "child");
  };

  SECTION("the parent appends first, then the child") {
    step(parent, n, 2);
    step(parent, n + 1, 2);
    step(child, n, 3);
    step(child, n + 1, 3);
  }
  SECTION("the child appends first, then the parent") {
    step(child, n, 3);
    step(child, n + 1, 3);
    step(parent, n, 2);
    step(parent, n + 1, 2);
  }
  SECTION("alternating, one token at a time, into the next block too") {
    for (std::size_t i = n; i < n + 4; ++i) {
      step(parent, i, 2);
      step(child, i, 3);
    }
  }
  SECTION("one side skips a token the other writes: it reads zeros") {
    step(child, n + 1, 3);
    step(parent, n, 2);
    step(parent, n + 1, 2);
  }
  SECTION("the parent truncates into the shared block and writes it again") {
    parent.truncate(n - 1);
    pin(pins, parent, "after the parent truncated");
    step(parent, n - 1, 2);
    step(parent, n, 2);
    step(child, n, 3);
  }
  SECTION("the child truncates into the shared block and writes past a gap") {
    child.truncate(n - 1);
    pin(pins, child, "after the child truncated");
    step(child, n + 1, 3);
    step(parent, n, 2);
  }
  SECTION("both sides fork again and every cache appends") {
    tracked parent2 = parent.fork(), child2 = child.fork();
    step(child, n, 3);
    step(parent2, n, 4);
    step(parent, n, 2);
    step(child2, n + 1, 5);
    CHECK(parent2.diff() == "");
    CHECK(child2.diff() == "");
  }
  CHECK(parent.diff() == "");
  CHECK(child.diff() == "");
  check_pins(pins);
}

TEST_CASE("a fork of a fork shares blocks with both ancestors and all three diverge independently", "[fork]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens, n = 2 * bt + 2;
  const kv_block_pool pool = kv_block_pool::for_caches(config);
  asio::thread_pool io(2);
  tracked parent = make_written(io, pool, n);
  tracked child = parent.fork();
  child.write(n - 1, 2);  // the child's own copy of the last block
  const std::size_t in_use = pool.stats().blocks_in_use;
  tracked grandchild = child.fork();
  CHECK(pool.stats().blocks_in_use == in_use);
  CHECK(grandchild.diff() == "");

  parent.write(n - 2, 3);  // parent's last block, which nobody else holds now
  grandchild.write(1, 4);  // a block of the parent's
  child.write(n, 2);       // the child's block, past what the grandchild reads
  grandchild.write(n + 1, 4);
  parent.write(0, bt, 3);
  CHECK(parent.diff() == "");
  CHECK(child.diff() == "");
  CHECK(grandchild.diff() == "");
}

TEST_CASE("forking an empty cache or an initialized unwritten one gives an independent cache in the same state",
          "[fork]") {
  const kv_block_pool pool = kv_block_pool::for_caches(small_config());
  asio::thread_pool io(2);
  SECTION("never initialized: the fork rejects writes as its parent does, until initialized itself") {
    tracked parent{layer_kv_cache(io, small_config(), pool), {}};
    tracked child = parent.fork();
    CHECK(child.cache.size() == 0);
    CHECK(write(child.cache, 0, 1, 2) == kv_errc::not_initialized);
    child.initialize(3);
    child.write(1, 2);
    CHECK(write(parent.cache, 0, 1, 1) == kv_errc::not_initialized);
    CHECK(parent.diff() == "");
    CHECK(child.diff() == "");
  }
  SECTION("initialized, nothing written: the fork holds zeros and takes no block") {
    tracked parent{layer_kv_cache(io, small_config(), pool), {}};
    parent.initialize(10);
    tracked child = parent.fork();
    CHECK(child.diff() == "");
    CHECK(pool.stats().blocks_in_use == 0);
    child.write(3, 2);
    parent.write(5, 1);
    CHECK(parent.diff() == "");
    CHECK(child.diff() == "");
  }
}

TEST_CASE("forking copies no token data: blocks in use and copies are unchanged, even with the pool full", "[fork]") {
  const kv_cache_config config = small_config();
  const std::size_t blocks = blocks_for(config.max_tokens_per_seq, config.block_tokens);
  const kv_block_pool pool = kv_block_pool::for_caches(config, {.max_blocks = blocks});
  asio::thread_pool io(2);
  tracked parent = make_written(io, pool, config.max_tokens_per_seq);
  const kv_pool_stats before = pool.stats();
  REQUIRE(before.blocks_in_use == blocks);
  std::vector<tracked> forks;
  for (int i = 0; i < 3; ++i) forks.push_back(i == 0 ? parent.fork() : forks.back().fork());
  const kv_pool_stats after = pool.stats();
  INFO("in use " << before.blocks_in_use << " -> " << after.blocks_in_use << ", cow copies " << before.cow_copies
                 << " -> " << after.cow_copies);
  CHECK(after.blocks_in_use == before.blocks_in_use);
  CHECK(after.cow_copies == before.cow_copies);
  CHECK(after.peak_blocks_in_use == before.peak_blocks_in_use);
  for (const tracked& f : forks) CHECK(f.diff() == "");
}

TEST_CASE("a fork initiated between writes holds exactly the writes initiated before it", "[fork]") {
  const kv_block_pool pool = kv_block_pool::for_caches(small_config());
  asio::thread_pool io(2);
  tracked parent = make_written(io, pool, 5);
  const std::size_t w = parent.cache.config().token_width();
  const batch_data t5(w, 5, 6, 2), t6(w, 6, 7, 2), t1(w, 1, 2, 2);
  // Initiated back to back without waiting: the actor may apply all of them
  // in one drain, with in-place appends on both sides of the fork.
  auto w5 = parent.cache.async_write_batch(t5.entries, asio::use_future);
  auto forked = parent.cache.async_fork(asio::use_future);
  auto w6 = parent.cache.async_write_batch(t6.entries, asio::use_future);
  auto w1 = parent.cache.async_write_batch(t1.entries, asio::use_future);
  w5.get();
  parent.expected.write(5, 2);
  tracked child{forked.get(), parent.expected};
  w6.get();
  w1.get();
  parent.expected.write(6, 2);
  parent.expected.write(1, 2);
  CHECK(child.diff() == "");
  CHECK(parent.diff() == "");
}

TEST_CASE("truncate below a live snapshot keeps that snapshot intact", "[truncate]") {
  const kv_block_pool pool = kv_block_pool::for_caches(small_config());
  asio::thread_pool io(2);
  tracked c = make_written(io, pool, 10);
  std::vector<pinned> pins;
  pin(pins, c, "before truncating");
  c.truncate(3);
  pin(pins, c, "after truncating to 3");
  c.write(3, 7, 2);  // the same slots again
  c.write(9, 2);
  CHECK(c.diff() == "");
  check_pins(pins);
}

TEST_CASE("after truncate to n, writing n+3 reads the new token and zeros at n..n+2, never stale data", "[truncate]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens, written = 3 * bt;
  asio::thread_pool io(2);
  enum class holder { nothing, snapshot, fork };
  for (holder h : {holder::nothing, holder::snapshot, holder::fork}) {
    for (std::size_t n = 0; n + 3 < written; ++n) {
      INFO("truncate to " << n << ", old data held by "
                          << (h == holder::nothing    ? "nothing"
                              : h == holder::snapshot ? "a snapshot"
                                                      : "a fork"));
      // A pool per case: the previous case's cache may outlive its handle
      // for a moment (its last drain still finishing on the pool).
      const kv_block_pool pool = kv_block_pool::for_caches(config);
      tracked c = make_written(io, pool, written);
      std::vector<pinned> pins;
      std::vector<tracked> forks;
      if (h == holder::snapshot) pin(pins, c, "before truncating");
      if (h == holder::fork) forks.push_back(c.fork());
      c.truncate(n);
      c.write(n + 3, 2);
      CHECK(c.diff() == "");
      check_pins(pins);
      for (const tracked& f : forks) CHECK(f.diff() == "");
      pins.clear();
      forks.clear();
      // The gap is shorter than a block, so every block holds a written token.
      INFO("blocks in use " << pool.stats().blocks_in_use);
      CHECK(pool.stats().blocks_in_use == blocks_for(c.expected.stored, bt));
    }
  }
}

TEST_CASE("truncate to the size or beyond changes nothing: same epoch, size and tokens", "[truncate]") {
  const kv_block_pool pool = kv_block_pool::for_caches(small_config());
  asio::thread_pool io(2);
  tracked c = make_written(io, pool, 6);
  c.initialize(9);  // a zero tail past the stored tokens
  const std::uint64_t epoch = c.cache.snapshot().epoch();
  for (std::size_t n : {c.cache.size(), c.cache.size() + 1, std::size_t{SIZE_MAX}}) {
    INFO("truncate(" << n << ") of a cache of " << c.cache.size() << " tokens");
    c.truncate(n);
    CHECK(c.cache.snapshot().epoch() == epoch);
    CHECK(c.diff() == "");
  }
}

TEST_CASE("truncate frees dropped blocks once no snapshot pins them, all of them at 0, and the cache stays writable",
          "[truncate]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens;
  const kv_block_pool pool = kv_block_pool::for_caches(config);
  asio::thread_pool io(2);
  tracked c = make_written(io, pool, config.max_tokens_per_seq);
  const std::size_t all = blocks_for(c.expected.stored, bt);
  auto check_in_use = [&](const char* step, std::size_t expected) {
    INFO(step << ": in use " << pool.stats().blocks_in_use << ", free " << pool.stats().blocks_free);
    CHECK(pool.stats().blocks_in_use == expected);
    // Every slot holding memory holds a block or is free, the zero block
    // aside (memory of its own with a resource; reserved, none).
    CHECK(pool.stats().blocks_free == pool.stats().blocks_allocated - zero_blocks(pool) - expected);
    CHECK(c.diff() == "");
  };
  {
    const kv_snapshot pinned = c.cache.snapshot();
    c.truncate(bt + 2);
    check_in_use("truncated to bt + 2 while pinned", all);
  }
  check_in_use("pin released", blocks_for(c.expected.stored, bt));
  c.truncate(bt);
  check_in_use("truncated to bt", blocks_for(c.expected.stored, bt));
  c.truncate(0);
  CHECK(c.cache.empty());
  check_in_use("truncated to 0", 0);
  c.write(2, 2);  // no initialize needed again; tokens 0 and 1 read as zeros
  check_in_use("written again", blocks_for(c.expected.stored, bt));
}

TEST_CASE("repeated append-and-rollback cycles keep blocks in use at what the kept tokens need", "[truncate]") {
  kv_cache_config config = small_config();
  config.max_tokens_per_seq = 64;
  const std::size_t bt = config.block_tokens, max = config.max_tokens_per_seq;
  const kv_block_pool pool = kv_block_pool::for_caches(config);
  asio::thread_pool io(2);
  tracked c{layer_kv_cache(io, config, pool), {}};
  c.initialize(1);
  c.write(0, 2, 1);
  std::size_t most = 0;
  for (int cycle = 0; cycle < 40; ++cycle) {
    // A speculative step: k draft tokens appended, `accepted` of them kept.
    const std::size_t k = 1 + static_cast<std::size_t>(cycle) % 5;
    const std::size_t accepted = static_cast<std::size_t>(cycle) % (k + 1);
    if (c.expected.size() + k > max) c.truncate(c.expected.size() / 2);
    const std::size_t size = c.expected.size();
    c.write(size, size + k, 10 + cycle);
    most = std::max(most, size + k);
    c.truncate(size + accepted);
    INFO("cycle " << cycle << ": size " << c.expected.size() << ", in use " << pool.stats().blocks_in_use);
    REQUIRE(pool.stats().blocks_in_use == blocks_for(c.expected.stored, bt));
    REQUIRE(c.diff() == "");
  }
  // At most one block copied while its old epoch is still published.
  const kv_pool_stats s = pool.stats();
  INFO("peak " << s.peak_blocks_in_use << ", allocated " << s.blocks_allocated << ", most tokens " << most);
  CHECK(s.peak_blocks_in_use <= blocks_for(most, bt) + 1);
  // Memory: the peak in whole extents, the one the cache fills, the zero block.
  const std::size_t slots = pool.blocks_per_extent();
  CHECK(s.blocks_allocated <= blocks_for(s.peak_blocks_in_use, slots) * slots + slots + 1);
}

TEST_CASE("a write, a truncate into its block and a write past a gap, initiated together, apply in order",
          "[truncate]") {
  const kv_block_pool pool = kv_block_pool::for_caches(small_config());
  asio::thread_pool io(2);
  tracked c = make_written(io, pool, 2);
  const std::size_t w = c.cache.config().token_width();
  const batch_data batch(w, 2, 8, 2), past_gap(w, 9, 10, 3);
  auto a = c.cache.async_write_batch(batch.entries, asio::use_future);
  auto b = c.cache.async_truncate(5, asio::use_future);
  auto d = c.cache.async_write_batch(past_gap.entries, asio::use_future);
  a.get();
  b.get();
  d.get();
  c.expected.write(2, 8, 2);
  c.expected.truncate(5);
  c.expected.write(9, 3);
  CHECK(c.diff() == "");
}

TEST_CASE("concurrent forks and appends under a 2-thread pool leave every cache exactly as its model says",
          "[fork][concurrency]") {
  kv_cache_config config = small_config();
  config.max_tokens_per_seq = 64;
  constexpr int forkers = 3, rounds = 6;
  constexpr std::size_t first = 2, per_round = 8;  // rounds start and end mid-block (4 tokens a block)
  const kv_block_pool pool = kv_block_pool::for_caches(config);
  {
    mismatch_log log;
    asio::thread_pool io(2);
    asio::thread_pool outside(1);  // one forker runs here, off the caches' threads
    tracked parent{layer_kv_cache(io, config, pool), {}};
    parent.initialize(1);
    parent.write(0, first, 1);  // the parent only ever holds a prefix of tokens written with tag 1

    // Appends parent tokens [begin, end) one at a time.
    auto appender = [&](std::size_t begin, std::size_t end) -> asio::awaitable<void> {
      for (std::size_t i = begin; i < end; ++i) {
        const token_data t = make_token(config.token_width(), i, 1);
        auto [ec] = co_await parent.cache.async_write(i, t.keys, t.values, as_tuple(asio::use_awaitable));
        if (ec) log.add(str("parent: write ", i, ": ", ec.message()));
      }
    };
    // Forks the parent while it grows. The child appends past its fork
    // point (skipping a token) into the block it shares with the parent,
    // rewrites the last shared token, on odd rounds rolls back, and on
    // every other round is forked in turn and diverges from its own fork.
    auto forker = [&](int id, int round) -> asio::awaitable<std::vector<branch>> {
      std::vector<branch> out;
      const int tag = 2 + id * rounds + round;
      auto [ec, child] = co_await parent.cache.async_fork(as_tuple(asio::use_awaitable));
      if (ec) {
        log.add(str("fork ", id, ".", round, ": ", ec.message()));
        co_return out;
      }
      const std::size_t s = child.size();  // the fork point: tokens [0, s) with tag 1
      model at_fork;
      at_fork.write(0, s, 1);
      branch b = adopt(str("fork ", id, ".", round), std::move(child), at_fork);
      co_await put(b, s + 1, tag, log);
      co_await put(b, s - 1, tag, log);
      if (round % 2 == 1) {
        auto [tec] = co_await b.cache.async_truncate(s, as_tuple(asio::use_awaitable));
        if (tec)
          log.add(str(b.name, ": truncate: ", tec.message()));
        else
          b.expected.truncate(s);
        co_await put(b, s + 2, tag, log);
      }
      if (round % 2 == 0) {
        auto [fec, grand] = co_await b.cache.async_fork(as_tuple(asio::use_awaitable));
        if (fec) {
          log.add(str(b.name, ": fork: ", fec.message()));
        } else {
          branch g = adopt(b.name + " forked again", std::move(grand), b.expected);
          co_await put(g, s + 3, tag + 100, log);
          co_await put(b, s + 3, tag, log);
          co_await put(g, s - 1, tag + 100, log);
          out.push_back(std::move(g));
        }
      }
      out.push_back(std::move(b));
      co_return out;
    };
    // Each round: the parent appends a run of tokens while every forker
    // forks it once; everything finishes before the next round. Which
    // starts first alternates, so forks land at both ends of a run (both
    // mid-block) and in between, and children write into a block the
    // parent is still appending to.
    std::vector<branch> branches;
    for (int round = 0; round < rounds; ++round) {
      const std::size_t begin = first + per_round * static_cast<std::size_t>(round);
      std::future<void> appended;
      if (round % 2 == 1) appended = asio::co_spawn(io, appender(begin, begin + per_round), asio::use_future);
      std::vector<std::future<std::vector<branch>>> forked;
      for (int id = 0; id < forkers; ++id)
        forked.push_back(
            asio::co_spawn(id == 0 ? outside.get_executor() : io.get_executor(), forker(id, round), asio::use_future));
      if (round % 2 == 0) appended = asio::co_spawn(io, appender(begin, begin + per_round), asio::use_future);
      appended.wait();
      for (auto& f : forked) f.wait();
      appended.get();
      for (auto& f : forked)
        for (branch& b : f.get()) branches.push_back(std::move(b));
    }
    parent.expected.write(first, first + per_round * rounds, 1);

    log.require_none();
    CHECK(parent.diff() == "");
    CHECK(branches.size() == static_cast<std::size_t>(forkers * rounds + forkers * rounds / 2));
    for (const branch& b : branches) {
      INFO(b.name << ", forked at " << b.at_fork.size() << " tokens");
      CHECK(diff(b.cache, b.expected) == "");
      CHECK(diff(b.at_fork, b.at_fork_expected) == "");
    }
  }
  CHECK(pool.stats().blocks_in_use == 0);
}

}  // namespace fork_truncate_tests
