// kv_block_pool: one budget for many caches, its limits and counters, the
// free block slots of its extents, and blocks pinned by snapshots and forks.
#include "common/pool_support.hpp"

#include "common/asio_compat.hpp"
#include "memory/block.hpp"
#include "testing/hooks.hpp"

#include <unistd.h>

#include <atomic>
#include <latch>
#include <thread>

namespace block_pool_tests {

using namespace ghostlink;
using namespace ghostlink::test::pool;
using ghostlink::test::as_tuple;
using ghostlink::test::blocking;
using ghostlink::test::small_config;
using ghostlink::test::token_pattern;

TEST_CASE("block_bytes_for is the keys and values of one block, and for_caches makes an idle pool of that size",
          "[block_pool]") {
  const kv_cache_config config = small_config();
  const std::size_t per_block = 2 * config.block_tokens * config.token_width();
  CHECK(kv_block_pool::block_bytes_for<float>(config) == per_block * sizeof(float));
  CHECK(kv_block_pool::block_bytes_for<half>(config) == per_block * sizeof(half));
  CHECK(kv_block_pool::block_bytes_for<bfloat16>(config) == per_block * sizeof(bfloat16));

  const kv_block_pool pool = kv_block_pool::for_caches(config, {.max_blocks = 5});
  const kv_pool_stats s = pool.stats();
  CHECK(pool.block_bytes() == kv_block_pool::block_bytes_for<float>(config));
  CHECK(s.block_bytes == pool.block_bytes());
  CHECK(s.max_blocks == 5);
  CHECK(s.blocks_in_use == 0);
  CHECK(s.blocks_free == 0);
  CHECK(s.peak_blocks_in_use == 0);
  CHECK(s.blocks_shared == 0);
  CHECK(s.cow_copies == 0);
  CHECK(s.blocks_allocated == 0);
  CHECK(s.bytes_in_use() == 0);
}

TEST_CASE("a pool with zero or odd block bytes, or limits that allow no block, throws invalid_config", "[block_pool]") {
  const std::size_t bytes = kv_block_pool::block_bytes_for(small_config());
  CHECK(thrown_by([] { kv_block_pool p(0); }) == kv_errc::invalid_config);
  CHECK(thrown_by([] { kv_block_pool p(3); }) == kv_errc::invalid_config);
  CHECK(thrown_by([&] { kv_block_pool p(bytes, {.max_blocks = 0}); }) == kv_errc::invalid_config);
  CHECK(thrown_by([&] { kv_block_pool p(bytes, {.max_bytes = bytes - 1}); }) == kv_errc::invalid_config);
  kv_cache_config bad = small_config();
  bad.head_dim = 0;
  CHECK(thrown_by([&] { (void)kv_block_pool::for_caches(bad); }) == kv_errc::invalid_config);
  CHECK(thrown_by([&] { (void)kv_block_pool::block_bytes_for(bad); }) == kv_errc::invalid_config);
  // The smallest budget that holds a block is accepted.
  CHECK(thrown_by([&] { kv_block_pool p(bytes, {.max_bytes = bytes}); }) == ghostlink::error_code{});
}

TEST_CASE("a cache rejects a pool of another block size, or a config that also sets max_blocks, with invalid_config",
          "[block_pool]") {
  const kv_cache_config config = small_config();
  const kv_block_pool floats = kv_block_pool::for_caches(config);
  const kv_block_pool halves = kv_block_pool::for_caches<half>(config);
  asio::thread_pool io(2);
  kv_cache_config wider_blocks = config;
  wider_blocks.block_tokens *= 2;
  kv_cache_config with_budget = config;
  with_budget.max_blocks = 4;
  kv_cache_config zero_heads = config;
  zero_heads.num_heads = 0;
  CHECK(thrown_by([&] { layer_kv_cache c(io, config, halves); }) == kv_errc::invalid_config);
  CHECK(thrown_by([&] { basic_layer_kv_cache<half> c(io, config, floats); }) == kv_errc::invalid_config);
  CHECK(thrown_by([&] { layer_kv_cache c(io, wider_blocks, floats); }) == kv_errc::invalid_config);
  CHECK(thrown_by([&] { layer_kv_cache c(io, with_budget, floats); }) == kv_errc::invalid_config);
  CHECK(thrown_by([&] { layer_kv_cache c(io, zero_heads, floats); }) == kv_errc::invalid_config);

  // The matching element types are accepted and report their pool.
  layer_kv_cache f(io, config, floats);
  basic_layer_kv_cache<half> h(io.get_executor(), config, halves);
  CHECK(f.pool() == floats);
  CHECK(h.pool() == halves);
  CHECK_FALSE(f.pool() == halves);
  // A cache with a private pool gets one sized for it, with config.max_blocks as budget.
  layer_kv_cache own(io, with_budget);
  CHECK_FALSE(own.pool() == floats);
  CHECK(own.pool().block_bytes() == floats.block_bytes());
  CHECK(own.pool().stats().max_blocks == with_budget.max_blocks);
}

TEST_CASE("max_bytes caps the budget at the whole blocks it holds, and the smaller limit applies", "[block_pool]") {
  const kv_cache_config config = small_config();
  const std::size_t bytes = kv_block_pool::block_bytes_for(config);
  const std::size_t budget = 3;
  CHECK(kv_block_pool(bytes, {.max_bytes = budget * bytes + bytes / 2}).stats().max_blocks == budget);
  CHECK(kv_block_pool(bytes, {.max_blocks = budget, .max_bytes = 10 * bytes}).stats().max_blocks == budget);
  CHECK(kv_block_pool(bytes, {.max_blocks = 10, .max_bytes = budget * bytes}).stats().max_blocks == budget);

  const kv_block_pool pool = kv_block_pool::for_caches(config, {.max_bytes = budget * bytes + bytes - 1});
  asio::thread_pool io(2);
  tracked c{layer_kv_cache(io, config, pool), {}};
  c.initialize(1);
  const std::size_t fits = budget * config.block_tokens;
  c.write(0, fits, 1);
  CHECK(c.cache.stats().bytes_in_use == budget * bytes);
  CHECK(pool.stats().bytes_in_use() == budget * bytes);
  CHECK(write(c.cache, fits, fits + 1, 2) == kv_errc::capacity_exhausted);
  CHECK(c.diff() == "");
  CHECK(pool.stats().blocks_in_use == budget);
}

TEST_CASE("a batch needing more blocks than remain fails whole with capacity_exhausted, then fits after a truncate",
          "[block_pool]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens, budget = 3;
  const kv_block_pool pool = kv_block_pool::for_caches(config, {.max_blocks = budget});
  asio::thread_pool io(2);
  tracked c{layer_kv_cache(io, config, pool), {}};
  c.initialize(1);
  c.write(0, 2 * bt, 1);  // two full blocks
  REQUIRE(pool.stats().blocks_in_use == 2);

  // Tokens [2bt, 3bt] need two more blocks; one remains. The first of them
  // is taken before the second fails: it must be given back.
  const std::size_t end = 3 * bt + 1;
  const observed before = observe(c.cache);
  CHECK(write(c.cache, 2 * bt, end, 2) == kv_errc::capacity_exhausted);
  CHECK(observe(c.cache) == before);
  CHECK(c.diff() == "");
  CHECK(pool.stats().blocks_in_use == 2);

  // Dropping the second block frees it; the same batch then fits, the
  // tokens between the truncation point and the batch reading as zeros.
  c.truncate(bt);
  CHECK(pool.stats().blocks_in_use == 1);
  REQUIRE(write(c.cache, 2 * bt, end, 2) == ghostlink::error_code{});
  c.expected.write(2 * bt, end, 2);
  CHECK(c.diff() == "");
  CHECK(pool.stats().blocks_in_use == budget);
  CHECK(pool.stats().peak_blocks_in_use == budget);
}

TEST_CASE("two caches on one pool draw on one budget: blocks one holds the other cannot take", "[block_pool]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens, budget = 4;
  const kv_block_pool pool = kv_block_pool::for_caches(config, {.max_blocks = budget});
  asio::thread_pool io(2);
  tracked a{layer_kv_cache(io, config, pool), {}};
  tracked b{layer_kv_cache(io, config, pool), {}};
  a.initialize(1);
  a.write(0, 3 * bt, 1);
  // Initialize takes no block from the budget (zeros are exempt).
  b.initialize(config.max_tokens_per_seq);
  CHECK(pool.stats().blocks_in_use == 3);

  const observed b_before = observe(b.cache);
  CHECK(write(b.cache, 0, 2 * bt, 2) == kv_errc::capacity_exhausted);
  CHECK(observe(b.cache) == b_before);
  b.write(0, bt, 2);  // the last block of the budget
  CHECK(pool.stats().blocks_in_use == budget);
  // Each cache reports the whole pool's count.
  CHECK(a.cache.stats().blocks_in_use == budget);
  CHECK(b.cache.stats().blocks_in_use == budget);
  CHECK(write(a.cache, 3 * bt, 3 * bt + 1, 1) == kv_errc::capacity_exhausted);

  // What a gives back, b can take.
  a.truncate(bt);
  CHECK(pool.stats().blocks_in_use == budget - 2);
  b.write(bt, 3 * bt, 3);
  CHECK(pool.stats().blocks_in_use == budget);
  CHECK(pool.stats().peak_blocks_in_use == budget);
  CHECK(a.diff() == "");
  CHECK(b.diff() == "");
}

TEST_CASE("stats count blocks in use, free and allocated; freed slots are reused and trim releases unused extents",
          "[block_pool]") {
  const bool with_resource = GENERATE(false, true);
  INFO(kind_name(with_resource));
  const kv_cache_config config = config_for(with_resource);
  const std::size_t bt = config.block_tokens;
  kv_block_pool pool = pool_for(config, with_resource);
  const std::size_t slots = pool.blocks_per_extent(), zeros = zero_blocks(pool);
  asio::thread_pool io(2);
  tracked c{layer_kv_cache(io, config, pool), {}};
  c.initialize(1);
  std::size_t peak = 0;
  // After each step: in use is what the model holds (no step below copies a
  // block); memory is whole extents plus the cache's zero block (with a
  // resource) or the slots holding memory (reserved), and every slot of it
  // not in use is free.
  auto check = [&](const char* step, std::size_t extents, std::size_t claimed) {
    const kv_pool_stats s = pool.stats();
    const std::size_t in_use = blocks_for(c.expected.stored, bt);
    const std::size_t memory = with_resource ? extents * slots : claimed;
    peak = std::max(peak, in_use);
    INFO(step << ": in use " << s.blocks_in_use << ", free " << s.blocks_free << ", peak " << s.peak_blocks_in_use
              << ", allocated " << s.blocks_allocated << "; expected in use " << in_use << ", peak " << peak
              << ", extents " << extents << ", slots " << memory);
    CHECK(s.blocks_in_use == in_use);
    CHECK(s.peak_blocks_in_use == peak);
    CHECK(s.blocks_allocated == memory + zeros);
    CHECK(s.blocks_free == memory - in_use);
    CHECK(ghostlink::detail::census(pool).extents == extents);
    CHECK(c.cache.stats().bytes_in_use == in_use * pool.block_bytes());
    CHECK(c.diff() == "");
  };
  check("initialized", 0, 0);
  c.write(0, 3 * bt, 1);
  check("three blocks written: one extent", 1, 3);
  c.truncate(0);
  check("truncated to 0: the extent stays the cache's", 1, 3);
  c.write(0, 2 * bt, 2);
  check("two blocks written again, into slots freed (they hold memory)", 1, 3);
  pool.trim();
  check("trimmed: the extent holds blocks (reserved: the free slot's pages went back)", 1, 2);
  c.cache = layer_kv_cache{};
  io.join();  // the actor's last drain has let go of the cache's blocks and its cursor
  pool.trim();
  CHECK(pool.stats().blocks_in_use == 0);
  CHECK(pool.stats().blocks_allocated == 0);
  CHECK(pool.stats().blocks_free == 0);
  // Reserved: the address space stays the pool's, with the extent's
  // headers (two pages).
  CHECK(pool.stats().bytes_allocated <= (with_resource ? 0 : 2 * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE))));
  CHECK(ghostlink::detail::census(pool).extents == 0);
}

