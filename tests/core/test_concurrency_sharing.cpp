// Sharing under concurrency: snapshots released on other threads free what
// only they reached, many writers on one pool, copies of one cache.

#include "common/concurrency_support.hpp"

namespace concurrency_sharing_tests {

using namespace ghostlink;
using namespace ghostlink::test::concurrency;
using ghostlink::test::run;

namespace {

/// Holds `snap` across an overwrite, reads it, releases it, all on the
/// coroutine's own executor; returns blocks_in_use while it was pinned.
asio::awaitable<std::size_t> hold_across_overwrite(layer_kv_cache& cache, kv_snapshot snap, int tag,
                                                   mismatch_log& log) {
  co_await write_batch(cache, 0, snap.size(), tag + 1);
  const std::size_t while_pinned = cache.stats().blocks_in_use;
  check_all(log, "snapshot in a coroutine on another pool", snap, tag);
  snap = kv_snapshot{};
  co_return while_pinned;
}

}  // namespace

TEST_CASE("a snapshot moved to another thread is read and released there, freeing what only it reached",
          "[concurrency]") {
  const kv_cache_config config = paged_config(16);
  const std::size_t n = config.max_tokens_per_seq;
  const std::size_t live_blocks = (n + config.block_tokens - 1) / config.block_tokens;
  mismatch_log log;
  // `other` outlives `pool`: a drain on `pool` completes the coroutine's
  // handler on `other`, and may still be letting go of its executor (work
  // it tracked on `other`) when the coroutine's result arrives here.
  asio::thread_pool other(2);
  asio::thread_pool pool(2);
  layer_kv_cache cache(pool, config);
  cache.async_initialize(n, asio::use_future).get();
  run(pool.get_executor(), write_batch(cache, 0, n, 1));
  INFO("the live cache needs " << live_blocks << " blocks");
  REQUIRE(cache.stats().blocks_in_use == live_blocks);

  // Pin tag 1, overwrite every token (copy-on-write of every block), then
  // read and release the snapshot on a std::thread.
  kv_snapshot old = cache.snapshot();
  run(pool.get_executor(), write_batch(cache, 0, n, 2));
  INFO("blocks with an old snapshot pinned: " << cache.stats().blocks_in_use);
  REQUIRE(cache.stats().blocks_in_use == 2 * live_blocks);
  std::jthread releaser([&log, snap = std::move(old)]() mutable {
    check_all(log, "snapshot on a std::thread", snap, 1);
    snap = kv_snapshot{};
  });
  CHECK(old.size() == 0);  // NOLINT(bugprone-use-after-move): the contract is that a moved-from snapshot is empty
  releaser.join();
  log.require_none();
  INFO("blocks after the std::thread released it: " << cache.stats().blocks_in_use);
  REQUIRE(cache.stats().blocks_in_use == live_blocks);

  // Again inside a coroutine on another pool, held across an overwrite.
  const std::size_t while_pinned =
      asio::co_spawn(other, hold_across_overwrite(cache, cache.snapshot(), 2, log), asio::use_future).get();
  INFO("blocks while the coroutine held it: " << while_pinned << ", after: " << cache.stats().blocks_in_use);
  CHECK(while_pinned == 2 * live_blocks);
  CHECK(cache.stats().blocks_in_use == live_blocks);
  check_all(log, "latest snapshot", cache.snapshot(), 3);
  log.require_none();
}

TEST_CASE("many concurrent writers each leave exactly their own tokens, in no more drains than requests",
          "[concurrency]") {
  constexpr std::size_t writers = 16, tokens_per_writer = 3;  // ranges straddle blocks of 4
  constexpr int rounds = 10;
  constexpr int snapshots_per_reader = 1000;
  const kv_cache_config config = paged_config(writers * tokens_per_writer);
  const std::size_t n = config.max_tokens_per_seq;
  mismatch_log log;
  asio::thread_pool pool(2);
  layer_kv_cache cache(pool, config);
  cache.async_initialize(n, asio::use_future).get();

  auto writer = [&](std::size_t w) -> asio::awaitable<void> {
    for (int tag = 1; tag <= rounds; ++tag)
      for (std::size_t i = w * tokens_per_writer; i < (w + 1) * tokens_per_writer; ++i)
        co_await write_token(cache, i, tag);
  };
  // Every token is zeros or exactly one round's write, and never goes back.
  auto reader = [&] {
    std::vector<int> last(n, 0);
    for (int s = 0; s < snapshots_per_reader; ++s) {
      const kv_snapshot snap = cache.snapshot();
      for_each_token(snap, 0, snap.size(), [&](std::size_t i, auto keys, auto values) {
        const int tag = tag_of(i, keys);
        if (auto d = diff_token(i, keys, values, tag); !d.empty()) log.add(str("epoch ", snap.epoch(), ": ", d));
        if (tag < last[i]) log.add(str("token ", i, " went back from round ", last[i], " to ", tag));
        last[i] = tag;
      });
    }
  };
  std::vector<std::future<void>> done;
  for (std::size_t w = 0; w < writers; ++w) done.push_back(asio::co_spawn(pool, writer(w), asio::use_future));
  std::jthread r0(reader), r1(reader);
  for (auto& f : done) f.get();
  r0.join();
  r1.join();
  check_all(log, "after every writer finished", cache.snapshot(), rounds);
  log.require_none();

  const kv_cache_stats stats = cache.stats();
  const std::uint64_t requests = 1 + writers * tokens_per_writer * rounds;  // + the initialize
  INFO("requests " << requests << ", applied " << stats.requests_applied << ", failed " << stats.requests_failed
                   << ", drains " << stats.drains);
  CHECK(stats.requests_applied == requests);
  CHECK(stats.requests_failed == 0);
  CHECK(stats.drains <= requests);
}

TEST_CASE("copies of a cache used from different threads share one cache", "[concurrency]") {
  const kv_cache_config config = small_config();
  const std::size_t n = config.max_tokens_per_seq, half = n / 2;
  mismatch_log log;
  std::promise<void> first_half_written;
  std::future<void> first_half = first_half_written.get_future();
  asio::thread_pool pool(2);
  layer_kv_cache original(pool, config);
  original.async_initialize(1, asio::use_future).get();

  auto write_range = [&](layer_kv_cache& copy, const char* who, std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) {
      const token_data t = make_token(config.token_width(), i, 1);
      const ghostlink::error_code ec =
          ghostlink::test::wait_ec([&](auto token) { return copy.async_write(i, t.keys, t.values, std::move(token)); });
      if (ec) log.add(str(who, ": write ", i, " failed: ", ec.message()));
    }
  };
  // Copy a writes the first half; copy b writes the second half, then reads
  // the first half through itself once a says it is done.
  std::jthread a([&, copy = original]() mutable {
    write_range(copy, "copy a", 0, half);
    first_half_written.set_value();
  });
  std::jthread b([&, copy = original]() mutable {
    write_range(copy, "copy b", half, n);
    first_half.get();
    if (copy.size() != n) log.add(str("copy b: size ", copy.size(), ", expected ", n));
    check_all(log, "copy b after both halves", copy.snapshot(), 1);
  });
  a.join();
  b.join();
  // NOLINTNEXTLINE(performance-unnecessary-copy-initialization): the copy is what is tested
  const layer_kv_cache copy = original;
  CHECK(copy.get_executor() == original.get_executor());
  CHECK(original.size() == n);
  CHECK(original.stats().requests_applied == 1 + n);
  check_all(log, "original", original.snapshot(), 1);
  log.require_none();
}

}  // namespace concurrency_sharing_tests
