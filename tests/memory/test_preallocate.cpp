// kv_block_pool::preallocate: the pool's memory allocated and written up
// front, used by caches before the pool grows, within its limits, returned
// by trim(), and safe beside allocations on other threads.
#include "common/pool_support.hpp"

#include "common/asio_compat.hpp"
#include "testing/hooks.hpp"

#include <sys/resource.h>
#include <unistd.h>
#include <fstream>
#include <new>

namespace preallocate_tests {

using namespace ghostlink;
using namespace ghostlink::test::pool;
using ghostlink::test::small_config;

namespace {

/// The process's resident bytes now (Linux: /proc/self/statm).
std::size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::size_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

/// Page faults this thread has taken so far (minor and major).
long thread_page_faults() {
  rusage usage{};
  REQUIRE(::getrusage(RUSAGE_THREAD, &usage) == 0);
  return usage.ru_minflt + usage.ru_majflt;
}

}  // namespace

TEST_CASE("preallocate makes free memory for at least the blocks asked, in whole extents, with no budget taken",
          "[preallocate]") {
  const bool with_resource = GENERATE(false, true);
  INFO(kind_name(with_resource));
  kv_block_pool pool = pool_for(config_for(with_resource), with_resource, {.max_blocks = 1000});
  const std::size_t slots = pool.blocks_per_extent();
  // Memory for `asked` blocks: whole extents with a resource; reserved,
  // the slots asked for alone (in as many extents).
  const auto held = [&](std::size_t asked) { return with_resource ? blocks_for(asked, slots) * slots : asked; };
  const std::size_t available = pool.blocks_available();
  pool.preallocate(2 * slots + 1);
  kv_pool_stats s = pool.stats();
  CHECK(s.blocks_allocated == held(2 * slots + 1));
  CHECK(s.blocks_free == held(2 * slots + 1));
  CHECK(s.blocks_in_use == 0);
  CHECK(s.blocks_reserved == 0);
  CHECK(pool.blocks_available() == available);
  CHECK(ghostlink::detail::census(pool).extents == 3);
  CHECK(ghostlink::detail::census(pool).unused == 3);
  // What it holds already counts: asking for as much or less adds nothing.
  pool.preallocate(held(2 * slots + 1));
  pool.preallocate(1);
  pool.preallocate(0);
  CHECK(pool.stats().blocks_allocated == held(2 * slots + 1));
  // More: only what is missing.
  pool.preallocate(4 * slots);
  s = pool.stats();
  CHECK(s.blocks_allocated == 4 * slots);
  CHECK(s.blocks_free == 4 * slots);
}

TEST_CASE("caches take their blocks from preallocated memory, and the pool grows only past it", "[preallocate]") {
  const bool with_resource = GENERATE(false, true);
  INFO(kind_name(with_resource));
  kv_cache_config config = config_for(with_resource);
  config.max_tokens_per_seq = 8192;
  const std::size_t bt = config.block_tokens;
  kv_block_pool pool = pool_for(config, with_resource);
  const std::size_t slots = pool.blocks_per_extent(), zeros = zero_blocks(pool);
  pool.preallocate(3 * slots);
  asio::thread_pool io(2);
  tracked a{layer_kv_cache(io, config, pool), {}}, b{layer_kv_cache(io, config, pool), {}};
  a.initialize(1);
  b.initialize(1);
  // Two extents' blocks in one cache, one in another: all three extents
  // used, none added (only each cache's block of zeros is new memory).
  a.write(0, 2 * slots * bt, 1);
  b.write(0, slots * bt, 2);
  kv_pool_stats s = pool.stats();
  CHECK(s.blocks_in_use == 3 * slots);
  CHECK(s.blocks_allocated == 3 * slots + 2 * zeros);
  CHECK(s.blocks_free == 0);
  CHECK(ghostlink::detail::census(pool).extents == 3);
  // One block more: a new extent, as without preallocate (reserved: of
  // which that block alone is memory).
  b.write(slots * bt, slots * bt + 1, 3);
  CHECK(pool.stats().blocks_allocated == (with_resource ? 4 * slots : 3 * slots + 1) + 2 * zeros);
  CHECK(ghostlink::detail::census(pool).extents == 4);
  CHECK(a.diff() == "");
  CHECK(b.diff() == "");
}

TEST_CASE("preallocate past the pool's limits throws capacity_exhausted and allocates nothing; up to them it succeeds",
          "[preallocate]") {
  // A budget of 20 blocks: the pool grows to one extent's worth past it at
  // most (with a resource, 2 extents of 16; reserved, one of 64).
  const bool with_resource = GENERATE(false, true);
  INFO(kind_name(with_resource));
  kv_block_pool pool = pool_for(config_for(with_resource), with_resource, {.max_blocks = 20});
  const std::size_t slots = pool.blocks_per_extent(), most = blocks_for(20, slots) * slots;
  CHECK(thrown_by([&] { pool.preallocate(most + 1); }) == kv_errc::capacity_exhausted);
  std::error_code ec;
  pool.preallocate(1000, ec);
  CHECK(ec == kv_errc::capacity_exhausted);
  CHECK(pool.stats().blocks_allocated == 0);
  CHECK(ghostlink::detail::census(pool).extents == 0);
  pool.preallocate(most, ec);
  CHECK_FALSE(ec);
  CHECK(pool.stats().blocks_allocated == most);
  // The budget still counts blocks in use, not memory: 20 at most.
  CHECK(pool.blocks_available() == 20);
}

TEST_CASE("when the system has no memory preallocate throws bad_alloc, keeps what it added free, and trim returns it",
          "[preallocate]") {
  kv_block_pool pool = pool_for(config_for(false), false);
  const std::size_t slots = pool.blocks_per_extent();
  pool.preallocate(slots);
  ghostlink::detail::fail_next_allocations(pool, 1);
  CHECK_THROWS_AS(pool.preallocate(4 * slots), std::bad_alloc);
  CHECK(pool.stats().blocks_allocated == slots);
  ghostlink::detail::fail_next_allocations(pool, 1);
  std::error_code ec;
  pool.preallocate(4 * slots, ec);
  CHECK(ec == std::errc::not_enough_memory);
  CHECK(pool.stats().blocks_allocated == slots);
  CHECK(pool.stats().blocks_free == slots);
  pool.trim();
  CHECK(pool.stats().blocks_allocated == 0);
  CHECK(ghostlink::detail::census(pool).extents == 0);
}

TEST_CASE("preallocate writes every page up front: a cache then fills a block of it without a page fault",
          "[preallocate]") {
  // 4 MiB blocks: an extent of 64 MiB, past the largest size glibc's
  // malloc serves from its heap, so fresh pages from the system.
  const kv_cache_config config{.max_tokens_per_seq = 512, .num_heads = 8, .head_dim = 128, .block_tokens = 512};
  kv_block_pool pool = kv_block_pool::for_caches(config);
  // Reserved extents: the one block asked for is written; with a resource
  // it would be a whole extent.
  const std::size_t written = (reserved(pool) ? 1 : slots) * pool.block_bytes();
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t before = resident_bytes();
  pool.preallocate(1);
  const std::size_t after = resident_bytes();
  INFO("resident before " << before << ", after " << after << ", written " << written);
  CHECK(after >= before + written);
  // One block of tokens written by a cache this thread runs: counted in
  // this thread's page faults (untouched, its 1024 pages would each fault).
  asio::io_context io;
  layer_kv_cache cache(io, config, pool);
  const batch_data batch(config.token_width(), 0, config.block_tokens, 1);
  cache.async_initialize(1, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  io.run();
  io.restart();
  const long faults_before = thread_page_faults();
  cache.async_write_batch(batch.entries, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  io.run();
  const long faults = thread_page_faults() - faults_before;
  INFO(faults << " page faults writing a block of " << pool.block_bytes() / page << " pages");
  CHECK(faults < static_cast<long>(pool.block_bytes() / page / 8));
  CHECK(pool.stats().blocks_allocated == written / pool.block_bytes() + zero_blocks(pool));
  model expected;
  expected.initialize(1);
  expected.write(0, config.block_tokens, 1);
  CHECK(diff(cache, expected) == "");
}

TEST_CASE("preallocate on one thread while caches allocate and free on two others: every token kept, memory in whole "
          "extents, all of it returned",
          "[preallocate]") {
  kv_cache_config config = paged(small_config());
  config.max_tokens_per_seq = 4096;
  kv_block_pool pool = kv_block_pool::for_caches(config);
  const std::size_t slots = pool.blocks_per_extent(), zeros = zero_blocks(pool);
  constexpr std::size_t caches = 4;
  rounds_beside(
      pool, config, caches, 6, 3 * slots + 5,
      [&] {
        for (std::size_t n = 1; n <= 64; ++n) pool.preallocate(n * slots / 2);
      },
      [] {},
      [&] {
        const kv_pool_stats s = pool.stats();
        CHECK(s.blocks_allocated >= 32 * slots);
        if (!reserved(pool))  // reserved, an extent's slots are memory only once used
          CHECK(s.blocks_allocated == ghostlink::detail::census(pool).extents * slots + caches * zeros);
        CHECK(s.blocks_free + s.blocks_in_use + caches * zeros == s.blocks_allocated);
      });
  pool.trim();
  CHECK(pool.stats().blocks_in_use == 0);
  CHECK(pool.stats().blocks_allocated == 0);
}

}  // namespace preallocate_tests