TEST_CASE("the blocks a cache fills one after another are one run of keys and one of values, a copy-on-write block "
          "a run of its own",
          "[block_pool]") {
  const kv_cache_config config = small_config();  // 4-token blocks, 16 tokens at most
  const std::size_t bt = config.block_tokens, width = config.token_width();
  kv_block_pool pool = kv_block_pool::for_caches(config);
  asio::thread_pool io(2);
  tracked parent = make_written(io, pool, 4 * bt);
  tracked child = parent.fork();
  child.write(bt + 1, 7);  // block 1 copied: the child's alone, elsewhere
  const auto runs_of = [&](const tracked& t) {
    std::vector<std::pair<std::size_t, std::size_t>> runs;
    std::size_t not_adjacent = 0;
    const kv_snapshot snap = t.cache.snapshot();
    REQUIRE_FALSE(snap.for_each_block(0, snap.size(), [&](std::size_t first, std::size_t n, auto k, auto v) {
      runs.emplace_back(first, n);
      // Within a run, token i's keys (values) follow token i - 1's.
      if (k.size() != n * width || v.size() != n * width) ++not_adjacent;
    }));
    CHECK(not_adjacent == 0);
    return runs;
  };
  using runs = std::vector<std::pair<std::size_t, std::size_t>>;
  CHECK(runs_of(parent) == runs{{0, 4 * bt}});
  CHECK(runs_of(child) == runs{{0, bt}, {bt, bt}, {2 * bt, 2 * bt}});
  CHECK(parent.diff() == "");
  CHECK(child.diff() == "");
}

