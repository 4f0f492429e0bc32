// Visibility under concurrency: read-your-writes, snapshot isolation,
// atomic batches, per-thread order and monotonic epochs.

#include "common/concurrency_support.hpp"

#include "testing/hooks.hpp"

#include <condition_variable>

namespace concurrency_visibility_tests {

using namespace ghostlink;
using namespace ghostlink::test::concurrency;
using ghostlink::test::run;

TEST_CASE("a write is in snapshot() and size() on another thread once its handler has run", "[concurrency]") {
  const kv_cache_config config = paged_config(32);
  const std::size_t n = config.max_tokens_per_seq;
  struct completion {
    ghostlink::error_code ec;
    std::size_t size;
    kv_snapshot snap;
  };  // taken inside the handler
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
    if (ghostlink::error_code ec = snap.read_kv(i, e))
      log.add(
          str(who, ": snapshot (epoch ", snap.epoch(), ", size ", snap.size(), ") read_kv(", i, "): ", ec.message()));
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
    cache.async_write(i, tokens[i].keys, tokens[i].values, [&cache, &handled, i](ghostlink::error_code ec) {
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
    for (int gen = 2; gen <= generations; ++gen)
      // NOLINTNEXTLINE(readability-suspicious-call-argument): begin, end, tag as meant
      co_await write_batch(cache, 0, batch_tokens, gen);
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
  for (std::size_t k = 0; k < n; ++k)
    values.push_back(make_token(config.token_width(), index, static_cast<int>(k) + 1));
  struct observation {
    std::size_t request;
    ghostlink::error_code ec;
    std::uint64_t epoch;
    int tag;
  };
  std::mutex mutex;
  std::vector<observation> seen;  // in the order handlers took their snapshot
  std::latch all_done(n);
  asio::thread_pool pool(2);
  layer_kv_cache cache(pool, config);
  cache.async_initialize(1, asio::use_future).get();

  // Initiated back to back from this thread, none awaited.
  for (std::size_t k = 0; k < n; ++k) {
    cache.async_write(index, values[k].keys, values[k].values, [&, k](ghostlink::error_code ec) {
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

namespace {

/// Holds one chosen thread inside its submit, between queueing its request
/// and counting it (detail::set_enqueued_hook), until released.
struct submit_gate {
  static inline submit_gate* active = nullptr;
  static inline thread_local bool hold_here = false;

  std::mutex mutex;
  std::condition_variable changed;
  bool held = false, released = false;

  submit_gate() {
    active = this;
    detail::set_enqueued_hook(&hook);
  }
  submit_gate(const submit_gate&) = delete;
  submit_gate& operator=(const submit_gate&) = delete;
  ~submit_gate() {
    release();
    detail::set_enqueued_hook(nullptr);
    active = nullptr;
  }
  static void hook() {
    if (!std::exchange(hold_here, false)) return;
    std::unique_lock lock(active->mutex);
    active->held = true;
    active->changed.notify_all();
    active->changed.wait(lock, [] { return active->released; });
  }
  void wait_held() {
    std::unique_lock lock(mutex);
    changed.wait(lock, [this] { return held; });
  }
  void release() {
    std::lock_guard lock(mutex);
    released = true;
    changed.notify_all();
  }
};

}  // namespace

TEST_CASE("one thread's writes apply in order after a drain took another thread's request before it was counted",
          "[concurrency]") {
  // The window: a request is queued, then counted. A drain that takes it in
  // between leaves the actor's count of pending requests one short until its
  // submitter counts it; this thread's next requests must still queue behind
  // each other, not overtake an earlier one that waits in the mailbox.
  const kv_cache_config config = small_config();
  const std::size_t w = config.token_width();
  std::vector<token_data> tags;  // tags[k] is token 0 written with tag k
  for (int k = 0; k <= 4; ++k) tags.push_back(make_token(w, 0, k));
  std::atomic<int> failures{0}, completions{0};
  auto done = [&](ghostlink::error_code ec) {
    failures += ec ? 1 : 0;
    ++completions;
  };
  asio::io_context io;  // run only by this thread, when the test says
  layer_kv_cache cache = ghostlink::test::initialized_cache(io, config);
  submit_gate gate;

  cache.async_write(0, tags[1].keys, tags[1].values, done);  // schedules a drain (not run yet)
  cache.async_write(0, tags[1].keys, tags[1].values, done);  // queued behind it
  std::thread other([&] {
    submit_gate::hold_here = true;
    cache.async_write(0, tags[1].keys, tags[1].values, done);  // queued, then held before it is counted
  });
  gate.wait_held();
  io.poll();  // the drain takes all three, one of them not yet counted
  io.restart();
  REQUIRE(completions == 3);

  cache.async_write(0, tags[2].keys, tags[2].values, done);  // first of this thread's next two
  cache.async_write(0, tags[3].keys, tags[3].values, done);  // must apply after it
  io.poll();  // runs what is ready, never waits for the held request
  io.restart();
  gate.release();
  other.join();  // the held request is counted now
  io.run();
  REQUIRE(completions == 5);
  CHECK(failures == 0);
  kv_entry e;
  REQUIRE_FALSE(cache.snapshot().read_kv(0, e));
  CHECK(tag_of(0, e.keys) == 3);
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

}  // namespace concurrency_visibility_tests
