// The concurrency contract (DESIGN.md, "Semantics" / "Concurrency").
//
// Catch2 assertions are not thread-safe: threads other than the test's own
// only record what differed in a `mismatch_log`, which the test thread checks.
// Loops run fixed counts; threads meet through futures, latches and handlers,
// never sleeps. State that handlers touch is declared before the thread pool,
// so the pool joins before that state is destroyed.

#include "support.hpp"

#include <cmath>
#include <cstdint>
#include <future>
#include <latch>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

using namespace ghostlink;
using ghostlink::test::run;
using ghostlink::test::small_config;
using ghostlink::test::token_pattern;

namespace {

/// small_config() (8 floats per token, 4 tokens per block) holding `max_tokens`.
kv_cache_config paged_config(std::size_t max_tokens) {
  kv_cache_config c = small_config();
  c.max_tokens_per_seq = max_tokens;
  return c;
}

template <class... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

/// A token's keys (token_pattern) and values (their negation); tag 0 is a
/// never-written token (zeros).
struct token_data { std::vector<float> keys, values; };

token_data make_token(std::size_t width, std::size_t index, int tag) {
  if (tag == 0) return {std::vector<float>(width, 0.0f), std::vector<float>(width, 0.0f)};
  token_data t{token_pattern(width, index, tag), {}};
  for (float k : t.keys) t.values.push_back(-k);
  return t;
}

/// The tag token `index` was written with, decoded from its first key (0 for
/// zeros). A torn or misplaced token decodes to something diff_token rejects.
int tag_of(std::size_t index, std::span<const float> keys) {
  if (keys[0] == 0.0f && keys[1] == 0.0f) return 0;
  return static_cast<int>(std::lround((keys[0] - static_cast<float>(index * 1000)) / 100.0f));
}

/// "" if `keys`/`values` are exactly token `index` written with `tag`,
/// otherwise the first float that differs.
std::string diff_token(std::size_t index, std::span<const float> keys, std::span<const float> values, int tag) {
  const token_data want = make_token(keys.size(), index, tag);
  for (std::size_t lane = 0; lane < keys.size(); ++lane)
    if (keys[lane] != want.keys[lane] || values[lane] != want.values[lane])
      return str("token ", index, " lane ", lane, ": key ", keys[lane], " value ", values[lane], ", expected tag ", tag,
                 " (key ", want.keys[lane], " value ", want.values[lane], ")");
  return {};
}

/// Calls f(index, keys, values) per token of `snap` in [begin, end), zero-copy.
template <class F>
std::error_code for_each_token(const kv_snapshot& snap, std::size_t begin, std::size_t end, F f) {
  const std::size_t w = snap.token_width();
  return snap.for_each_block(begin, end, [&](std::size_t first, std::size_t count, std::span<const float> keys,
                                             std::span<const float> values) {
    for (std::size_t t = 0; t < count; ++t) f(first + t, keys.subspan(t * w, w), values.subspan(t * w, w));
  });
}

/// What other threads saw go wrong (the first few, and how many in all).
struct mismatch_log {
  std::mutex mutex;
  std::size_t count = 0;
  std::string first;