TEST_CASE("caches filled at once from two threads each find their blocks in runs of whole extents", "[block_pool]") {
  const bool with_resource = GENERATE(false, true);
  INFO(kind_name(with_resource));
  kv_cache_config config = config_for(with_resource);
  config.max_tokens_per_seq = 8192;
  const std::size_t bt = config.block_tokens;
  kv_block_pool pool = pool_for(config, with_resource);
  const std::size_t slots = pool.blocks_per_extent();
  const std::size_t blocks = 5 * slots + 3;  // 5 whole extents and part of one
  asio::thread_pool io(2);
  constexpr std::size_t caches = 6;
  std::vector<tracked> t = make_caches(io, pool, config, caches);
  // Token by token, every cache's write started before any is awaited: the
  // actors allocate on both threads at once, interleaved.
  for (std::size_t token = 0; token < blocks * bt; ++token) {
    std::vector<std::future<void>> writes;
    std::vector<batch_data> data;
    data.reserve(caches);
    for (std::size_t i = 0; i < caches; ++i) {
      data.emplace_back(config.token_width(), token, token + 1, static_cast<int>(i + 1));
      writes.push_back(t[i].cache.async_write_batch(data.back().entries, asio::use_future));
      t[i].expected.write(token, token + 1, static_cast<int>(i + 1));
    }
    for (auto& w : writes) w.get();
  }
  for (std::size_t i = 0; i < caches; ++i) {
    std::size_t runs = 0;
    const kv_snapshot snap = t[i].cache.snapshot();
    REQUIRE_FALSE(snap.for_each_block(0, snap.size(), [&](auto, auto, auto, auto) { ++runs; }));
    INFO("cache " << i << ": " << runs << " runs of " << blocks << " blocks");
    CHECK(runs == blocks_for(blocks, slots));
    CHECK(t[i].diff() == "");
  }
  // Memory: the blocks in whole extents (each cache's last one part used)
  // and the zero blocks; reserved, the blocks alone.
  if (with_resource)
    CHECK(pool.stats().blocks_allocated == caches * blocks_for(blocks, slots) * slots + caches);
  else
    CHECK(pool.stats().blocks_allocated == caches * blocks);
}

