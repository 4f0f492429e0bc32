// Retention priorities (include/ghostlink/prefix_cache.hpp, kv_retention;
// docs/API.md, "Retention priorities"): the eviction order across
// priorities and within one, ranges that overlap and the last-token rule,
// durations ending on an injected clock, re-inserts, children before
// parents, pins, windowed parts within a priority, track, refusals, the
// priority in events and stats, and two threads under a tight budget.

#include "common/prefix_support.hpp"
#include "testing/hooks.hpp"

#include <atomic>
#include <chrono>
#include <thread>

namespace prefix_retention_tests {

using namespace ghostlink;
using namespace ghostlink::test::prefix;
using namespace std::chrono_literals;

namespace {

constexpr std::size_t bt = 4;  // config().block_tokens

/// A steady clock the test moves (detail::set_retention_clock), from its
/// construction until its destruction.
class fake_clock {
 public:
  fake_clock() {
    offset().store(0);
    detail::set_retention_clock(&now);
  }
  ~fake_clock() { detail::set_retention_clock(nullptr); }
  fake_clock(const fake_clock&) = delete;
  fake_clock& operator=(const fake_clock&) = delete;
  static void advance(std::chrono::milliseconds d) { offset().fetch_add(d.count()); }

 private:
  static std::atomic<std::int64_t>& offset() {
    static std::atomic<std::int64_t> ms{0};
    return ms;
  }
  static std::chrono::steady_clock::time_point now() {
    return std::chrono::steady_clock::time_point{} + std::chrono::hours(1) + std::chrono::milliseconds(offset().load());
  }
};

/// A retention of one range.
kv_retention one_range(std::size_t first, std::size_t last, std::uint8_t priority,
                       std::chrono::milliseconds duration = 0ms, std::uint8_t default_priority = 35) {
  return {.ranges = {{.first = first, .last = last, .priority = priority, .duration = duration}},
          .default_priority = default_priority};
}

/// A pool of `max_blocks` with a prefix cache of `layout` on it, whose
/// events are logged, and a sequence `other` (of a full layout: it never
/// inserts) whose appends take one block per layer each: what makes
/// evictions one at a time.
struct fixture {
  explicit fixture(std::size_t max_blocks, kv_model_layout l = kv_model_layout::full(1))
      : layout(std::move(l)),
        pool(kv_block_pool::for_caches(config(), {.max_blocks = max_blocks})),
        cache(layout, config(), pool),
        other(threads, kv_model_layout::full(layout.num_layers()), config(), pool) {
    cache.set_event_handler(log.handler());
  }
  fixture(const fixture&) = delete;
  fixture& operator=(const fixture&) = delete;
  ~fixture() { threads.join(); }

  sequence_kv_cache make() { return sequence_kv_cache(threads, layout, config(), pool); }
  /// `ids` cached at `r` (default: the plain insert), the sequence let go of.
  std::size_t insert(std::span<const token_id> ids, const std::optional<kv_retention>& r = std::nullopt) {
    const sequence_kv_cache seq = make();
    REQUIRE(append(seq, ids) == ghostlink::error_code());
    const std::size_t added = r ? cache.insert(seq, ids, "", *r) : cache.insert(seq, ids);
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
    return added;
  }
  /// More blocks for `other` (one per layer at a time, the free ones first)
  /// until one evicts something: the hashes and priorities of the entries
  /// it evicted (none if it evicted a windowed part alone).
  std::vector<std::pair<kv_block_hash, std::uint8_t>> evict() {
    const std::size_t before = log.size();
    const kv_prefix_stats was = cache.stats();
    for (int i = 0; i < 8; ++i) {
      REQUIRE(append(other, run(static_cast<token_id>(9000 + other.size()), bt)) == ghostlink::error_code());
      const kv_prefix_stats now = cache.stats();
      if (now.evicted_blocks != was.evicted_blocks || now.window_evictions != was.window_evictions) break;
    }
    std::lock_guard lock(log.mutex);
    std::vector<std::pair<kv_block_hash, std::uint8_t>> out;
    for (std::size_t i = before; i < log.events.size(); ++i)
      if (log.events[i].what == kv_prefix_event::kind::removed)
        out.emplace_back(log.events[i].hash, log.events[i].priority);
    return out;
  }
  /// The priorities of the stored events from `from` on.
  std::vector<int> stored_priorities(std::size_t from = 0) {
    std::lock_guard lock(log.mutex);
    std::vector<int> out;
    for (std::size_t i = from; i < log.events.size(); ++i)
      if (log.events[i].what == kv_prefix_event::kind::stored) out.push_back(log.events[i].priority);
    return out;
  }
  kv_block_hash hash_of(std::span<const token_id> ids) { return cache.block_hashes(ids).back(); }

