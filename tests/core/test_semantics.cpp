// The contract's single-threaded semantics: initialize, write, write_batch,
// read_kv, read_range, for_each_block, paging, copies and printing.
#include "common/support.hpp"

#include <algorithm>
#include <numeric>

namespace semantics_tests {

using namespace ghostlink;
using ghostlink::test::blocking;
using ghostlink::test::filled;
using ghostlink::test::small_config;
using ghostlink::test::token_pattern;

namespace {

struct fixture : ghostlink::test::cache_fixture {
  using cache_fixture::cache_fixture;
  std::vector<float> keys_at(std::size_t index) {
    auto [ec, entry] = sync.read_kv(index);
    INFO("read_kv(" << index << "): " << ec.message());
    REQUIRE_FALSE(ec);
    return entry.keys;
  }
};

}  // namespace

TEST_CASE("initialize clamps the length to max_tokens_per_seq", "[initialize]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(1000));
  CHECK(f.cache.size() == f.cache.config().max_tokens_per_seq);
}

TEST_CASE("initialize never shrinks the size", "[initialize]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(8));
  REQUIRE_FALSE(f.sync.initialize(3));
  CHECK(f.cache.size() == 8);
}

TEST_CASE("initialize makes never-written tokens read as zeros", "[initialize]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(11));
  for (std::size_t t = 0; t < 11; ++t) {
    INFO("token " << t);
    CHECK(f.keys_at(t) == filled(f.width, 0.0f));
  }
}

TEST_CASE("initialize again keeps every written token", "[initialize]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(6));
  for (std::size_t t = 0; t < 6; ++t) f.write_pattern(t, 1);
  REQUIRE_FALSE(f.sync.initialize(2));
  REQUIRE_FALSE(f.sync.initialize(16));
  for (std::size_t t = 0; t < 6; ++t) {
    INFO("token " << t);
    CHECK(f.keys_at(t) == token_pattern(f.width, t, 1));
  }
}

TEST_CASE("a write past the size grows it to index + 1 and skipped tokens read as zeros", "[write]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(2));
  f.write_pattern(9, 3);
  CHECK(f.cache.size() == 10);
  for (std::size_t t = 2; t < 9; ++t) {
    INFO("skipped token " << t);
    CHECK(f.keys_at(t) == filled(f.width, 0.0f));
  }
  CHECK(f.keys_at(9) == token_pattern(f.width, 9, 3));
}

TEST_CASE("tokens skipped inside a partly written block read as zeros once the size passes them", "[write]") {
  fixture f;  // block_tokens = 4; meson test's MALLOC_PERTURB_ fills fresh memory with garbage
  REQUIRE_FALSE(f.sync.initialize(1));
  f.write_pattern(1, 1);  // block 0: token 0 skipped, tokens 2, 3 not yet valid
  f.write_pattern(9, 1);  // block 2; tokens 2..8 become valid
  for (std::size_t t : {0u, 2u, 3u, 4u, 7u, 8u}) {
    INFO("token " << t);
    CHECK(f.keys_at(t) == filled(f.width, 0.0f));
  }
  CHECK(f.keys_at(1) == token_pattern(f.width, 1, 1));
}

TEST_CASE("a copied block keeps its written tokens and reads zeros for the ones skipped after", "[write]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(1));
  f.write_pattern(0, 1);
  f.write_pattern(1, 1);
  const kv_snapshot pinned = f.cache.snapshot();
  f.write_pattern(0, 2);  // copy-on-write of block 0
  f.write_pattern(3, 2);  // token 2 skipped inside the copy
  CHECK(f.keys_at(0) == token_pattern(f.width, 0, 2));
  CHECK(f.keys_at(1) == token_pattern(f.width, 1, 1));
  CHECK(f.keys_at(2) == filled(f.width, 0.0f));
  CHECK(f.keys_at(3) == token_pattern(f.width, 3, 2));
  kv_entry old;
  REQUIRE_FALSE(pinned.read_kv(0, old));
  CHECK(old.keys == token_pattern(f.width, 0, 1));
  CHECK(pinned.size() == 2);
}

TEST_CASE("a write below the size leaves the size alone", "[write]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(12));
  f.write_pattern(3, 1);
  CHECK(f.cache.size() == 12);
}

TEST_CASE("an overwrite replaces keys and values of that token only", "[write]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(8));
  for (std::size_t t = 0; t < 8; ++t) f.write_pattern(t, 1);
  f.write_pattern(5, 2);
  for (std::size_t t = 0; t < 8; ++t) {
    INFO("token " << t);
    auto [ec, entry] = f.sync.read_kv(t);
    REQUIRE_FALSE(ec);
    const auto expected = token_pattern(f.width, t, t == 5 ? 2 : 1);
    CHECK(entry.keys == expected);
    CHECK(entry.values == expected);
  }
}

TEST_CASE("an empty batch succeeds and publishes nothing, even before initialize", "[write_batch]") {
  fixture f;
  const auto before = f.cache.snapshot().epoch();
  CHECK_FALSE(f.sync.write_batch({}));
  CHECK(f.cache.snapshot().epoch() == before);
  CHECK(f.cache.size() == 0);
}

TEST_CASE("batch entries apply in order and a later entry for the same index wins", "[write_batch]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(1));
  const auto first = token_pattern(f.width, 6, 1), second = token_pattern(f.width, 6, 2);
  const auto other = token_pattern(f.width, 2, 1);
  const kv_write entries[] = {{6, first, first}, {2, other, other}, {6, second, second}};
  REQUIRE_FALSE(f.sync.write_batch(entries));
  CHECK(f.keys_at(6) == second);
  CHECK(f.keys_at(2) == other);
  CHECK(f.cache.size() == 7);
}

TEST_CASE("a batch is published as one epoch", "[write_batch]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(1));
  const auto before = f.cache.snapshot().epoch();
  std::vector<std::vector<float>> data;
  std::vector<kv_write> entries;
  for (std::size_t t = 0; t < 10; ++t) data.push_back(token_pattern(f.width, t, 4));
  for (std::size_t t = 0; t < 10; ++t) entries.push_back({t, data[t], data[t]});
  REQUIRE_FALSE(f.sync.write_batch(entries));
  CHECK(f.cache.snapshot().epoch() == before + 1);
}

TEST_CASE("read_kv at or past the size is index_out_of_range", "[read]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(3));
  CHECK(f.sync.read_kv(3).first == kv_errc::index_out_of_range);
  CHECK(f.sync.read_kv(2).first == ghostlink::error_code{});
}

TEST_CASE("read_range is token-major across block boundaries", "[read]") {
  fixture f;  // block_tokens = 4: [1, 11) spans three blocks
  REQUIRE_FALSE(f.sync.initialize(12));
  for (std::size_t t = 0; t < 12; ++t) f.write_pattern(t, 1);
  auto [ec, range] = f.sync.read_range(1, 11);
  REQUIRE_FALSE(ec);
  CHECK(range.begin == 1);
  CHECK(range.end == 11);
  REQUIRE(range.keys.size() == 10 * f.width);
  for (std::size_t t = 1; t < 11; ++t) {
    INFO("token " << t);
    const auto expected = token_pattern(f.width, t, 1);
    const auto at = static_cast<std::ptrdiff_t>((t - 1) * f.width);
    CHECK(std::vector<float>(range.keys.begin() + at, range.keys.begin() + at + ptrdiff_t(f.width)) == expected);
    CHECK(std::vector<float>(range.values.begin() + at, range.values.begin() + at + ptrdiff_t(f.width)) == expected);
  }
}

TEST_CASE("read_range with begin == end succeeds empty, also at the size", "[read]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(5));
  for (std::size_t at : {0u, 3u, 5u}) {
    INFO("begin = end = " << at);
    auto [ec, range] = f.sync.read_range(at, at);
    CHECK_FALSE(ec);
    CHECK(range.keys.empty());
    CHECK(range.values.empty());
  }
}

TEST_CASE("for_each_block visits each stored run once, in order, with the stored data; blocks filled one after another "
          "are one run",
          "[read]") {
  fixture f;  // block_tokens = 4
  REQUIRE_FALSE(f.sync.initialize(14));
  for (std::size_t t = 0; t < 14; ++t) f.write_pattern(t, 2);
  const kv_snapshot snap = f.cache.snapshot();
  std::vector<std::pair<std::size_t, std::size_t>> runs;
  std::size_t mismatches = 0;
  const auto ec = snap.for_each_block(
      2, 13, [&](std::size_t first, std::size_t count, std::span<const float> k, std::span<const float> v) {
        runs.emplace_back(first, count);
        if (k.size() != count * f.width || v.size() != count * f.width) ++mismatches;
        for (std::size_t i = 0; i < count; ++i) {
          const auto expected = token_pattern(f.width, first + i, 2);
          if (!std::equal(expected.begin(), expected.end(), k.begin() + ptrdiff_t(i * f.width))) ++mismatches;
          if (!std::equal(expected.begin(), expected.end(), v.begin() + ptrdiff_t(i * f.width))) ++mismatches;
        }
      });
  CHECK_FALSE(ec);
  CHECK(mismatches == 0);
  // Four blocks of 4 tokens, filled in order by one cache: consecutive
  // slots of one extent, keys after keys and values after values.
  const std::vector<std::pair<std::size_t, std::size_t>> expected_runs{{2, 11}};
  CHECK(runs == expected_runs);
}

TEST_CASE("for_each_block rejects bad ranges without calling f", "[read]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(4));
  const kv_snapshot snap = f.cache.snapshot();
  int calls = 0;
  auto count = [&](auto, auto, auto, auto) { ++calls; };
  CHECK(snap.for_each_block(3, 2, count) == kv_errc::invalid_range);
  CHECK(snap.for_each_block(0, 5, count) == kv_errc::range_out_of_bounds);
  CHECK_FALSE(snap.for_each_block(2, 2, count));
  CHECK(calls == 0);
}

TEST_CASE("a block size that does not divide max_tokens_per_seq stores every token", "[paging]") {
  auto config = small_config();
  config.max_tokens_per_seq = 10;
  config.block_tokens = 4;  // blocks: [0,4) [4,8) [8,10)
  fixture f(config);
  REQUIRE_FALSE(f.sync.initialize(100));
  CHECK(f.cache.size() == 10);
  for (std::size_t t = 0; t < 10; ++t) f.write_pattern(t, 5);
  for (std::size_t t = 0; t < 10; ++t) {
    INFO("token " << t);
    CHECK(f.keys_at(t) == token_pattern(f.width, t, 5));
  }
  const auto v = filled(f.width, 1.0f);
  CHECK(f.sync.write(10, v, v) == kv_errc::index_out_of_range);
  CHECK(f.cache.stats().blocks_in_use == 3);
}

TEST_CASE("a block larger than the whole sequence works", "[paging]") {
  auto config = small_config();
  config.max_tokens_per_seq = 5;
  config.block_tokens = 64;
  fixture f(config);
  REQUIRE_FALSE(f.sync.initialize(1));
  for (std::size_t t = 0; t < 5; ++t) f.write_pattern(t, 6);
  auto [ec, range] = f.sync.read_range(0, 5);
  REQUIRE_FALSE(ec);
  CHECK(std::vector<float>(range.keys.end() - ptrdiff_t(f.width), range.keys.end()) == token_pattern(f.width, 4, 6));
}

TEST_CASE("page tables spanning many chunks keep every token and every older snapshot", "[paging]") {
  auto config = small_config();
  config.max_tokens_per_seq = 300;
  config.block_tokens = 1;  // one block per token: 300 entries, ten chunks of the page table
  fixture f(config);
  REQUIRE_FALSE(f.sync.initialize(1));
  std::vector<std::pair<kv_snapshot, std::vector<std::size_t>>> history;  // snapshot, tokens written so far
  std::vector<std::size_t> written;
  for (std::size_t t : {0u, 5u, 70u, 64u, 150u, 299u, 31u, 32u}) {
    f.write_pattern(t, 1);
    written.push_back(t);
    history.emplace_back(f.cache.snapshot(), written);
  }
  for (std::size_t t : {5u, 70u, 299u}) f.write_pattern(t, 2);  // copies in three chunks
  CHECK(f.cache.stats().blocks_in_use == history.size() + 3);     // the copies, while old snapshots pin the rest
  for (auto& [snap, tokens] : history) {
    INFO("snapshot of epoch " << snap.epoch());
    for (std::size_t t = 0; t < snap.size(); ++t) {
      kv_entry e;
      REQUIRE_FALSE(snap.read_kv(t, e));
      const bool was_written = std::find(tokens.begin(), tokens.end(), t) != tokens.end();
      CHECK(e.keys == (was_written ? token_pattern(f.width, t, 1) : filled(f.width, 0.0f)));
    }
  }
  history.clear();
  CHECK(f.cache.stats().blocks_in_use == written.size());
  for (std::size_t t : {5u, 70u, 299u}) CHECK(f.keys_at(t) == token_pattern(f.width, t, 2));
  CHECK(f.keys_at(100) == filled(f.width, 0.0f));
}

TEST_CASE("one token costs one block, not the whole sequence", "[paging]") {
  asio::thread_pool pool{2};
  layer_kv_cache cache(pool);  // the seed's 8192-token default
  blocking sync{cache};
  const std::size_t width = cache.config().token_width();
  REQUIRE_FALSE(sync.initialize(1));
  const auto v = filled(width, 1.0f);
  REQUIRE_FALSE(sync.write(0, v, v));
  const auto stats = cache.stats();
  CHECK(stats.blocks_in_use == 1);
  CHECK(stats.bytes_in_use == 2 * cache.config().block_tokens * width * sizeof(float));
}

TEST_CASE("snapshot reads into caller spans", "[snapshot]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(6));
  for (std::size_t t = 0; t < 6; ++t) f.write_pattern(t, 7);
  const kv_snapshot snap = f.cache.snapshot();
  CHECK(snap.size() == 6);
  CHECK(snap.token_width() == f.width);
  std::vector<float> k(f.width), v(f.width);
  REQUIRE_FALSE(snap.read_kv(4, k, v));
  CHECK(k == token_pattern(f.width, 4, 7));
  CHECK(v == token_pattern(f.width, 4, 7));
  std::vector<float> rk(3 * f.width), rv(3 * f.width);
  REQUIRE_FALSE(snap.read_range(3, 6, rk, rv));
  CHECK(std::vector<float>(rk.begin(), rk.begin() + ptrdiff_t(f.width)) == token_pattern(f.width, 3, 7));
}

TEST_CASE("an empty snapshot has size 0 and epoch 0 and rejects reads", "[snapshot]") {
  kv_snapshot empty;
  CHECK(empty.size() == 0);
  CHECK(empty.epoch() == 0);
  CHECK(empty.empty());
  kv_entry entry;
  CHECK(empty.read_kv(0, entry) == kv_errc::index_out_of_range);
  CHECK_FALSE(empty.for_each_block(0, 0, [](auto, auto, auto, auto) {}));
}

TEST_CASE("a moved-from snapshot is empty and the moved-to one keeps the epoch", "[snapshot]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(3));
  kv_snapshot a = f.cache.snapshot();
  const auto epoch = a.epoch();
  kv_snapshot b = std::move(a);
  CHECK(a.size() == 0);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  CHECK(b.size() == 3);
  CHECK(b.epoch() == epoch);
}

TEST_CASE("copies of a cache share one actor and one storage", "[handle]") {
  fixture f;
  layer_kv_cache copy = f.cache;
  REQUIRE_FALSE(blocking{copy}.initialize(4));
  CHECK(f.cache.size() == 4);
  f.write_pattern(1, 8);
  CHECK(blocking{copy}.read_kv(1).second.keys == token_pattern(f.width, 1, 8));
  CHECK(copy.get_executor() == f.cache.get_executor());
  CHECK(copy.config() == f.cache.config());
}

TEST_CASE("stats count drains, applied and failed requests", "[stats]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(4));
  f.write_pattern(0, 1);
  const auto bad = filled(f.width + 1, 0.0f);
  REQUIRE(f.sync.write(0, bad, bad));
  const auto s = f.cache.stats();
  CHECK(s.requests_applied == 2);
  CHECK(s.requests_failed == 1);
  CHECK(s.drains >= 1);
  CHECK(s.drains <= 3);
  CHECK(s.size == 4);
  CHECK(s.epoch == f.cache.snapshot().epoch());
}

}  // namespace semantics_tests