TEST_CASE("a budget not a multiple of an extent is reached exactly, from slots any cache freed", "[block_pool]") {
  const bool with_resource = GENERATE(false, true);
  INFO(kind_name(with_resource));
  kv_cache_config config = config_for(with_resource);
  config.max_tokens_per_seq = 4096;
  const std::size_t bt = config.block_tokens;
  const std::size_t slots = with_resource ? kv_block_pool::extent_blocks : kv_block_pool::reserved_extent_blocks;
  const std::size_t budget = slots + slots / 2 + 1;
  kv_block_pool pool = pool_for(config, with_resource, {.max_blocks = budget});
  asio::thread_pool io(2);
  tracked a{layer_kv_cache(io, config, pool), {}}, b{layer_kv_cache(io, config, pool), {}};
  a.initialize(1);
  b.initialize(1);
  // Block by block, in turn, until the budget is spent.
  std::size_t held = 0;
  for (std::size_t i = 0; held < budget; ++i) {
    tracked& c = i % 2 == 0 ? a : b;
    c.write(c.expected.stored, c.expected.stored + bt, static_cast<int>(i + 1));
    ++held;
  }
  CHECK(pool.stats().blocks_in_use == budget);
  CHECK(write(a.cache, a.expected.stored, a.expected.stored + 1, 99) == kv_errc::capacity_exhausted);
  CHECK(pool.stats().blocks_allocated <= blocks_for(budget, slots) * slots + 2);  // + the zero blocks
  // b's blocks, freed, are a's to take: no more memory (with a resource);
  // reserved, a fills fresh slots of its extents while the pool keeps up
  // to an extent's worth of freed slots.
  const std::uint64_t allocated = pool.stats().blocks_allocated;
  const std::size_t freed = blocks_for(b.expected.stored, bt);
  b.truncate(0);
  for (std::size_t i = 0; i < freed; ++i) a.write(a.expected.stored, a.expected.stored + bt, 100 + static_cast<int>(i));
  CHECK(pool.stats().blocks_in_use == budget);
  if (with_resource)
    CHECK(pool.stats().blocks_allocated == allocated);
  else
    CHECK(pool.stats().blocks_allocated <= budget + slots);
  CHECK(write(a.cache, a.expected.stored, a.expected.stored + 1, 99) == kv_errc::capacity_exhausted);
  CHECK(a.diff() == "");
  CHECK(b.diff() == "");
}

