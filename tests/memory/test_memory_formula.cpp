// What memory a cache costs (kv_block_pool's class comment): its blocks,
// the last one partly filled, plus a share of fixed overhead; counted by the
// pool's stats, by the kernel (reserved extents) and by the memory resource
// (a pool given one), and every token exact.
#include "common/pool_support.hpp"

#include "common/asio_compat.hpp"
#include "common/counting_resource.hpp"
#include "testing/hooks.hpp"

#include <unistd.h>

#include <atomic>
#include <latch>
#include <memory>
#include <random>
#include <thread>

namespace memory_formula_tests {

using namespace ghostlink;
using namespace ghostlink::test::pool;
using ghostlink::test::counting_resource;

namespace {

/// 16-token blocks of 4 x 64 floats: a block's keys (and its values) are
/// 16 KiB, whole pages, so a freed block's pages can go back on their own.
kv_cache_config paged_config() {
  return {.max_tokens_per_seq = 4096, .num_heads = 4, .head_dim = 64, .block_tokens = 16};
}

std::size_t page_bytes() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

/// The headers of `extents` reserved extents: two pages each at most.
std::size_t header_bytes(std::size_t extents) { return extents * 2 * page_bytes(); }
/// The header of a cache's block of zeros (reserved: its payload is no
/// memory), in an allocation of two cache lines.
constexpr std::size_t zero_header_bytes = 128;

}  // namespace

TEST_CASE("one token in each of 64 caches costs one block each, and pages only as far as written", "[memory_formula]") {
  const kv_cache_config config = paged_config();
  constexpr std::size_t caches = 64;
  counting_resource counted;
  const bool with_resource = GENERATE(false, true);
  INFO(kind_name(with_resource));
  kv_block_pool pool = pool_for(config, with_resource, {.memory = with_resource ? &counted : nullptr});
  const std::size_t block = pool.block_bytes();
  {
    asio::thread_pool io(2);
    std::vector<tracked> t = make_caches(io, pool, config, caches);
    for (std::size_t i = 0; i < caches; ++i) t[i].write(0, static_cast<int>(i + 1));
    const kv_pool_stats s = pool.stats();
    INFO("allocated " << s.blocks_allocated << " blocks, " << s.bytes_allocated << " bytes; block " << block);
    CHECK(s.blocks_in_use == caches);
    if (with_resource) {
      // A whole extent of 16 per cache, and its block of zeros: what the
      // resource gave, to the byte.
      CHECK(s.blocks_allocated == caches * (kv_block_pool::extent_blocks + 1));
      CHECK(counted.read().live_bytes == s.bytes_allocated);
    } else {
      // One block per cache, and its extent's headers; the kernel counts
      // no more, and at least the page of keys and the page of values each
      // token was written to.
      CHECK(s.blocks_allocated == caches);
      CHECK(s.blocks_free == 0);
      CHECK(s.bytes_allocated <= caches * (block + zero_header_bytes) + header_bytes(caches));
      const std::size_t resident = ghostlink::detail::resident_bytes(pool);
      INFO("resident " << resident);
      CHECK(resident <= s.bytes_allocated);
      CHECK(resident >= caches * 2 * page_bytes());
      CHECK(resident <= caches * (2 * page_bytes() + header_bytes(1)));
    }
    for (const tracked& c : t) CHECK(c.diff() == "");
  }
  pool.trim();
  CHECK(pool.stats().blocks_allocated == 0);
  if (with_resource) CHECK(counted.read().live_bytes == 0);
}

TEST_CASE("memory stays within the formula through random appends and truncates on 2 threads, every token exact",
          "[memory_formula]") {
  const kv_cache_config config = paged_config();
  const std::size_t bt = config.block_tokens;
  constexpr std::size_t caches = 16, rounds = 24, ops = 12;
  counting_resource counted;
  const bool with_resource = GENERATE(false, true);
  INFO(kind_name(with_resource));
  kv_block_pool pool = pool_for(config, with_resource, {.memory = with_resource ? &counted : nullptr});
  const std::size_t extent = pool.blocks_per_extent();
  asio::thread_pool io(2);
  std::vector<tracked> t = make_caches(io, pool, config, caches);
  for (std::size_t round = 0; round < rounds; ++round) {
    // Two threads, each appending to and truncating half of the caches
    // (Catch2 asserts on this thread alone: the other counts its errors).
    std::latch start(2);
    std::atomic<std::size_t> errors{0};
    const auto drive = [&](std::size_t first) {
      std::mt19937 rng(static_cast<unsigned>(round * 2 + first));
      start.arrive_and_wait();
      for (std::size_t op = 0; op < ops; ++op) {
        tracked& c = t[first + 2 * (rng() % (caches / 2))];
        const std::size_t size = c.expected.size();
        if (rng() % 3 != 0 && size + 80 <= config.max_tokens_per_seq) {
          const std::size_t end = size + 1 + rng() % 80;
          const int tag = static_cast<int>(round * ops + op + 1);
          if (write(c.cache, size, end, tag)) ++errors;
          c.expected.write(size, end, tag);
        } else {
          const std::size_t n = size == 0 ? 0 : rng() % size;
          if (truncate(c.cache, n)) ++errors;
          c.expected.truncate(n);
        }
      }
    };
    std::thread other(drive, 1);
    drive(0);
    other.join();
    REQUIRE(errors == 0);

    std::size_t needed = 0;  // blocks the tokens need
    for (const tracked& c : t) {
      CHECK(c.diff() == "");
      needed += blocks_for(c.expected.stored, bt);
    }
    const kv_pool_stats s = pool.stats();
    INFO("round " << round << ": blocks needed " << needed << ", in use " << s.blocks_in_use << ", free "
                  << s.blocks_free << ", allocated " << s.blocks_allocated);
    REQUIRE(s.blocks_in_use == needed);
    if (with_resource) {
      // Whole extents: the most blocks in use at once rounded up to them,
      // up to one per cache filling one (plus one) beyond, and the blocks
      // of zeros; what the resource gave, to the byte.
      CHECK(s.blocks_allocated <= s.peak_blocks_in_use + extent * (caches + 2) + caches);
      CHECK(counted.read().live_bytes == s.bytes_allocated);
    } else {
      // The blocks, and the freed blocks the pool keeps for reuse: no more
      // than the most in use at once (and the extent's worth it keeps
      // always); the kernel counts no more than the stats.
      CHECK(s.blocks_allocated == s.blocks_in_use + s.blocks_free);
      CHECK(s.blocks_allocated <= s.peak_blocks_in_use + extent);
      CHECK(ghostlink::detail::resident_bytes(pool) <= s.bytes_allocated);
    }
  }
}

TEST_CASE("trim gives back the pages of every free block of reserved extents, and nothing a cache still reads",
          "[memory_formula]") {
  const kv_cache_config config = paged_config();
  const std::size_t bt = config.block_tokens;
  kv_block_pool pool = pool_for(config, false);
  asio::thread_pool io(2);
  tracked a = make_written(io, pool, 40 * bt, config), b = make_written(io, pool, 30 * bt, config);
  b.truncate(3 * bt + 1);  // 26 blocks freed: kept, fewer than an extent's worth
  kv_pool_stats s = pool.stats();
  CHECK(s.blocks_in_use == 44);
  CHECK(s.blocks_free == 26);
  pool.trim();
  s = pool.stats();
  CHECK(s.blocks_free == 0);
  CHECK(s.blocks_allocated == 44);
  const std::size_t resident = ghostlink::detail::resident_bytes(pool);
  INFO("resident " << resident << ", allocated " << s.bytes_allocated);
  CHECK(resident <= s.bytes_allocated);
  // Written again, into the released slots or others: every token exact.
  b.write(3 * bt + 1, 20 * bt, 7);
  a.truncate(5);
  CHECK(a.diff() == "");
  CHECK(b.diff() == "");
}

TEST_CASE("a pool that shrinks gives back extents left with no block; one that serves steadily reuses their memory",
          "[memory_formula]") {
  const kv_cache_config config = paged_config();
  const std::size_t bt = config.block_tokens;
  kv_block_pool pool = pool_for(config, false);
  const std::size_t extent = pool.blocks_per_extent();
  // Three caches of one whole extent each, each on a thread of its own so
  // that destroying one and joining its thread frees its blocks.
  struct one {
    std::unique_ptr<asio::thread_pool> io = std::make_unique<asio::thread_pool>(1);
    tracked t;
  };
  std::vector<one> caches;
  for (int i = 0; i < 3; ++i) {
    auto io = std::make_unique<asio::thread_pool>(1);
    tracked t = make_written(*io, pool, extent * bt, config);
    caches.push_back({std::move(io), std::move(t)});
  }
  const auto destroy = [&](std::size_t i) {
    caches[i].t.cache = layer_kv_cache{};
    caches[i].io->join();
  };
  CHECK(pool.stats().blocks_allocated == 3 * extent);
  // One destroyed: its extent's blocks are the 64 free blocks the pool
  // keeps, no more than it has in use.
  destroy(0);
  CHECK(pool.stats().blocks_in_use == 2 * extent);
  CHECK(pool.stats().blocks_allocated == 3 * extent);
  // Another: free blocks would outnumber those in use, so the extent left
  // with no block gives its memory back.
  destroy(1);
  kv_pool_stats s = pool.stats();
  CHECK(s.blocks_in_use == extent);
  CHECK(s.blocks_free == extent);
  CHECK(s.blocks_allocated == 2 * extent);
  CHECK(ghostlink::detail::resident_bytes(pool) <= s.bytes_allocated);
  // A new cache of the same size takes the kept memory: nothing new.
  asio::thread_pool io(1);
  tracked fresh = make_written(io, pool, extent * bt, config);
  s = pool.stats();
  CHECK(s.blocks_in_use == 2 * extent);
  CHECK(s.blocks_allocated == 2 * extent);
  CHECK(s.blocks_free == 0);
  CHECK(fresh.diff() == "");
  CHECK(caches[2].t.diff() == "");
}

}  // namespace memory_formula_tests
