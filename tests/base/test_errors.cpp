// Every kv_errc reached by a bad input, and after each: nothing stored
// changed (same epoch, same size, same floats).
#include "common/support.hpp"

#include <set>
#include <string>

namespace errors_tests {

using namespace ghostlink;
using ghostlink::test::filled;
using ghostlink::test::observe;
using ghostlink::test::observed;
using ghostlink::test::small_config;
using ghostlink::test::token_pattern;

namespace {

struct fixture : ghostlink::test::cache_fixture {
  using cache_fixture::cache_fixture;
  std::vector<float> good = filled(width, 1.5f);

  /// A cache holding 6 distinct tokens.
  void populate() {
    REQUIRE_FALSE(sync.initialize(6));
    for (std::size_t t = 0; t < 6; ++t) write_pattern(t, 1);
  }
};

/// Runs `bad`, checks it fails with `expected` and that nothing changed.
template <class Bad>
void check_rejected(fixture& f, kv_errc expected, Bad&& bad) {
  const observed before = observe(f.cache);
  const ghostlink::error_code ec = bad();
  INFO("got: " << ec.message());
  CHECK(ec == expected);
  CHECK(observe(f.cache) == before);
}

}  // namespace

TEST_CASE("initialize(0) is zero_length and changes nothing", "[errors]") {
  fixture f;
  f.populate();
  check_rejected(f, kv_errc::zero_length, [&] { return f.sync.initialize(0); });
}

TEST_CASE("keys and values of different lengths are length_mismatch", "[errors]") {
  fixture f;
  f.populate();
  const auto longer = filled(f.width + 1, 9.0f);
  check_rejected(f, kv_errc::length_mismatch, [&] { return f.sync.write(1, f.good, longer); });
}

TEST_CASE("keys of the wrong width are width_mismatch", "[errors]") {
  fixture f;
  f.populate();
  const auto shorter = filled(f.width - 1, 9.0f);
  check_rejected(f, kv_errc::width_mismatch, [&] { return f.sync.write(1, shorter, shorter); });
  check_rejected(f, kv_errc::width_mismatch, [&] { return f.sync.write(1, {}, {}); });
}

TEST_CASE("a write at or past max_tokens_per_seq is index_out_of_range", "[errors]") {
  fixture f;
  f.populate();
  const std::size_t max = f.cache.config().max_tokens_per_seq;
  check_rejected(f, kv_errc::index_out_of_range, [&] { return f.sync.write(max, f.good, f.good); });
  check_rejected(f, kv_errc::index_out_of_range, [&] { return f.sync.write(SIZE_MAX, f.good, f.good); });
}

TEST_CASE("a non-empty write before initialize is not_initialized", "[errors]") {
  fixture f;
  check_rejected(f, kv_errc::not_initialized, [&] { return f.sync.write(0, f.good, f.good); });
  const kv_write one[] = {{0, f.good, f.good}};
  check_rejected(f, kv_errc::not_initialized, [&] { return f.sync.write_batch(one); });
}

TEST_CASE("write checks run in the seed's order", "[errors]") {
  fixture f;  // not initialized, so every failure below also qualifies for not_initialized
  const auto wide = filled(f.width + 1, 0.0f);
  const std::size_t max = f.cache.config().max_tokens_per_seq;
  CHECK(f.sync.write(max, f.good, wide) == kv_errc::length_mismatch);
  CHECK(f.sync.write(max, wide, wide) == kv_errc::width_mismatch);
  CHECK(f.sync.write(max, f.good, f.good) == kv_errc::index_out_of_range);
  CHECK(f.sync.write(0, f.good, f.good) == kv_errc::not_initialized);
}

TEST_CASE("one bad entry anywhere fails the whole batch and stores none of it", "[errors]") {
  fixture f;
  f.populate();
  const auto other = filled(f.width, 77.0f), wide = filled(f.width + 1, 0.0f);
  const std::size_t max = f.cache.config().max_tokens_per_seq;
  SECTION("bad width first") {
    const kv_write batch[] = {{0, wide, wide}, {1, other, other}, {9, other, other}};
    check_rejected(f, kv_errc::width_mismatch, [&] { return f.sync.write_batch(batch); });
  }
  SECTION("bad index last, after entries that would grow the size") {
    const kv_write batch[] = {{0, other, other}, {9, other, other}, {max, other, other}};
    check_rejected(f, kv_errc::index_out_of_range, [&] { return f.sync.write_batch(batch); });
  }
  SECTION("length mismatch in the middle") {
    const kv_write batch[] = {{2, other, other}, {3, other, wide}, {4, other, other}};
    check_rejected(f, kv_errc::length_mismatch, [&] { return f.sync.write_batch(batch); });
  }
}

TEST_CASE("read errors: index_out_of_range, invalid_range, range_out_of_bounds", "[errors]") {
  fixture f;
  f.populate();
  check_rejected(f, kv_errc::index_out_of_range, [&] { return f.sync.read_kv(6).first; });
  check_rejected(f, kv_errc::invalid_range, [&] { return f.sync.read_range(4, 3).first; });
  check_rejected(f, kv_errc::range_out_of_bounds, [&] { return f.sync.read_range(0, 7).first; });
  // begin > end is reported before end > size, as in the seed.
  check_rejected(f, kv_errc::invalid_range, [&] { return f.sync.read_range(9, 8).first; });
}

TEST_CASE("output spans shorter than the data are buffer_too_small and stay untouched", "[errors]") {
  fixture f;
  f.populate();
  const kv_snapshot snap = f.cache.snapshot();
  std::vector<float> k(f.width - 1, -1.0f), v(f.width, -1.0f);
  check_rejected(f, kv_errc::buffer_too_small, [&] { return snap.read_kv(0, k, v); });
  check_rejected(f, kv_errc::buffer_too_small, [&] { return snap.read_kv(0, v, k); });
  std::vector<float> rk(2 * f.width, -1.0f), rv(2 * f.width - 1, -1.0f);
  check_rejected(f, kv_errc::buffer_too_small, [&] { return snap.read_range(1, 3, rk, rv); });
  CHECK(k == filled(f.width - 1, -1.0f));
  CHECK(rk == filled(2 * f.width, -1.0f));
}

TEST_CASE("a config with a zero field throws invalid_config", "[errors]") {
  asio::thread_pool pool{2};
  for (std::size_t kv_cache_config::*field :
       {&kv_cache_config::max_tokens_per_seq, &kv_cache_config::num_heads, &kv_cache_config::head_dim,
        &kv_cache_config::block_tokens, &kv_cache_config::max_blocks}) {
    kv_cache_config config;
    config.*field = 0;
    INFO("config " << config);
    try {
      layer_kv_cache cache(pool, config);
      FAIL("no exception for a zero field");
    } catch (const std::system_error& e) {
      CHECK(e.code() == kv_errc::invalid_config);
    }
  }
}

TEST_CASE("a config whose sizes overflow throws invalid_config", "[errors]") {
  asio::thread_pool pool{2};
  kv_cache_config config;
  config.num_heads = SIZE_MAX / 2;
  config.head_dim = 4;
  CHECK_THROWS_AS(layer_kv_cache(pool, config), std::system_error);
}

TEST_CASE("a write that needs a block past the budget is capacity_exhausted", "[errors]") {
  auto config = small_config();  // 4 tokens per block
  config.max_blocks = 2;
  fixture f(config);
  f.populate();  // tokens 0..5: two blocks
  CHECK(f.cache.stats().blocks_in_use == 2);
  check_rejected(f, kv_errc::capacity_exhausted, [&] { return f.sync.write(8, f.good, f.good); });

  SECTION("a batch that runs out midway stores none of it") {
    const kv_write batch[] = {{6, f.good, f.good}, {7, f.good, f.good}, {8, f.good, f.good}};
    check_rejected(f, kv_errc::capacity_exhausted, [&] { return f.sync.write_batch(batch); });
    CHECK(f.cache.stats().blocks_in_use == 2);
  }
  SECTION("the cache stays usable: writes into existing blocks still succeed") {
    CHECK_FALSE(f.sync.write(7, f.good, f.good));
    CHECK(f.cache.size() == 8);
  }
}

TEST_CASE("blocks pinned by a snapshot count against the budget until it is released", "[errors]") {
  auto config = small_config();  // 4 tokens per block
  config.max_blocks = 3;
  fixture f(config);
  f.populate();  // two blocks
  kv_snapshot pinned = f.cache.snapshot();
  // An overwrite of a published token copies its block: the third block.
  CHECK_FALSE(f.sync.write(1, f.good, f.good));
  CHECK(f.cache.stats().blocks_in_use == 3);
  // The next copy would be a fourth while the snapshot pins the original.
  check_rejected(f, kv_errc::capacity_exhausted, [&] { return f.sync.write(5, f.good, f.good); });
  kv_entry old;
  REQUIRE_FALSE(pinned.read_kv(1, old));
  CHECK(old.keys == token_pattern(f.width, 1, 1));
  pinned = {};  // releases the pin
  CHECK(f.cache.stats().blocks_in_use == 2);
  CHECK_FALSE(f.sync.write(5, f.good, f.good));
  CHECK(f.cache.stats().blocks_in_use == 2);
}

TEST_CASE("a batch that runs out of blocks after copying one leaves no block behind", "[errors]") {
  auto config = small_config();
  config.block_tokens = 1;
  config.max_blocks = 3;
  fixture f(config);
  REQUIRE_FALSE(f.sync.initialize(1));
  f.write_pattern(0, 1);  // one block, published
  const auto v = filled(f.width, 3.0f);
  // New block for 2, a copy of block 0, then a fourth block: over budget.
  const kv_write batch[] = {{2, v, v}, {0, v, v}, {3, v, v}};
  check_rejected(f, kv_errc::capacity_exhausted, [&] { return f.sync.write_batch(batch); });
  CHECK(f.cache.stats().blocks_in_use == 1);
  const kv_write fits[] = {{2, v, v}, {0, v, v}};
  CHECK_FALSE(f.sync.write_batch(fits));
}

TEST_CASE("a batch failing after growing the table by whole chunks leaves it as it was", "[errors]") {
  auto config = small_config();
  config.max_tokens_per_seq = 200;
  config.block_tokens = 1;  // 200 entries: seven chunks of the page table
  config.max_blocks = 3;
  fixture f(config);
  REQUIRE_FALSE(f.sync.initialize(1));
  f.write_pattern(0, 1);
  const auto v = filled(f.width, 4.0f);
  // A block in a new chunk, a copy of block 0, then a fourth block: over budget.
  const kv_write batch[] = {{150, v, v}, {0, v, v}, {199, v, v}};
  check_rejected(f, kv_errc::capacity_exhausted, [&] { return f.sync.write_batch(batch); });
  CHECK(f.cache.stats().blocks_in_use == 1);
  const kv_write fits[] = {{150, v, v}, {0, v, v}};
  REQUIRE_FALSE(f.sync.write_batch(fits));
  CHECK(f.cache.size() == 151);
  auto [ec, range] = f.sync.read_range(99, 151);
  REQUIRE_FALSE(ec);
  CHECK(std::vector<float>(range.keys.begin(), range.keys.begin() + std::ptrdiff_t(f.width)) == filled(f.width, 0.0f));
  CHECK(std::vector<float>(range.keys.end() - std::ptrdiff_t(f.width), range.keys.end()) == v);
}

TEST_CASE("configs whose block or table sizes overflow are rejected or fail cleanly", "[errors]") {
  asio::thread_pool pool{2};
  kv_cache_config huge_block{
      .max_tokens_per_seq = 1, .num_heads = 1, .head_dim = (std::size_t{1} << 61) - 1, .block_tokens = 1};
  CHECK_THROWS_AS(layer_kv_cache(pool, huge_block), std::system_error);

  // Valid, but a write near the end needs a table too long to allocate.
  kv_cache_config endless{.max_tokens_per_seq = SIZE_MAX, .num_heads = 1, .head_dim = 1, .block_tokens = 16};
  layer_kv_cache cache(pool, endless);
  ghostlink::test::blocking sync{cache};
  REQUIRE_FALSE(sync.initialize(1));
  const std::vector<float> one{1.0f};
  CHECK(sync.write(SIZE_MAX - 1, one, one) == kv_errc::capacity_exhausted);
  CHECK(cache.size() == 1);
  CHECK_FALSE(sync.write(0, one, one));
}

TEST_CASE("error codes compare, convert and describe themselves", "[errors]") {
  const ghostlink::error_code ec = kv_errc::range_out_of_bounds;
  CHECK(ec.category() == kv_category());
  CHECK(std::string(kv_category().name()) == "ghostlink.kv");
  CHECK(ec == make_error_code(kv_errc::range_out_of_bounds));
  CHECK(ec != kv_errc::invalid_range);
  std::set<std::string> messages;
  for (int e = static_cast<int>(kv_errc::zero_length); e <= static_cast<int>(kv_errc::invalid_retention); ++e)
    messages.insert(kv_category().message(e));
  CHECK(messages.size() == 27);  // each distinct: none left to the "unknown" text
  CHECK_FALSE(kv_category().message(999).empty());
}

}  // namespace errors_tests