TEST_CASE("a cache that appends and rolls back again and again holds at most two extents", "[block_pool]") {
  kv_cache_config config = small_config();
  config.max_tokens_per_seq = 64;
  const std::size_t bt = config.block_tokens;
  kv_block_pool pool = kv_block_pool::for_caches(config);
  asio::thread_pool io(2);
  tracked c = make_written(io, pool, bt);
  for (int cycle = 0; cycle < 200; ++cycle) {
    const kv_snapshot pin = c.cache.snapshot();  // so the appended blocks are fresh ones, never rewritten in place
    c.write(bt, 3 * bt, cycle + 2);
    c.truncate(bt);
  }
  INFO("allocated " << pool.stats().blocks_allocated << ", free " << pool.stats().blocks_free);
  const std::size_t slots = pool.blocks_per_extent();
  CHECK(pool.stats().blocks_allocated <= 2 * slots + 1);
  CHECK(c.diff() == "");
}

TEST_CASE("blocks referenced by a fork or by a pinned older epoch count as shared until one side lets go",
          "[block_pool]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens, blocks = 3;
  kv_block_pool pool = kv_block_pool::for_caches(config);
  asio::thread_pool io(2);
  tracked c{layer_kv_cache(io, config, pool), {}};
  c.initialize(1);
  c.write(0, blocks * bt, 1);
  CHECK(pool.stats().blocks_shared == 0);
  {
    // A pinned epoch and the new one share every block but the one rewritten.
    kv_snapshot pinned = c.cache.snapshot();
    c.write(0, 2);
    INFO("in use " << pool.stats().blocks_in_use << ", shared " << pool.stats().blocks_shared);
    CHECK(pool.stats().blocks_shared == blocks - 1);
    CHECK(pool.stats().blocks_in_use == blocks + 1);
  }
  CHECK(pool.stats().blocks_shared == 0);
  CHECK(pool.stats().blocks_in_use == blocks);
  {
    tracked child = c.fork();
    CHECK(pool.stats().blocks_shared == blocks);
    CHECK(pool.stats().blocks_in_use == blocks);
    CHECK(child.diff() == "");
  }
  CHECK(pool.stats().blocks_shared == 0);
  CHECK(pool.stats().blocks_in_use == blocks);
}