  void add(const std::string& what) {
    std::lock_guard lock(mutex);
    if (++count <= 5) first += what + '\n';
  }
  void require_none() {
    std::lock_guard lock(mutex);
    INFO(count << " mismatch(es), first:\n" << first);
    REQUIRE(count == 0);
  }
};

/// Checks every token of `snap` is `tag`, through for_each_block, read_range
/// and read_kv; logs each difference with `where`.
void check_all(mismatch_log& log, const std::string& where, const kv_snapshot& snap, int tag) {
  const std::size_t n = snap.size(), w = snap.token_width();
  for_each_token(snap, 0, n, [&](std::size_t i, auto keys, auto values) {
    if (auto d = diff_token(i, keys, values, tag); !d.empty()) log.add(where + ", for_each_block: " + d);
  });
  kv_range r;
  if (std::error_code ec = snap.read_range(0, n, r)) log.add(where + ", read_range: " + ec.message());
  for (std::size_t i = 0; i < n && r.keys.size() == n * w; ++i) {
    const auto keys = std::span(r.keys).subspan(i * w, w), values = std::span(r.values).subspan(i * w, w);
    if (auto d = diff_token(i, keys, values, tag); !d.empty()) log.add(where + ", read_range: " + d);
  }
  for (std::size_t i = 0; i < n; ++i) {
    kv_entry e;
    if (std::error_code ec = snap.read_kv(i, e)) log.add(str(where, ", read_kv(", i, "): ", ec.message()));
    else if (auto d = diff_token(i, e.keys, e.values, tag); !d.empty()) log.add(where + ", read_kv: " + d);
  }
}

asio::awaitable<void> write_token(layer_kv_cache& cache, std::size_t index, int tag) {
  const token_data t = make_token(cache.config().token_width(), index, tag);
  co_await cache.async_write(index, t.keys, t.values, asio::use_awaitable);
}

/// Writes tokens [begin, end) with `tag` as one async_write_batch.
asio::awaitable<void> write_batch(layer_kv_cache& cache, std::size_t begin, std::size_t end, int tag) {
  std::vector<token_data> tokens;
  std::vector<kv_write> batch;
  for (std::size_t i = begin; i < end; ++i) tokens.push_back(make_token(cache.config().token_width(), i, tag));
  for (std::size_t i = begin; i < end; ++i) batch.push_back({i, tokens[i - begin].keys, tokens[i - begin].values});
  co_await cache.async_write_batch(batch, asio::use_awaitable);
}

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

TEST_CASE("a write is in snapshot() and size() on another thread once its handler has run", "[concurrency]") {
  const kv_cache_config config = paged_config(32);
  const std::size_t n = config.max_tokens_per_seq;
  struct completion { std::error_code ec; std::size_t size; kv_snapshot snap; };  // taken inside the handler
  std::vector<token_data> tokens;
  std::vector<std::promise<completion>> handled(n);
  std::vector<std::future<completion>> handled_f;
  for (std::size_t i = 0; i < n; ++i) {
    tokens.push_back(make_token(config.token_width(), i, 1));
    handled_f.push_back(handled[i].get_future());
  }
  mismatch_log log;
  asio::thread_pool pool(2);
  layer_kv_cache cache(pool, config);
  cache.async_initialize(1, asio::use_future).get();

  auto check_includes = [&](const char* who, std::size_t i, std::size_t size, const kv_snapshot& snap) {
    kv_entry e;
    if (size <= i) log.add(str(who, ": size() ", size, " after write ", i, " completed"));
    if (std::error_code ec = snap.read_kv(i, e))
      log.add(str(who, ": snapshot (epoch ", snap.epoch(), ", size ", snap.size(), ") read_kv(", i, "): ", ec.message()));
    else if (auto d = diff_token(i, e.keys, e.values, 1); !d.empty())
      log.add(str(who, ": snapshot after write ", i, ": ", d));
  };
  // The checker is neither the initiating thread nor a pool thread: it learns
  // of each completion only through the promise the handler fulfils (which
  // also carries the handler's own view, taken on a pool thread).
  std::jthread checker([&] {
    for (std::size_t i = 0; i < n; ++i) {
      const completion c = handled_f[i].get();
      if (c.ec) log.add(str("write ", i, " failed: ", c.ec.message()));
      check_includes("in the handler", i, c.size, c.snap);
      check_includes("on the checker thread", i, cache.size(), cache.snapshot());
    }
  });
  for (std::size_t i = 0; i < n; ++i)
    cache.async_write(i, tokens[i].keys, tokens[i].values, [&cache, &handled, i](std::error_code ec) {
      handled[i].set_value({ec, cache.size(), cache.snapshot()});
    });
  checker.join();
  log.require_none();
  CHECK(cache.size() == n);
}

TEST_CASE("a snapshot keeps its size, epoch and every float while its tokens are overwritten", "[concurrency]") {
  const kv_cache_config config = paged_config(64);
  const std::size_t pinned_size = 16;
  constexpr int rounds = 40;  // each pinned token is overwritten with tags 2 .. rounds + 1
  constexpr int rereads = 500;
  mismatch_log log;
  asio::thread_pool pool(2);
  layer_kv_cache cache(pool, config);
  cache.async_initialize(pinned_size, asio::use_future).get();
  run(pool.get_executor(), write_batch(cache, 0, pinned_size, 1));
  const kv_snapshot pinned = cache.snapshot();
  const std::uint64_t pinned_epoch = pinned.epoch();
  REQUIRE(pinned.size() == pinned_size);

  // Two writers, one per parity: overwrite each pinned token, then grow the cache.
  auto overwriter = [&](std::size_t parity) -> asio::awaitable<void> {
    for (int tag = 2; tag <= rounds + 1; ++tag) {
      for (std::size_t i = parity; i < pinned_size; i += 2) co_await write_token(cache, i, tag);
      const std::size_t past = static_cast<std::size_t>(tag) * 2 + parity;
      co_await write_token(cache, pinned_size + past % (config.max_tokens_per_seq - pinned_size), tag);
    }
  };
  // Two readers of the one pinned snapshot: this thread and another.
  auto reread = [&](const std::string& who) {
    for (int r = 0; r < rereads; ++r) {
      if (pinned.size() != pinned_size || pinned.epoch() != pinned_epoch)
        log.add(str(who, " reread ", r, ": size ", pinned.size(), " epoch ", pinned.epoch(), ", pinned with size ",
                    pinned_size, " epoch ", pinned_epoch));
      check_all(log, str(who, " reread ", r), pinned, 1);
    }
  };
  auto even = asio::co_spawn(pool, overwriter(0), asio::use_future);
  auto odd = asio::co_spawn(pool, overwriter(1), asio::use_future);
  std::jthread reader([&] { reread("reader thread"); });
  reread("test thread");
  even.get();
  odd.get();
  reader.join();
  check_all(log, "after the writers finished", pinned, 1);

  // The overwrites did happen: the latest epoch holds the last round in every pinned token.
  const kv_snapshot latest = cache.snapshot();
  INFO("latest epoch " << latest.epoch() << ", size " << latest.size());
  CHECK(latest.epoch() > pinned_epoch);
  CHECK(latest.size() > pinned_size);
  for_each_token(latest, 0, pinned_size, [&](std::size_t i, auto keys, auto values) {
    if (auto d = diff_token(i, keys, values, rounds + 1); !d.empty()) log.add("latest snapshot: " + d);
  });
  log.require_none();
}

TEST_CASE("a concurrent reader sees all of a write batch or none of it", "[concurrency]") {
  const kv_cache_config config = paged_config(16);
  const std::size_t batch_tokens = 10;  // three blocks of 4
  constexpr int generations = 300;
  constexpr int snapshots_per_reader = 3000;
  REQUIRE(batch_tokens > 2 * config.block_tokens);
  mismatch_log log;
  asio::thread_pool pool(2);
  layer_kv_cache cache(pool, config);
  cache.async_initialize(batch_tokens, asio::use_future).get();
  run(pool.get_executor(), write_batch(cache, 0, batch_tokens, 1));

  // Each batch writes one generation into every token; generations only grow.
  auto writer = [&]() -> asio::awaitable<void> {
    for (int gen = 2; gen <= generations; ++gen) co_await write_batch(cache, 0, batch_tokens, gen);
  };
  auto reader = [&] {
    int last = 0;
    for (int s = 0; s < snapshots_per_reader; ++s) {
      const kv_snapshot snap = cache.snapshot();
      if (snap.size() != batch_tokens) log.add(str("epoch ", snap.epoch(), " has size ", snap.size()));
      int gen = -1;
      for_each_token(snap, 0, snap.size(), [&](std::size_t i, auto keys, auto values) {
        if (gen < 0) gen = tag_of(i, keys);
        if (auto d = diff_token(i, keys, values, gen); !d.empty())
          log.add(str("torn batch in epoch ", snap.epoch(), " (token 0 has generation ", gen, "): ", d));
      });
      if (gen < last) log.add(str("generation went back from ", last, " to ", gen, " in epoch ", snap.epoch()));
      last = gen;
    }
  };
  auto written = asio::co_spawn(pool, writer(), asio::use_future);
  std::jthread r0(reader), r1(reader);
  written.get();
  r0.join();
  r1.join();
  check_all(log, "after the last batch", cache.snapshot(), generations);
  log.require_none();
}

TEST_CASE("writes initiated from one thread apply in the order they were initiated", "[concurrency]") {
  constexpr std::size_t n = 200, index = 0;
  const kv_cache_config config = small_config();
  std::vector<token_data> values;  // write k stores tag k + 1
  for (std::size_t k = 0; k < n; ++k) values.push_back(make_token(config.token_width(), index, static_cast<int>(k) + 1));
  struct observation { std::size_t request; std::error_code ec; std::uint64_t epoch; int tag; };
  std::mutex mutex;
  std::vector<observation> seen;  // in the order handlers took their snapshot
  std::latch all_done(n);
  asio::thread_pool pool(2);
  layer_kv_cache cache(pool, config);
  cache.async_initialize(1, asio::use_future).get();

  // Initiated back to back from this thread, none awaited.
  for (std::size_t k = 0; k < n; ++k) {
    cache.async_write(index, values[k].keys, values[k].values, [&, k](std::error_code ec) {
      {
        std::lock_guard lock(mutex);
        const kv_snapshot snap = cache.snapshot();
        kv_entry e;
        const int tag = snap.read_kv(index, e) ? -1 : tag_of(index, e.keys);
        seen.push_back({k, ec, snap.epoch(), tag});
      }
      all_done.count_down();
    });
  }
  all_done.wait();

  // Handlers may run in any order on two threads. Guaranteed: a handler's
  // snapshot holds its own write or a later one; successive snapshots never
  // go back in epoch; and, writes applying in initiation order, a newer epoch
  // never holds an older value (one epoch, one value).
  std::lock_guard lock(mutex);
  REQUIRE(seen.size() == n);
  for (std::size_t j = 0; j < n; ++j) {
    const observation& o = seen[j];
    const observation& prev = seen[j == 0 ? 0 : j - 1];
    INFO("completion " << j << ": request " << o.request << " saw epoch " << o.epoch << " tag " << o.tag
                       << "; previous completion: request " << prev.request << " saw epoch " << prev.epoch << " tag "
                       << prev.tag);
    REQUIRE_FALSE(o.ec);
    REQUIRE(o.tag >= static_cast<int>(o.request) + 1);
    REQUIRE(o.epoch >= prev.epoch);
    REQUIRE(o.tag >= prev.tag);
    if (o.epoch == prev.epoch) REQUIRE(o.tag == prev.tag);
  }
  kv_entry last;
  REQUIRE_FALSE(cache.snapshot().read_kv(index, last));
  CHECK(diff_token(index, last.keys, last.values, static_cast<int>(n)) == "");
}

TEST_CASE("epochs strictly increase with each publication and no reader sees one go back", "[concurrency]") {
  const kv_cache_config config = paged_config(64);
  const std::size_t n = config.max_tokens_per_seq;
  constexpr int snapshots_per_reader = 3000;
  std::vector<std::promise<std::uint64_t>> published(n);  // epoch seen right after write i completed
  std::vector<std::future<std::uint64_t>> published_f;
  for (auto& p : published) published_f.push_back(p.get_future());
  mismatch_log log;
  asio::thread_pool pool(2);
  layer_kv_cache cache(pool, config);
  cache.async_initialize(1, asio::use_future).get();
  const std::uint64_t initial_epoch = cache.snapshot().epoch();

  // One writer awaiting each write: every write is its own publication and
  // grows the size by one token (indices 1 .. n-1).
  auto writer = [&]() -> asio::awaitable<void> {
    for (std::size_t i = 1; i < n; ++i) {
      co_await write_token(cache, i, 1);
      published[i].set_value(cache.snapshot().epoch());
    }
  };
  // On another thread: write i's epoch is newer than write i-1's, and a
  // snapshot taken after write i completed is at least that new.
  auto checker = [&] {
    std::uint64_t previous = initial_epoch;
    for (std::size_t i = 1; i < n; ++i) {
      const std::uint64_t after_write = published_f[i].get(), later = cache.snapshot().epoch();
      if (after_write <= previous) log.add(str("write ", i, " saw epoch ", after_write, ", previous ", previous));
      if (later < after_write) log.add(str("snapshot after write ", i, ": epoch ", later, " < ", after_write));
      previous = after_write;
    }
  };
  // Readers: epochs never go back, and as every publication here appends, a
  // newer epoch shows more tokens and the same epoch the same tokens.
  auto reader = [&] {
    std::uint64_t last_epoch = 0;
    std::size_t last_size = 0;
    for (int s = 0; s < snapshots_per_reader; ++s) {
      const kv_snapshot snap = cache.snapshot();
      const std::uint64_t e = snap.epoch();
      const std::size_t size = snap.size();
      const std::string what = str("epoch ", last_epoch, " (size ", last_size, ") then ", e, " (size ", size, ")");
      if (e < last_epoch) log.add("epoch went back: " + what);
      if (e == last_epoch && size != last_size) log.add("one epoch, two sizes: " + what);
      if (e > last_epoch && size <= last_size) log.add("newer epoch without the newer write: " + what);
      last_epoch = e;
      last_size = size;
    }
  };
  auto written = asio::co_spawn(pool, writer(), asio::use_future);
  std::jthread c(checker), r0(reader), r1(reader);
  written.get();
  c.join();
  r0.join();
  r1.join();
  log.require_none();
  const kv_cache_stats stats = cache.stats();
  INFO("epoch after initialize " << initial_epoch << ", writes " << n - 1 << ", final epoch " << stats.epoch);
  CHECK(stats.epoch == initial_epoch + (n - 1));
  CHECK(cache.snapshot().epoch() == stats.epoch);
}

TEST_CASE("a snapshot moved to another thread is read and released there, freeing what only it reached",
          "[concurrency]") {
  const kv_cache_config config = paged_config(16);
  const std::size_t n = config.max_tokens_per_seq;
  const std::size_t live_blocks = (n + config.block_tokens - 1) / config.block_tokens;
  mismatch_log log;
  asio::thread_pool pool(2);
  asio::thread_pool other(2);
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
  CHECK(old.size() == 0);  // moved-from: empty
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
      const std::error_code ec = ghostlink::test::wait_ec(
          [&](auto token) { return copy.async_write(i, t.keys, t.values, std::move(token)); });
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
  const layer_kv_cache copy = original;
  CHECK(copy.get_executor() == original.get_executor());
  CHECK(original.size() == n);
  CHECK(original.stats().requests_applied == 1 + n);
  check_all(log, "original", original.snapshot(), 1);
  log.require_none();
}