  kv_model_layout layout;
  asio::thread_pool threads{2};
  kv_block_pool pool;
  kv_prefix_cache cache;
  event_log log;
  sequence_kv_cache other;
};

using evicted = std::vector<std::pair<kv_block_hash, std::uint8_t>>;

}  // namespace

TEST_CASE("retention: eviction takes the lowest priority first, least recently used among equals",
          "[prefix][retention]") {
  fixture f(5);
  const auto a = run(10, bt), b = run(20, bt), c = run(30, bt), d = run(40, bt), e = run(50, bt);
  f.insert(a, kv_retention{.default_priority = 10});
  f.insert(b);  // 35
  f.insert(c, kv_retention{.default_priority = 90});
  f.insert(d, kv_retention{.default_priority = 10});
  f.insert(e);  // 35, the most recent
  CHECK(f.stored_priorities() == std::vector<int>{10, 35, 90, 10, 35});
  // 10 (the older first), 10, then 35 (the older first), 35, then 90: the
  // order of priorities, not of recency.
  CHECK(f.evict() == evicted{{f.hash_of(a), 10}});
  CHECK(f.evict() == evicted{{f.hash_of(d), 10}});
  CHECK(f.evict() == evicted{{f.hash_of(b), 35}});
  CHECK(f.evict() == evicted{{f.hash_of(e), 35}});
  CHECK(f.evict() == evicted{{f.hash_of(c), 90}});
  const kv_prefix_stats s = f.cache.stats();
  CHECK(s.evicted_blocks == 5);
  CHECK(s.evictions_by_priority == std::array<std::uint64_t, 4>{2, 2, 0, 1});
}

TEST_CASE("retention: an attach renews recency within a priority, never across priorities", "[prefix][retention]") {
  fixture f(3);
  const auto a = run(10, bt), b = run(20, bt), c = run(30, bt);
  f.insert(a);
  f.insert(b);
  f.insert(c, kv_retention{.default_priority = 20});
  { const auto hit = f.cache.attach(f.threads, a); }  // a is now newer than b
  CHECK(f.evict() == evicted{{f.hash_of(c), 20}});     // the lowest priority, although the newest entry
  CHECK(f.evict() == evicted{{f.hash_of(b), 35}});
  CHECK(f.evict() == evicted{{f.hash_of(a), 35}});
}

TEST_CASE("retention: ranges that overlap, the later wins, and a block takes the range of its last token",
          "[prefix][retention]") {
  fixture f(100);
  const auto t = run(10, 5 * bt);  // blocks 0-4: last tokens 3, 7, 11, 15, 19
  kv_retention r{.ranges = {{.first = 0, .last = 20, .priority = 50},
                            {.first = 2, .last = 6, .priority = 90},    // holds 3 (block 0), not 7
                            {.first = 8, .last = 12, .priority = 10},   // block 2
                            {.first = 12, .last = 15, .priority = 100}, // stops before 15: block 3 stays 50
                            {.first = 11, .last = 11, .priority = 0},   // empty: holds nothing
                            {.first = 16, .last = SIZE_MAX, .priority = 60},
                            {.first = 19, .last = 20, .priority = 70}},  // later than 16-: block 4 is 70
                 .default_priority = 35};
  f.insert(t, r);
  CHECK(f.stored_priorities() == std::vector<int>{90, 50, 10, 50, 70});
  // Tokens in no range take the default.
  fixture g(100);
  g.insert(t, one_range(4, 8, 80, 0ms, 5));
  CHECK(g.stored_priorities() == std::vector<int>{5, 80, 5, 5, 5});
}

TEST_CASE("retention: children go before their parents, whatever their priorities", "[prefix][retention]") {
  fixture f(4);
  const auto t = run(10, 4 * bt);
  // Block 0 at 90, 1 at 0, 2 at 100, 3 at 50: only a leaf is evictable,
  // so the chain goes from its end.
  f.insert(t, kv_retention{.ranges = {{.first = 0, .last = 4, .priority = 90},
                                      {.first = 4, .last = 8, .priority = 0},
                                      {.first = 8, .last = 12, .priority = 100},
                                      {.first = 12, .last = 16, .priority = 50}}});
  const auto h = f.cache.block_hashes(t);
  CHECK(f.evict() == evicted{{h[3], 50}});
  CHECK(f.evict() == evicted{{h[2], 100}});
  CHECK(f.evict() == evicted{{h[1], 0}});
  CHECK(f.evict() == evicted{{h[0], 90}});
  // A second prompt beside it: its leaf at 35 goes before a parent at 0
  // whose child at 100 keeps it.
  fixture g(4);
  const auto u = run(10, 2 * bt), v = run(100, 2 * bt);
  g.insert(u,
           kv_retention{.ranges = {{.first = 0, .last = 4, .priority = 0}, {.first = 4, .last = 8, .priority = 100}}});
  g.insert(v);
  CHECK(g.evict() == evicted{{g.hash_of(v), 35}});
  CHECK(g.evict() == evicted{{g.cache.block_hashes(v)[0], 35}});
  CHECK(g.evict() == evicted{{g.hash_of(u), 100}});
}

TEST_CASE("retention: a duration ends on the steady clock, and the entry has its default priority again",
          "[prefix][retention]") {
  fake_clock clock;
  fixture f(4);
  const auto a = run(10, bt), b = run(20, bt), c = run(30, bt), d = run(40, bt);
  f.insert(a, one_range(0, SIZE_MAX, 90, 100ms, 20));  // 90 for 100 ms, then 20
  f.insert(b, one_range(0, SIZE_MAX, 90));             // 90 for as long as it is cached
  f.insert(c);                                         // 35
  f.insert(d);                                         // 35
  clock.advance(99ms);
  CHECK(f.evict() == evicted{{f.hash_of(c), 35}});  // a still at 90
  clock.advance(1ms);                               // a's deadline: now 20, below d
  CHECK(f.evict() == evicted{{f.hash_of(a), 20}});
  clock.advance(std::chrono::hours(24 * 365));      // b has no duration
  CHECK(f.evict() == evicted{{f.hash_of(d), 35}});
  CHECK(f.evict() == evicted{{f.hash_of(b), 90}});
}

TEST_CASE("retention: a re-insert takes the new priority and duration; the plain insert gives the default",
          "[prefix][retention]") {
  fake_clock clock;
  fixture f(4);  // a re-insert's sequence takes a block too
  const auto a = run(10, bt), b = run(20, bt), c = run(30, bt);
  f.insert(a);
  f.insert(b);
  f.insert(c);
  f.insert(a, kv_retention{.default_priority = 10});  // the newest, but now the lowest
  CHECK(f.stored_priorities(3).empty());               // a re-insert stores nothing
  f.insert(b, kv_retention{.default_priority = 90});
  f.insert(b);                                         // plain: back to 35, and the newest
  CHECK(f.evict() == evicted{{f.hash_of(a), 10}});
  CHECK(f.evict() == evicted{{f.hash_of(c), 35}});
  CHECK(f.evict() == evicted{{f.hash_of(b), 35}});
  // A re-insert replaces a duration: the first one's end changes nothing.
  fixture g(3);
  g.insert(a, one_range(0, SIZE_MAX, 90, 10ms, 0));
  g.insert(b, kv_retention{.default_priority = 50});
  g.insert(a, one_range(0, SIZE_MAX, 90, 50ms, 0));
  clock.advance(20ms);
  CHECK(g.evict() == evicted{{g.hash_of(b), 50}});
  clock.advance(30ms);
  CHECK(g.evict() == evicted{{g.hash_of(a), 0}});
}

TEST_CASE("retention: pinned entries are never evicted, whatever their priority", "[prefix][retention]") {
  fixture f(3);
  const auto a = run(10, 2 * bt), b = run(100, bt);
  const sequence_kv_cache held = f.make();
  REQUIRE(append(held, a) == ghostlink::error_code());
  f.cache.insert(held, a, "", kv_retention{.default_priority = 0});  // in use: `held` holds its blocks
  f.insert(b, kv_retention{.default_priority = 100});
  CHECK(f.evict() == evicted{{f.hash_of(b), 100}});
  // Nothing else is evictable: the write fails, the pinned entries stay.
  CHECK(append(f.other, run(500, bt)) == kv_errc::capacity_exhausted);
  CHECK(f.cache.stats().cached_entries == 2);
  CHECK(f.cache.match(a) == 2 * bt);
  // Let go of block 1: it goes at last; block 0, still in use, stays.
  REQUIRE(truncate(held, bt) == ghostlink::error_code());
  CHECK(f.evict() == evicted{{f.hash_of(a), 0}});
  CHECK(append(f.other, run(600, bt)) == kv_errc::capacity_exhausted);
  CHECK(f.cache.match(a) == bt);
}

TEST_CASE("retention: a windowed part goes by its entry's priority, then by the hybrid policy within it",
          "[prefix][retention]") {
  // Layer 0 windowed (8 tokens), layer 1 full: x (the older) and y, each
  // tracked (so that their windowed blocks go in), then y attached, which
  // reads the windowed parts of its blocks 1 and 2, not 0's.
  const auto x = run(10, 3 * bt), y = run(100, 3 * bt);
  const auto cached = [&](fixture& f, const std::optional<kv_retention>& x_retention) {
    {
      const sequence_kv_cache sx = f.make(), sy = f.make();
      if (x_retention)
        f.cache.track(sx, "", *x_retention);
      else
        f.cache.track(sx);
      f.cache.track(sy);
      REQUIRE(append(sx, x) == ghostlink::error_code());
      REQUIRE(append(sy, y) == ghostlink::error_code());
    }
    { const auto hit = f.cache.attach(f.threads, y); }
    REQUIRE(f.cache.stats().idle_blocks == 6);
    REQUIRE(f.pool.stats().blocks_cached == 12);
  };
  // x at 90: within y's priority the hybrid order, x untouched though older.
  // y's block 0's windowed part (no window read it since its insert), then
  // y's leaf (touched before the windows the attach read).
  fixture f(12, kv_model_layout::interleaved(2, 2, 8));
  cached(f, kv_retention{.default_priority = 90});
  const evicted gone = f.evict();  // one block per layer
  CHECK(f.cache.stats().window_evictions == 1);
  REQUIRE(gone.size() == 1);
  CHECK(gone[0].first == f.hash_of(y));
  CHECK(gone[0].second == 35);
  CHECK(f.cache.match(x) == x.size());
  CHECK(f.cache.match(y) == 0);  // any match of y needs block 0's windowed part
  // At equal priorities x, the older, goes first: its leaf, older than
  // every windowed part (an insert touches a block, then its windowed part).
  fixture g(12, kv_model_layout::interleaved(2, 2, 8));
  cached(g, std::nullopt);
  CHECK(g.evict() == evicted{{g.hash_of(x), 35}});
  CHECK(g.cache.stats().window_evictions == 0);
  CHECK(g.cache.match(y) == y.size());
  CHECK(g.cache.match(x) == 2 * bt);
}

TEST_CASE("retention: track gives each block the priority of its last token's position in the sequence",
          "[prefix][retention]") {
  fixture f(4);
  const auto t = run(10, 3 * bt);
  {
    const sequence_kv_cache seq = f.make();
    f.cache.track(seq, "", one_range(0, 2 * bt, 90));  // the first two blocks: a system prompt
    for (std::size_t i = 0; i < t.size(); ++i)          // token by token, as a decode
      REQUIRE(append(seq, std::span(t).subspan(i, 1)) == ghostlink::error_code());
  }
  CHECK(f.stored_priorities() == std::vector<int>{90, 90, 35});
  {  // An attached prefix tracked at another retention is re-inserted at it.
    const sequence_kv_cache hit = f.cache.attach(f.threads, t);
    REQUIRE(hit.size() == t.size());
    f.cache.track(hit, "", kv_retention{.default_priority = 5});
    REQUIRE(append(hit, run(500, 1)) == ghostlink::error_code());
  }
  CHECK(f.stored_priorities().size() == 3);  // nothing new stored
  const auto h = f.cache.block_hashes(t);
  CHECK(f.evict() == evicted{{h[2], 5}});
  CHECK(f.evict() == evicted{{h[1], 5}});
  CHECK(f.evict() == evicted{{h[0], 5}});
}

TEST_CASE("retention: a priority above 100, first past last or a negative duration is invalid_retention, "
          "nothing cached",
          "[prefix][retention]") {
  fixture f(100);
  const sequence_kv_cache seq = f.make();
  const auto t = run(10, 2 * bt);
  REQUIRE(append(seq, t) == ghostlink::error_code());
  const std::vector<kv_retention> bad{
      kv_retention{.default_priority = 101},
      one_range(0, 4, 101),
      one_range(5, 4, 50),
      one_range(0, 4, 50, -1ms),
      kv_retention{.ranges = {{.priority = 50}, {.first = 0, .last = 8, .priority = 255}}},
  };
  for (const kv_retention& r : bad) {
    const auto refused = [](auto&& call) {
      try {
        call();
      } catch (const std::system_error& e) {
        return e.code() == kv_errc::invalid_retention;
      }
      return false;
    };
    CHECK(refused([&] { f.cache.insert(seq, t, "", r); }));
    CHECK(refused([&] { f.cache.insert_stored_tokens(seq, "", r); }));
    CHECK(refused([&] { f.cache.track(seq, "", r); }));
  }
  REQUIRE(append(seq, run(50, bt)) == ghostlink::error_code());  // an untracked drain
  CHECK(f.cache.stats().cached_entries == 0);
  CHECK(f.log.size() == 0);
  // The limits themselves are valid.
  CHECK(f.cache.insert(seq, t, "", one_range(0, 8, 100, 0ms, 0)) == 2);
  CHECK(f.stored_priorities() == std::vector<int>{100, 100});
}

TEST_CASE("retention: 2 threads inserting at different priorities under a tight budget keep the high one cached",
          "[prefix][retention]") {
  // A system prompt of 4 blocks at 90. Thread 1: the system prompt and a
  // follow-up of 2 blocks at 35, attached and inserted over and over;
  // thread 2: one-off prompts of 4 blocks at 10. In use at most 6 + 4
  // blocks, the system prompt 4 more: a budget of 16 always leaves a lower
  // entry to evict before the system prompt's.
  fixture f(16);
  const auto system = run(1, 4 * bt);
  const kv_retention keep = one_range(0, system.size(), 90);
  f.insert(system, keep);
  std::atomic<bool> failed{false};
  std::thread chats([&] {
    for (token_id i = 0; i < 60 && !failed; ++i) {
      const auto prompt = cat(system, run(1000 + 100 * i, 2 * bt));
      const sequence_kv_cache seq = f.cache.attach(f.threads, prompt);
      if (seq.size() != system.size() ||
          append(seq, std::span(prompt).subspan(seq.size())) != ghostlink::error_code()) {
        failed = true;
        break;
      }
      f.cache.insert(seq, prompt, "", keep);
    }
  });
  std::thread documents([&] {
    for (token_id i = 0; i < 60 && !failed; ++i) {
      const auto prompt = run(100000 + 100 * i, 4 * bt);
      const sequence_kv_cache seq = f.make();
      if (append(seq, prompt) != ghostlink::error_code()) {
        failed = true;
        break;
      }
      f.cache.insert(seq, prompt, "", kv_retention{.default_priority = 10});
    }
  });
  chats.join();
  documents.join();
  CHECK_FALSE(failed);
  CHECK(f.cache.match(system) == system.size());
  const kv_prefix_stats s = f.cache.stats();
  CHECK(s.evictions_by_priority[0] > 0);  // the documents'
  CHECK(s.evictions_by_priority[1] > 0);  // the follow-ups'
  CHECK(s.evictions_by_priority[3] == 0);  // never the system prompt's
  CHECK(s.evictions_by_priority[0] + s.evictions_by_priority[1] + s.evictions_by_priority[2] +
            s.evictions_by_priority[3] ==
        s.evicted_blocks);
}

}  // namespace prefix_retention_tests