TEST_CASE("a snapshot pins its blocks after a truncate and after its cache is gone, until it is released",
          "[block_pool]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens, blocks = 3;
  kv_block_pool pool = kv_block_pool::for_caches(config);
  {
    asio::thread_pool io(2);
    tracked c{layer_kv_cache(io, config, pool), {}};
    c.initialize(1);
    c.write(0, blocks * bt, 1);
    const model written = c.expected;
    kv_snapshot snap = c.cache.snapshot();
    c.truncate(0);
    CHECK(c.cache.size() == 0);
    CHECK(pool.stats().blocks_in_use == blocks);
    CHECK(diff(snap, written) == "");
    c.cache = layer_kv_cache{};
    CHECK(pool.stats().blocks_in_use == blocks);
    CHECK(diff(snap, written) == "");
    snap = kv_snapshot{};
    CHECK(pool.stats().blocks_in_use == 0);
  }
  // The cache's zero block too is back once its executor has wound down
  // (a drain may still hold the cache for a moment after its last handler ran).
  CHECK(pool.stats().blocks_in_use == 0);
  CHECK(pool.stats().blocks_free == pool.stats().blocks_allocated);
}

TEST_CASE("blocks_in_use returns to zero once every cache, fork and snapshot is gone while the pool handle lives",
          "[block_pool]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens;
  kv_block_pool pool = kv_block_pool::for_caches(config);
  {
    asio::thread_pool io(2);
    tracked a{layer_kv_cache(io, config, pool), {}};
    tracked b{layer_kv_cache(io, config, pool), {}};
    a.initialize(1);
    b.initialize(config.max_tokens_per_seq);
    a.write(0, 2 * bt + 1, 1);
    b.write(bt, 2 * bt, 2);
    tracked child = a.fork();
    child.write(1, 3);
    kv_snapshot pin_a = a.cache.snapshot(), pin_child = child.cache.snapshot();
    a.truncate(1);
    a.write(3 * bt, 4);
    CHECK(pool.stats().blocks_in_use > 0);
    CHECK(a.diff() == "");
    CHECK(b.diff() == "");
    CHECK(child.diff() == "");
  }
  const kv_pool_stats s = pool.stats();
  INFO("in use " << s.blocks_in_use << ", shared " << s.blocks_shared << ", free " << s.blocks_free << ", allocated "
                 << s.blocks_allocated);
  CHECK(s.blocks_in_use == 0);
  CHECK(s.blocks_shared == 0);
  CHECK(s.blocks_free == s.blocks_allocated);
  CHECK(s.peak_blocks_in_use > 0);
  pool.trim();
  CHECK(pool.stats().blocks_allocated == 0);
  CHECK(pool.stats().blocks_free == 0);
}

