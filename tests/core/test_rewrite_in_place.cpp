// A rewrite after a rollback (truncate, then write the cut-off positions
// again) writes in place when only superseded epochs could see those
// positions: no older epoch alive and no one else holding the block. Every
// other write into a block an epoch may read still copies it first.
#include "common/pool_support.hpp"

#include <string>

namespace rewrite_in_place_tests {

using namespace ghostlink;
using namespace ghostlink::test::pool;
using ghostlink::test::small_config;

namespace {

/// A cache of two full blocks on a pool whose budget is exactly those two.
struct full_budget {
  kv_cache_config config = small_config();
  std::size_t bt = config.block_tokens;
  kv_block_pool pool = kv_block_pool::for_caches(config, {.max_blocks = 2});
  asio::thread_pool io{2};
  tracked c = make_written(io, pool, 2 * bt);

  std::string counters() const {
    const kv_pool_stats s = pool.stats();
    return "cow copies " + std::to_string(s.cow_copies) + ", in use " + std::to_string(s.blocks_in_use);
  }
};

}  // namespace

TEST_CASE("at a full budget, a rewrite after a rollback with no older epoch pinned succeeds with 0 copies",
          "[truncate][rewrite]") {
  full_budget f;
  REQUIRE(f.pool.stats().blocks_in_use == 2);
  SECTION("the cut-off tokens written again, one request per token") {
    f.c.truncate(f.bt + 1);  // cuts block 1 after position 1
    for (std::size_t i = f.bt + 1; i < 2 * f.bt; ++i) f.c.write(i, 2);
  }
  SECTION("past a gap: the skipped positions read as zeros") {
    f.c.truncate(f.bt + 1);
    f.c.write(2 * f.bt - 1, 3);
  }
  SECTION("speculative cycles: drafts appended, some rejected, the kept token rewritten") {
    for (int cycle = 0; cycle < 6; ++cycle) {
      const std::size_t kept = f.bt + static_cast<std::size_t>(cycle) % 2;
      f.c.truncate(kept);
      f.c.write(kept, 2 * f.bt, 10 + cycle);  // the drafts, over the cut-off positions
    }
  }
  INFO(f.counters());
  CHECK(f.pool.stats().cow_copies == 0);
  CHECK(f.pool.stats().blocks_in_use == 2);
  CHECK(f.c.diff() == "");
}

TEST_CASE("a rewrite after a rollback copies the block while a snapshot pins an epoch that read the cut-off tokens",
          "[truncate][rewrite]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens;
  const kv_block_pool pool = kv_block_pool::for_caches(config);
  asio::thread_pool io(2);
  tracked c = make_written(io, pool, 2 * bt);
  std::vector<pinned> pins;
  pin(pins, c, "before truncating");
  c.truncate(bt + 1);
  c.write(bt + 1, 2);
  INFO("cow copies " << pool.stats().cow_copies);
  CHECK(pool.stats().cow_copies == 1);
  CHECK(c.diff() == "");
  check_pins(pins);
}

TEST_CASE("at a full budget, a rewrite after a rollback fails whole while a pinned epoch reads the cut-off tokens",
          "[truncate][rewrite]") {
  full_budget f;
  std::vector<pinned> pins;
  pin(pins, f.c, "before truncating");
  f.c.truncate(f.bt + 1);
  CHECK(write(f.c.cache, f.bt + 1, f.bt + 2, 2) == kv_errc::capacity_exhausted);
  CHECK(f.c.diff() == "");  // nothing stored changed
  check_pins(pins);
  pins.clear();  // the old epoch goes: the same rewrite now fits in place
  f.c.write(f.bt + 1, 2);
  INFO(f.counters());
  CHECK(f.pool.stats().cow_copies == 0);
  CHECK(f.c.diff() == "");
}

TEST_CASE("a rewrite after a rollback copies the block while a fork shares it", "[truncate][rewrite][fork]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens;
  const kv_block_pool pool = kv_block_pool::for_caches(config);
  asio::thread_pool io(2);
  tracked c = make_written(io, pool, 2 * bt);
  SECTION("forked before the truncate: the fork reads the cut-off tokens") {
    tracked child = c.fork();
    c.truncate(bt + 1);
    c.write(bt + 1, 2);
    CHECK(pool.stats().cow_copies == 1);
    CHECK(child.diff() == "");
  }
  SECTION("forked after the truncate: the fork holds the block") {
    c.truncate(bt + 1);
    tracked child = c.fork();
    c.write(bt + 1, 2);
    CHECK(pool.stats().cow_copies == 1);
    CHECK(child.diff() == "");
  }
  CHECK(c.diff() == "");
}

TEST_CASE("an overwrite of a token the cache still holds copies its block, even with nothing pinned",
          "[truncate][rewrite]") {
  full_budget f;
  f.c.truncate(f.bt + 2);
  // Position 1 of block 1 is still the cache's: the latest epoch reads it.
  CHECK(write(f.c.cache, f.bt + 1, f.bt + 2, 2) == kv_errc::capacity_exhausted);
  CHECK(f.c.diff() == "");
  CHECK(f.pool.stats().cow_copies == 0);
}

}  // namespace rewrite_in_place_tests
