// A prefix cache's dump and its events' token ids (include/ghostlink/
// prefix_cache.hpp, dump(); events.hpp, kv_prefix_dump): every entry with
// its parent and token ids, the number of the last event before it, and a
// mirror that applies the events after that number to the dump matching
// the cache exactly while two threads insert and evict.

#include "common/prefix_support.hpp"

#include <atomic>
#include <map>
#include <optional>
#include <thread>

namespace prefix_dump_tests {

using namespace ghostlink;
using namespace ghostlink::test::prefix;

namespace {

constexpr std::size_t bt = 4;  // config().block_tokens

/// The block `b` of `ids`.
std::vector<token_id> block_of(const std::vector<token_id>& ids, std::size_t b) {
  return {ids.begin() + static_cast<std::ptrdiff_t>(b * bt), ids.begin() + static_cast<std::ptrdiff_t>((b + 1) * bt)};
}

}  // namespace

TEST_CASE("dump: every entry with its parent and token ids, and the number of the last event", "[prefix][dump]") {
  fixture<> f(1000, 2);
  event_log log;
  f.cache.set_event_handler(log.handler());
  CHECK(f.cache.dump().entries.empty());
  CHECK(f.cache.dump().sequence == 0);

  const auto a = run(10, 3 * bt), b = cat(run(10, bt), run(50, bt));  // b shares a's first block
  REQUIRE(f.insert_idle(a) == 3);
  REQUIRE(f.insert_idle(b) == 1);
  const kv_prefix_dump d = f.cache.dump();
  CHECK(d.sequence == 4);
  REQUIRE(d.entries.size() == 4);
  const std::vector<kv_block_hash> ha = f.cache.block_hashes(a), hb = f.cache.block_hashes(b);
  const event_mirror m(d);
  CHECK(m.at(ha[0]) == event_mirror::entry{std::nullopt, block_of(a, 0)});
  CHECK(m.at(ha[1]) == event_mirror::entry{ha[0], block_of(a, 1)});
  CHECK(m.at(ha[2]) == event_mirror::entry{ha[1], block_of(a, 2)});
  CHECK(m.at(hb[1]) == event_mirror::entry{ha[0], block_of(b, 1)});
  for (const kv_prefix_dump::entry& e : d.entries) CHECK(e.priority == kv_retention::default_value);

  // The stored events carry the same token ids.
  CHECK(replay_onto(log, {}).entries == m.entries);

  // clear(): nothing left, the cleared event counted.
  f.cache.clear();
  const kv_prefix_dump after = f.cache.dump();
  CHECK(after.entries.empty());
  CHECK(after.sequence == 5);
}

TEST_CASE("dump: entries a tracked sequence caches carry its token ids", "[prefix][dump]") {
  fixture<> f(1000, 2);
  event_log log;
  f.cache.set_event_handler(log.handler());
  const auto ids = run(100, 2 * bt + 1);
  sequence_kv_cache seq = f.prefill({});
  f.cache.track(seq);
  REQUIRE(append(seq, std::span(ids).first(bt + 2)) == ghostlink::error_code());
  REQUIRE(append(seq, std::span(ids).subspan(bt + 2)) == ghostlink::error_code());
  const std::vector<kv_block_hash> h = f.cache.block_hashes(ids);
  const event_mirror m(f.cache.dump());
  REQUIRE(m.entries.size() == 2);
  CHECK(m.at(h[0]) == event_mirror::entry{std::nullopt, block_of(ids, 0)});
  CHECK(m.at(h[1]) == event_mirror::entry{h[0], block_of(ids, 1)});
  CHECK(replay_onto(log, {}).entries == m.entries);
}

TEST_CASE("dump: the dump and the events after its number mirror the cache while 2 threads insert and evict",
          "[prefix][dump][concurrency]") {
  // 64 blocks for 2 layers: each thread's 3-block prompts evict others' all along.
  fixture<> f(64, 2);
  event_log log;
  f.cache.set_event_handler(log.handler());
  std::atomic<bool> go_on{true};
  std::atomic<std::size_t> inserts{0}, failures{0};
  auto writer = [&](token_id base) {  // no Catch2 assertion off the main thread
    for (std::size_t i = 0; i < 4'000 && go_on.load(); ++i) {
      // A shared first block, then one of 200 prompts.
      const auto ids = cat(run(1, bt), run(base + static_cast<token_id>(i % 200) * 8, 2 * bt));
      sequence_kv_cache seq(f.threads, 2, config(), f.pool);
      if (append(seq, ids) != ghostlink::error_code()) failures.fetch_add(1);
      f.cache.insert(seq, ids);
      if (truncate(seq, 0) != ghostlink::error_code()) failures.fetch_add(1);
      inserts.fetch_add(1);
    }
  };
  std::thread t1(writer, 10'000), t2(writer, 20'000);
  std::vector<kv_prefix_dump> dumps;
  for (int i = 0; i < 20; ++i) {
    // After some inserts each time (bounded: the writers end on their own).
    for (const std::size_t at = inserts.load(); inserts.load() < at + 20 && inserts.load() < 8'000;)
      std::this_thread::yield();
    dumps.push_back(f.cache.dump());
  }
  go_on = false;
  t1.join();
  t2.join();
  CHECK(failures == 0);
  const kv_prefix_dump last = f.cache.dump();
  CHECK(last.sequence == log.events.size());
  const event_mirror truth(last);
  CHECK(replay_onto(log, {}).entries == truth.entries);
  CHECK(f.cache.stats().evicted_blocks > 0);
  for (std::size_t i = 0; i < dumps.size(); ++i) {
    INFO("dump " << i << " as of event " << dumps[i].sequence << " of " << log.events.size());
    CHECK(replay_onto(log, dumps[i]).entries == truth.entries);
  }
}

}  // namespace prefix_dump_tests