TEST_CASE("with the pool full a write into a block shared with a fork fails and changes neither side", "[block_pool]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens, budget = 2;
  const kv_block_pool pool = kv_block_pool::for_caches(config, {.max_blocks = budget});
  asio::thread_pool io(2);
  tracked parent{layer_kv_cache(io, config, pool), {}};
  parent.initialize(1);
  parent.write(0, budget * bt, 1);
  tracked child = parent.fork();  // takes no block
  CHECK(pool.stats().blocks_in_use == budget);

  const observed parent_before = observe(parent.cache), child_before = observe(child.cache);
  CHECK(write(child.cache, 1, 2, 2) == kv_errc::capacity_exhausted);
  CHECK(write(parent.cache, 1, 2, 2) == kv_errc::capacity_exhausted);
  CHECK(observe(parent.cache) == parent_before);
  CHECK(observe(child.cache) == child_before);

  // The parent dropping a block the child still holds frees nothing.
  parent.truncate(bt);
  CHECK(pool.stats().blocks_in_use == budget);
  child.truncate(bt);
  CHECK(pool.stats().blocks_in_use == budget - 1);
  child.write(1, 2);  // copies block 0: the last block of the budget
  CHECK(pool.stats().blocks_in_use == budget);
  CHECK(parent.diff() == "");
  CHECK(child.diff() == "");
}

TEST_CASE("caches on two threads competing for one budget never exceed it and keep exactly their successful writes",
          "[block_pool][concurrency]") {
  const kv_cache_config config = small_config();
  const std::size_t bt = config.block_tokens, max = config.max_tokens_per_seq;
  const std::size_t budget = blocks_for(max, bt) + 2;  // less than two full caches need
  constexpr int rounds = 60;
  const kv_block_pool pool = kv_block_pool::for_caches(config, {.max_blocks = budget});
  struct outcome {
    model expected;
    int ok = 0, exhausted = 0, other = 0;
  };
  asio::thread_pool io(2);
  layer_kv_cache caches[2] = {layer_kv_cache(io, config, pool), layer_kv_cache(io, config, pool)};
  for (auto& c : caches) REQUIRE_FALSE(blocking{c}.initialize(1));

  // Each round writes a prefix of a length that cycles through 1..max, then
  // truncates to a shorter one; the model follows only what succeeded.
  auto worker = [&](std::size_t id) -> asio::awaitable<outcome> {
    outcome out;
    out.expected.initialize(1);
    layer_kv_cache& cache = caches[id];
    const std::size_t w = config.token_width();
    for (int round = 1; round <= rounds; ++round) {
      const std::size_t len = (static_cast<std::size_t>(round) * 5 + id * 3) % max + 1;
      const int tag = round + static_cast<int>(id) * rounds;
      const batch_data batch(w, 0, len, tag);
      auto [ec] = co_await cache.async_write_batch(batch.entries, as_tuple(asio::use_awaitable));
      if (!ec) {
        ++out.ok;
        out.expected.write(0, len, tag);
      } else {
        ++(ec == kv_errc::capacity_exhausted ? out.exhausted : out.other);
      }
      const std::size_t keep = static_cast<std::size_t>(round) % (len + 1);
      auto [tec] = co_await cache.async_truncate(keep, as_tuple(asio::use_awaitable));
      if (!tec)
        out.expected.truncate(keep);
      else
        ++out.other;
    }
    co_return out;
  };
  auto f0 = asio::co_spawn(io, worker(0), asio::use_future);
  auto f1 = asio::co_spawn(io, worker(1), asio::use_future);
  f0.wait();
  f1.wait();
  const outcome results[2] = {f0.get(), f1.get()};

  std::size_t in_use = 0;
  for (std::size_t id = 0; id < 2; ++id) {
    INFO("cache " << id << ": " << results[id].ok << " batches stored, " << results[id].exhausted << " exhausted, "
                  << results[id].other << " other errors");
    CHECK(results[id].other == 0);
    CHECK(results[id].ok > 0);
    CHECK(diff(caches[id], results[id].expected) == "");
    in_use += blocks_for(results[id].expected.stored, bt);
  }
  const kv_pool_stats s = pool.stats();
  INFO("peak " << s.peak_blocks_in_use << ", budget " << budget);
  CHECK(s.peak_blocks_in_use <= budget);
  CHECK(s.blocks_in_use == in_use);
}

