// kv_pool_limits::memory: a pool's memory from a resource the user gives:
// every extent and block of zeros taken from it, aligned, given back whole;
// a resource that throws is memory running out, and nothing is stored.
#include "common/pool_support.hpp"

#include "common/counting_resource.hpp"

#include "common/asio_compat.hpp"
#include "testing/hooks.hpp"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory_resource>
#include <mutex>
#include <new>
#include <stdexcept>
#include <type_traits>
#include <utility>

namespace pool_memory_tests {

using namespace ghostlink;
using namespace ghostlink::test::pool;
using ghostlink::test::counting_resource;
using ghostlink::test::small_config;

namespace {

/// Gives no memory: every allocation throws an `E`.
template <class E>
class refusing_resource final : public std::pmr::memory_resource {
 public:
  std::size_t refused() const noexcept { return refused_.load(); }

 private:
  void* do_allocate(std::size_t, std::size_t) override {
    refused_.fetch_add(1);
    if constexpr (std::is_same_v<E, std::runtime_error>)
      throw E("no memory here");
    else
      throw E();
  }
  void do_deallocate(void*, std::size_t, std::size_t) override {}
  bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override { return this == &other; }

  std::atomic<std::size_t> refused_{0};
};

}  // namespace

TEST_CASE(
    "a pool takes its extents and blocks of zeros from kv_pool_limits::memory, aligned, and gives every byte back",
    "[pool_memory]") {
  counting_resource memory;
  kv_cache_config config = small_config();
  config.max_tokens_per_seq = 4096;
  const std::size_t bt = config.block_tokens;
  {
    kv_block_pool pool = kv_block_pool::for_caches(config, {.memory = &memory});
    pool.preallocate(2 * slots);
    CHECK(memory.read().allocations == 2);
    CHECK(memory.read().live_bytes >= 2 * slots * pool.block_bytes());
    asio::thread_pool io(2);
    tracked a{layer_kv_cache(io, config, pool), {}};
    a.initialize(1);
    a.write(0, 2 * slots * bt, 1);  // both extents, and the cache's block of zeros
    CHECK(memory.read().allocations == 2 + zero_blocks_per_cache);
    a.write(2 * slots * bt, 2 * slots * bt + 1, 2);  // one block more: a third extent, from the resource too
    CHECK(memory.read().allocations == 3 + zero_blocks_per_cache);
    CHECK(ghostlink::detail::census(pool).extents == 3);
    CHECK(a.diff() == "");
    // Freed blocks stay the pool's; trim() gives their extents back.
    const std::size_t before = memory.read().live_bytes;
    a.truncate(1);
    pool.trim();
    CHECK(memory.read().live_bytes < before);
    CHECK(ghostlink::detail::census(pool).extents < 3);
    CHECK(a.diff() == "");
  }
  CHECK(memory.read().live_bytes == 0);
  CHECK(memory.read().misaligned == 0);
  CHECK(memory.read().mismatched == 0);
}

TEST_CASE("a resource that throws is memory running out: preallocate fails, a cache's first allocation fails with "
          "capacity_exhausted and stores nothing",
          "[pool_memory]") {
  const auto check_refused = [](auto& memory) {
    const kv_cache_config config = small_config();
    kv_block_pool pool = kv_block_pool::for_caches(config, {.memory = &memory});
    std::error_code ec;
    pool.preallocate(slots, ec);
    CHECK(ec == std::errc::not_enough_memory);
    CHECK_THROWS_AS(pool.preallocate(slots), std::bad_alloc);
    CHECK(pool.stats().blocks_allocated == 0);
    asio::thread_pool io(1);
    layer_kv_cache cache(io, config, pool);
    // The cache's block of zeros is its first memory: initialize fails.
    CHECK(ghostlink::test::blocking{cache}.initialize(1) == kv_errc::capacity_exhausted);
    CHECK(cache.size() == 0);
    CHECK(pool.stats().blocks_in_use == 0);
    CHECK(pool.stats().blocks_allocated == 0);
    CHECK(memory.refused() == 3);
  };
  SECTION("std::bad_alloc") {
    refusing_resource<std::bad_alloc> memory;
    check_refused(memory);
  }
  SECTION("an exception of another kind") {
    refusing_resource<std::runtime_error> memory;
    check_refused(memory);
  }
}

TEST_CASE("caches on two threads and a preallocate on a third take memory from one resource at once: every token "
          "kept, every byte given back",
          "[pool_memory]") {
  counting_resource memory;
  kv_cache_config config = small_config();
  config.max_tokens_per_seq = 4096;
  {
    kv_block_pool pool = kv_block_pool::for_caches(config, {.memory = &memory});
    rounds_beside(
        pool, config, 4, 4, 2 * slots + 3,
        [&] {
          for (std::size_t n = 1; n <= 32; ++n) pool.preallocate(n * slots / 2);
        },
        [&] { pool.trim(); }, [&] { CHECK(memory.read().allocations >= ghostlink::detail::census(pool).extents); });
  }
  CHECK(memory.read().live_bytes == 0);
  CHECK(memory.read().misaligned == 0);
  CHECK(memory.read().mismatched == 0);
}

}  // namespace pool_memory_tests
