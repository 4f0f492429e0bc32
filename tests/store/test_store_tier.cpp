// A prefix cache's store tier in its events and dump (events.hpp,
// kv_prefix_tier; block_store.hpp, kv_store_receipt): the entries its file
// store holds are stored events of the store tier once written, with their
// parents and token ids; removed when the store evicts them or a fetch
// misses them; forgotten by clear(); listed by dump(); and a mirror of the
// events equals the dump throughout. A receipt that outlives its cache is
// harmless.

#include "common/files.hpp"
#include "common/prefix_support.hpp"
#include "common/store_fixture.hpp"

#include "store/entry.hpp"

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <optional>
#include <vector>

namespace store_tier_tests {

using namespace ghostlink;
using namespace ghostlink::test::prefix;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t bt = 4;  // config().block_tokens

/// The entry bytes of config() with 2 layers: what a file of the store holds.
std::size_t entry_bytes() {
  return detail::entry_geometry(kv_model_layout::full(2), config(), detail::codec_of<float>).entry_bytes(2);
}

/// The events of `log` of `tier` and kind `what`, their hashes in order.
std::vector<kv_block_hash> hashes_of(event_log& log, kv_prefix_tier tier, kv_prefix_event::kind what) {
  std::lock_guard lock(log.mutex);
  std::vector<kv_block_hash> out;
  for (const kv_prefix_event& e : log.events)
    if (e.tier == tier && e.what == what) out.push_back(e.hash);
  return out;
}

/// `h` sorted: the store's I/O threads settle puts in any order.
std::vector<kv_block_hash> sorted(std::vector<kv_block_hash> h) {
  std::ranges::sort(h);
  return h;
}

/// The block `b` of `ids`.
std::vector<token_id> block_of(const std::vector<token_id>& ids, std::size_t b) {
  return {ids.begin() + static_cast<std::ptrdiff_t>(b * bt), ids.begin() + static_cast<std::ptrdiff_t>((b + 1) * bt)};
}

}  // namespace

TEST_CASE("store tier: a write-through file store's entries are stored events of the store tier once written") {
  store_fixture f;
  event_log log;
  f.cache.set_event_handler(log.handler());
  const std::vector<token_id> ids = run(100, 16);
  const std::vector<kv_block_hash> h = f.cache.block_hashes(ids);
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();  // every put settled: its receipt told
  CHECK(hashes_of(log, kv_prefix_tier::ram, kv_prefix_event::kind::stored) == h);
  CHECK(sorted(hashes_of(log, kv_prefix_tier::store, kv_prefix_event::kind::stored)) == sorted(h));

  const kv_prefix_dump d = f.cache.dump();
  CHECK(d.entries.size() == 8);
  const event_mirror m(d);
  for (std::size_t b = 0; b < 4; ++b) {
    const event_mirror::entry want{b == 0 ? std::nullopt : std::optional(h[b - 1]), block_of(ids, b)};
    CHECK(m.at(h[b], kv_prefix_tier::store) == want);
    CHECK(m.at(h[b]) == want);
  }
  CHECK(replay_onto(log, {}).entries == m.entries);
  CHECK(f.cache.store()->medium() == "FILE");

  SECTION("a later put of an entry the store holds changes nothing of the tier") {
    f.cache.clear();  // forgets the store tier (its files stay)
    CHECK(f.cache.dump().entries.empty());
    REQUIRE(diff(f.attach(ids).second, ids) == "");  // from the store: put no more
    f.store->flush();
    CHECK(f.cache.dump().entries.size() == 4);
    CHECK(event_mirror(f.cache.dump()).count(kv_prefix_tier::store) == 0);
    CHECK(replay_onto(log, {}).entries == event_mirror(f.cache.dump()).entries);
  }
}

TEST_CASE("store tier: the entries the file store evicts under its budget are removed events of the store tier") {
  store_fixture f({.max_bytes = 2 * entry_bytes()});
  event_log log;
  f.cache.set_event_handler(log.handler());
  const std::vector<token_id> ids = run(100, 16);
  const std::vector<kv_block_hash> h = f.cache.block_hashes(ids);
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();
  CHECK(f.store->stats().evictions == 2);
  CHECK(sorted(hashes_of(log, kv_prefix_tier::store, kv_prefix_event::kind::stored)) == sorted(h));
  const std::vector<kv_block_hash> removed = hashes_of(log, kv_prefix_tier::store, kv_prefix_event::kind::removed);
  CHECK(removed.size() == 2);
  const event_mirror m(f.cache.dump());
  CHECK(m.count(kv_prefix_tier::store) == 2);
  for (std::size_t b = 0; b < 4; ++b) {  // each block either evicted or still held, with its parent
    const bool gone = std::ranges::find(removed, h[b]) != removed.end();
    CHECK(m.entries.contains({kv_prefix_tier::store, h[b]}) == !gone);
    if (!gone) CHECK(m.at(h[b], kv_prefix_tier::store).parent == (b == 0 ? std::nullopt : std::optional(h[b - 1])));
  }
  CHECK(replay_onto(log, {}).entries == m.entries);
}

TEST_CASE("store tier: a fetch that misses an entry takes it out of the store tier") {
  store_fixture f({}, kv_store_policy::write_back);
  event_log log;
  f.cache.set_event_handler(log.handler());
  const std::vector<token_id> ids = run(100, 16);
  const std::vector<kv_block_hash> h = f.cache.block_hashes(ids);
  REQUIRE(f.insert(ids) == 4);
  CHECK(hashes_of(log, kv_prefix_tier::store, kv_prefix_event::kind::stored).empty());  // written back: not yet
  f.cache.clear();  // every entry leaves RAM for the store, in no particular order
  f.store->flush();
  CHECK(sorted(hashes_of(log, kv_prefix_tier::store, kv_prefix_event::kind::stored)) == sorted(h));
  REQUIRE(fs::remove(f.file_of(ids, 2)));  // gone behind the store's back

  auto [ec, seq] = f.attach(ids);
  CHECK(ec == ghostlink::error_code());
  CHECK(seq.size() == 8);  // the match ends at the missing block
  CHECK(hashes_of(log, kv_prefix_tier::store, kv_prefix_event::kind::removed) == std::vector{h[2]});
  const event_mirror m(f.cache.dump());
  CHECK(m.count(kv_prefix_tier::store) == 3);
  CHECK(m.count(kv_prefix_tier::ram) == 2);
  CHECK(replay_onto(log, {}).entries == m.entries);
}

TEST_CASE("store tier: a receipt the store keeps after its cache is gone calls nothing") {
  test::temp_dir dir;
  asio::thread_pool io(2);
  asio::thread_pool threads(2);
  kv_block_pool pool = kv_block_pool::for_caches<float>(config(), {.max_blocks = 1000});
  const auto store = std::make_shared<kv_file_store>(
      dir.path, kv_file_store_limits{.max_bytes = 4 * entry_bytes(), .io_executor = io.get_executor()});
  event_log log;
  {
    kv_prefix_cache gone(2, config(), pool, {.model = "model-a", .store = store});
    gone.set_event_handler(log.handler());
    REQUIRE(insert_idle(gone, threads, pool, run(100, 16)) == 4);
    store->flush();
  }
  const std::size_t before = log.size();
  // Another cache's puts evict the first one's files: their receipts find no cache.
  kv_prefix_cache other(2, config(), pool, {.model = "model-b", .store = store});
  REQUIRE(insert_idle(other, threads, pool, run(500, 16)) == 4);
  store->flush();
  CHECK(store->stats().evictions == 4);
  CHECK(log.size() == before);
  threads.join();
  io.join();
}

}  // namespace store_tier_tests