TEST_CASE("blocks shared by a fork are freed exactly once when both sides let go on two threads at once",
          "[block_pool][concurrency]") {
  // Regression: block::release once read its pool after giving up its
  // reference, racing the other side's destruction of the block (TSan and
  // ASan saw it). Each round ends with both sides' last pins released at the
  // same instant from two threads.
  const kv_cache_config config = small_config();  // 4 tokens per block
  const std::size_t width = config.token_width();
  const auto token = token_pattern(width, 1, 1);
  for (int round = 0; round < 200; ++round) {
    INFO("round " << round);
    const auto pool = kv_block_pool::for_caches(config);
    kv_snapshot parent_pin, child_pin;
    {
      asio::io_context io;
      layer_kv_cache parent(io, config, pool), child;
      parent.async_initialize(1, [](ghostlink::error_code) {});
      for (std::size_t i = 0; i < 6; ++i) parent.async_write(i, token, token, [](ghostlink::error_code) {});
      parent.async_fork([&](ghostlink::error_code ec, layer_kv_cache c) {
        REQUIRE_FALSE(ec);
        child = std::move(c);
      });
      io.run();
      parent_pin = parent.snapshot();
      child_pin = child.snapshot();
    }
    REQUIRE(pool.stats().blocks_in_use == 2);
    REQUIRE(pool.stats().blocks_shared == 2);
    std::latch go(2);
    std::thread a([&] {
      go.arrive_and_wait();
      parent_pin = {};
    });
    std::thread b([&] {
      go.arrive_and_wait();
      child_pin = {};
    });
    a.join();
    b.join();
    CHECK(pool.stats().blocks_in_use == 0);
    CHECK(pool.stats().blocks_shared == 0);
  }
}

}  // namespace block_pool_tests

TEST_CASE("trim() on one thread while another frees the last block of extents frees each extent once, after its free",
          "[block_pool][concurrency]") {
  using namespace ghostlink::detail;
  auto pool = ref_ptr<block_pool>::adopt(new block_pool(std::size_t{2} * 4 * sizeof(float), SIZE_MAX));
  std::atomic<bool> done{false};
  std::latch start(2);
  std::size_t trims = 0;
  std::thread trimmer([&] {
    start.arrive_and_wait();
    // Bounded: the freeing thread stops after a fixed count, then so does this.
    while (!done.load(std::memory_order_acquire)) {
      pool->trim();
      ++trims;
    }
  });
  start.arrive_and_wait();
  std::size_t wrong = 0;
  for (int round = 0; round < 2000; ++round) {
    std::vector<ref_ptr<block>> blocks;
    {
      block_cursor cursor(*pool);
      for (int i = 0; i < 3; ++i) {
        blocks.push_back(block::make(*pool, cursor, 1));
        REQUIRE(blocks.back());
        *reinterpret_cast<int*>(blocks.back()->keys()) = round;
      }
    }  // no cursor fills the extent now: the last free below leaves it unused
    for (const ref_ptr<block>& b : blocks) wrong += *reinterpret_cast<const int*>(b->keys()) != round ? 1 : 0;
    blocks.clear();
  }
  done.store(true, std::memory_order_release);
  trimmer.join();
  CHECK(wrong == 0);
  CHECK(trims > 0);
  CHECK(pool->blocks_in_use() == 0);
  pool->trim();
  CHECK(pool->census().extents == 0);
  CHECK(pool->blocks_allocated() == 0);
}
