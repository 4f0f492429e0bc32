// The Redis tier on a Redis Cluster (redis_store.hpp,
// kv_redis_store_options::cluster): key slots as the specification defines
// them; entries spread over every master and fetched back exactly; a slot
// moved (MOVED) or migrating (ASK) while the store's map is stale still
// finds its entries; a master killed gives misses and counted write errors
// for its slots only; a value tampered with is a miss, never data.
//
// Each test starts its own cluster (common/redis_process.hpp: redis-server
// and redis-cli found on PATH, without them these tests fail) of three
// masters on free loopback ports, and stops them by their process ids.
#include "common/files.hpp"
#include "common/prefix_support.hpp"
#include "common/redis_process.hpp"

#include <netinet/in.h>
#include <signal.h>  // NOLINT(modernize-deprecated-headers): SIGKILL
#include <sys/socket.h>
#include <unistd.h>

#include <ghostlink/redis_store.hpp>

#include "store/redis/cluster.hpp"
#include "store/redis/connection.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace redis_cluster_tests {

using namespace ghostlink;
using namespace ghostlink::test::prefix;
using ghostlink::test::redis::call;
using ghostlink::test::redis::cluster_nodes;
using ghostlink::test::redis::text;
using std::chrono::milliseconds;
using clock_type = std::chrono::steady_clock;
using bytes = std::vector<std::byte>;

namespace {

/// What a fetch delivered: by index, its bytes (a miss: empty) and how
/// many times it was delivered.
struct fetched {
  bool answered = false;  ///< every index within 10 s
  std::vector<bytes> got;
  std::vector<int> calls;
};

/// A store's fetch of `hashes`, once every index is answered (10 s at
/// most). No assertion: callable from any thread.
fetched fetch_unchecked(kv_block_store& store, const std::vector<kv_block_hash>& hashes) {
  struct state {
    std::mutex mutex;
    fetched out;
    std::size_t left = 0;
    std::promise<void> done;
  };
  auto s = std::make_shared<state>();
  s->out.got.resize(hashes.size());
  s->out.calls.resize(hashes.size());
  s->left = hashes.size();
  std::future<void> done = s->done.get_future();
  store.fetch(hashes, [s](std::size_t i, bytes b) {
    std::lock_guard lock(s->mutex);
    s->out.got[i] = std::move(b);
    if (++s->out.calls[i] == 1 && --s->left == 0) s->done.set_value();
    return true;
  });
  const bool answered = done.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  std::lock_guard lock(s->mutex);
  fetched out = s->out;
  out.answered = answered;
  return out;
}

/// The values a fetch of `hashes` delivered, by index: each delivered
/// exactly once, within 10 s.
std::vector<bytes> fetch_all(kv_block_store& store, const std::vector<kv_block_hash>& hashes) {
  fetched f = fetch_unchecked(store, hashes);
  REQUIRE(f.answered);
  for (std::size_t i = 0; i < hashes.size(); ++i) CHECK(f.calls[i] == 1);
  return std::move(f.got);
}

/// A cluster, a store on it (its seeds: the three masters) and a prefix
/// cache of 2 layers on the store. The thread pool is joined and the store
/// gone before the cluster stops.
struct cluster_fixture {
  explicit cluster_fixture(kv_redis_store_options o = {}) {
    o.cluster = true;
    store = std::make_shared<kv_redis_store>(nodes.endpoints(), o);
    cache.emplace(2, config(), pool, kv_prefix_options{.model = "model-a", .store = store});
  }
  cluster_fixture(const cluster_fixture&) = delete;
  cluster_fixture& operator=(const cluster_fixture&) = delete;
  ~cluster_fixture() {
    store->flush();
    threads.join();
    cache.reset();
    store.reset();
  }

  std::size_t insert(std::span<const token_id> ids) { return insert_idle(*cache, threads, pool, ids); }
  attach_result attach(std::span<const token_id> ids) { return attach_waited(*cache, threads, ids); }
  /// Every prompt inserted (16 entries each) and flushed: their blocks' hashes, in order.
  template <class Prompts>
  std::vector<kv_block_hash> insert_all(const Prompts& prompts) {
    std::vector<kv_block_hash> hashes;
    for (const auto& ids : prompts) {
      REQUIRE(insert(ids) == 16);
      for (const kv_block_hash& h : cache->block_hashes(ids)) hashes.push_back(h);
    }
    store->flush();
    return hashes;
  }

  cluster_nodes nodes;
  asio::thread_pool threads{2};
  kv_block_pool pool = kv_block_pool::for_caches<float>(config(), {.max_blocks = 1000});
  std::shared_ptr<kv_redis_store> store;
  std::optional<kv_prefix_cache> cache;
};

/// 16 tokens: 4 full blocks of config().
std::vector<token_id> prompt(token_id first = 100) { return run(first, 16); }

/// 64 tokens (16 blocks) each, 3 prompts: 48 entries.
std::vector<std::vector<token_id>> long_prompts() { return {run(100, 64), run(200, 64), run(300, 64)}; }

}  // namespace

TEST_CASE("a key's slot is the CRC16 (XMODEM) of the key or of its hash tag, mod 16384; store keys have no tag") {
  CHECK(detail::redis_crc16("123456789") == 0x31C3);
  CHECK(detail::redis_crc16("") == 0);
  // The values the Redis documentation gives for CLUSTER KEYSLOT.
  CHECK(detail::redis_key_slot("somekey") == 11058);
  CHECK(detail::redis_key_slot("foo{hash_tag}") == 2515);
  // A hash tag: the bytes between the first { and the first } after it.
  CHECK(detail::redis_key_slot("{user1000}.following") == detail::redis_key_slot("user1000"));
  CHECK(detail::redis_key_slot("{user1000}.followers") == detail::redis_key_slot("{user1000}.following"));
  CHECK(detail::redis_key_slot("foo{bar}{zap}") == detail::redis_key_slot("bar"));
  CHECK(detail::redis_key_slot("foo{{bar}}zap") == detail::redis_key_slot("{bar"));
  // No tag: an empty {} or a { never closed hashes the whole key.
  CHECK(detail::redis_key_slot("foo{}{bar}") == detail::redis_crc16("foo{}{bar}") % 16384);
  CHECK(detail::redis_key_slot("foo{bar") == detail::redis_crc16("foo{bar") % 16384);
  kv_block_hash h;
  for (std::size_t i = 0; i < h.bytes.size(); ++i) h.bytes[i] = static_cast<std::uint8_t>(i * 37 + 11);
  const std::string key = kv_redis_store::key_of(h);
  CHECK(key.find_first_of("{}") == std::string::npos);
  CHECK(detail::redis_key_slot(key) == detail::redis_crc16(key) % 16384);
}

TEST_CASE("MOVED and ASK errors and CLUSTER SLOTS replies parse; malformed or hostile replies do not") {
  using detail::parse_redis_redirect;
  const auto moved = parse_redis_redirect("MOVED 3999 127.0.0.1:6381");
  REQUIRE(moved.has_value());
  CHECK(!moved->ask);
  CHECK(moved->slot == 3999);
  CHECK(moved->host == "127.0.0.1");
  CHECK(moved->port == 6381);
  const auto ask = parse_redis_redirect("ASK 16383 :7000");
  REQUIRE(ask.has_value());
  CHECK(ask->ask);
  CHECK(ask->slot == 16383);
  CHECK(ask->host.empty());  // the node that answered
  CHECK(ask->port == 7000);
  for (const char* bad : {"MOVED 16384 h:1", "MOVED 1 h:0", "MOVED 1 h:70000", "MOVED x h:1", "MOVED 1 h", "MOVED 1",
                          "CLUSTERDOWN The cluster is down", "TRYAGAIN", "ERR MOVED 1 h:1"})
    CHECK(!parse_redis_redirect(bad).has_value());

  // CLUSTER SLOTS as Redis 7 answers it: [first, last, [host, port, id, {}]].
  const std::string slots = "*2\r\n"
                            "*3\r\n:0\r\n:8191\r\n*4\r\n$9\r\n127.0.0.1\r\n:7000\r\n$2\r\nid\r\n*0\r\n"
                            "*3\r\n:8192\r\n:16383\r\n*4\r\n$0\r\n\r\n:7001\r\n$2\r\nid\r\n*0\r\n";
  detail::redis_reply reply;
  REQUIRE(detail::parse_redis_reply(slots, reply) == slots.size());
  for (std::size_t cut = 0; cut < slots.size(); ++cut) {  // any prefix: not yet a reply
    detail::redis_reply part;
    CHECK(detail::parse_redis_reply(std::string_view(slots).substr(0, cut), part) == 0);
  }
  const auto ranges = detail::parse_cluster_slots(reply);
  REQUIRE(ranges.has_value());
  REQUIRE(ranges->size() == 2);
  CHECK((*ranges)[0].first == 0);
  CHECK((*ranges)[0].last == 8191);
  CHECK((*ranges)[0].host == "127.0.0.1");
  CHECK((*ranges)[0].port == 7000);
  CHECK((*ranges)[1].first == 8192);
  CHECK((*ranges)[1].last == 16383);
  CHECK((*ranges)[1].host.empty());
  CHECK((*ranges)[1].port == 7001);

  detail::redis_reply other;
  REQUIRE(detail::parse_redis_reply("*1\r\n*3\r\n:9\r\n:3\r\n*2\r\n$1\r\nh\r\n:1\r\n", other) != 0);
  CHECK(!detail::parse_cluster_slots(other).has_value());  // last < first
  REQUIRE(detail::parse_redis_reply("+OK\r\n", other) != 0);
  CHECK(!detail::parse_cluster_slots(other).has_value());

  // Arrays nested too deep or too long are protocol errors; a long one not
  // yet buffered waits without allocating its elements.
  std::string deep;
  for (std::size_t i = 0; i <= detail::max_redis_depth; ++i) deep += "*1\r\n";
  deep += ":1\r\n";
  CHECK_THROWS_AS(detail::parse_redis_reply(deep, other), std::runtime_error);
  CHECK_THROWS_AS(detail::parse_redis_reply("*99999999999\r\n", other), std::runtime_error);
  CHECK(detail::parse_redis_reply("*1000000\r\n:1\r\n", other) == 0);
}

TEST_CASE("a cluster store's endpoints must be TCP") {
  CHECK_THROWS_AS(kv_redis_store({{.unix_socket = "/tmp/s"}}, {.cluster = true}), std::invalid_argument);
  CHECK_THROWS_AS(kv_redis_store({}, {.cluster = true}), std::invalid_argument);
}

TEST_CASE("on a cluster of 3 masters, entries spread over every master and come back exactly") {
  cluster_fixture f;
  const auto prompts = long_prompts();
  const std::vector<kv_block_hash> hashes = f.insert_all(prompts);
  kv_store_stats s = f.store->stats();
  CHECK(s.puts == 48);
  CHECK(s.stored == 48);
  CHECK(s.write_errors == 0);

  std::int64_t total = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    INFO("master " << i);
    CHECK(f.nodes.dbsize(i) > 0);
    total += f.nodes.dbsize(i);
  }
  CHECK(total == 48);

  // Fetched straight from the store, from 2 threads at once: every value
  // is the one its master holds.
  std::vector<bytes> expected;
  for (const kv_block_hash& h : hashes) {
    const std::string key = kv_redis_store::key_of(h);
    expected.push_back(f.nodes.value_at(f.nodes.owner_of(key), key));
    REQUIRE(expected.back().size() > 512);
  }
  std::array<fetched, 2> got;
  {
    std::jthread a([&] { got[0] = fetch_unchecked(*f.store, hashes); });
    std::jthread b([&] { got[1] = fetch_unchecked(*f.store, hashes); });
  }
  for (const fetched& g : got) {
    REQUIRE(g.answered);
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      INFO("entry " << i);
      CHECK(g.calls[i] == 1);
      CHECK(g.got[i] == expected[i]);
    }
  }
  s = f.store->stats();
  CHECK(s.lookups == 96);
  CHECK(s.hits == 96);

  // And through the prefix cache, its RAM cleared.
  f.cache->clear();
  for (const auto& ids : prompts) {
    auto [ec, seq] = f.attach(ids);
    REQUIRE(ec == ghostlink::error_code());
    CHECK(diff(seq, ids) == "");
  }
  CHECK(f.cache->stats().store_hit_tokens == 192);  // 3 prompts of 64 tokens
  CHECK(f.cache->stats().store_rejects == 0);
}

TEST_CASE("MOVED: slots moved to other masters behind the store's back; fetches find them, puts land there") {
  cluster_fixture f;  // its store puts (through the cache)
  const std::vector<token_id> ids = prompt();
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();
  REQUIRE(f.store->stats().stored == 4);
  // Another store, which fetches: both have routed requests by their maps.
  kv_redis_store reader(f.nodes.endpoints(), {.cluster = true});
  const std::vector<kv_block_hash> hashes = f.cache->block_hashes(ids);
  std::vector<std::string> keys;
  std::vector<bytes> original;
  for (const kv_block_hash& h : hashes) {
    keys.push_back(kv_redis_store::key_of(h));
    original.push_back(f.nodes.value_at(f.nodes.owner_of(keys.back()), keys.back()));
  }
  REQUIRE(fetch_all(reader, hashes) == original);

  // The slots of blocks 0 and 1 (another slot) move to the next master.
  const std::uint16_t slot0 = detail::redis_key_slot(keys[0]), slot1 = detail::redis_key_slot(keys[1]);
  REQUIRE(slot0 != slot1);
  CHECK(call(f.nodes.endpoint(0), {"CLUSTER", "KEYSLOT", keys[0]}).integer == slot0);  // the server agrees
  const std::size_t from0 = f.nodes.owner_of(keys[0]), to0 = (from0 + 1) % 3;
  f.nodes.move_slot(slot0, from0, to0, true);
  const std::size_t from1 = f.nodes.owner_of(keys[1]), to1 = (from1 + 1) % 3;
  f.nodes.move_slot(slot1, from1, to1, true);
  REQUIRE(f.nodes.owner_of(keys[0]) == to0);
  REQUIRE(f.nodes.owner_of(keys[1]) == to1);

  // Puts: the entries deleted at their new masters, then put again.
  REQUIRE(call(f.nodes.endpoint(to0), {"DEL", keys[0]}).integer == 1);
  REQUIRE(call(f.nodes.endpoint(to1), {"DEL", keys[1]}).integer == 1);
  const std::int64_t moved_before_put = f.nodes.errors(from1, "MOVED");
  f.cache->clear();
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();
  kv_store_stats s = f.store->stats();
  CHECK(s.stored == 8);
  CHECK(s.write_errors == 0);
  CHECK(f.nodes.value_at(to0, keys[0]) == original[0]);
  CHECK(f.nodes.value_at(to1, keys[1]) == original[1]);
  CHECK(f.nodes.errors(from1, "MOVED") > moved_before_put);  // sent by the stale map, redirected

  // Fetches by the reader's stale map: redirected, found.
  const std::int64_t moved_before_fetch = f.nodes.errors(from0, "MOVED");
  CHECK(fetch_all(reader, hashes) == original);
  CHECK(f.nodes.errors(from0, "MOVED") > moved_before_fetch);
  CHECK(reader.stats().hits == 8);
}

TEST_CASE("ASK: a key moved out of a migrating slot is fetched from the importing master; the map stays") {
  cluster_fixture f;
  const std::vector<token_id> ids = prompt();
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();
  const std::vector<kv_block_hash> hashes = f.cache->block_hashes(ids);
  const std::string key = kv_redis_store::key_of(hashes[0]);
  const std::size_t from = f.nodes.owner_of(key), to = (from + 1) % 3;
  const bytes original = f.nodes.value_at(from, key);
  REQUIRE(fetch_all(*f.store, {hashes[0]}) == std::vector<bytes>{original});

  f.nodes.move_slot(detail::redis_key_slot(key), from, to, false);  // migrating, the key at `to`
  REQUIRE(f.nodes.value_at(to, key).empty());  // without ASKING, `to` redirects (not its slot yet)
  for (int round = 0; round < 2; ++round) {  // the map is kept: each fetch asks `from` first
    INFO("round " << round);
    const std::int64_t asks = f.nodes.errors(from, "ASK");
    CHECK(fetch_all(*f.store, {hashes[0]}) == std::vector<bytes>{original});
    CHECK(f.nodes.errors(from, "ASK") == asks + 1);
  }
  f.cache->clear();
  auto [ec, seq] = f.attach(ids);
  REQUIRE(ec == ghostlink::error_code());
  CHECK(diff(seq, ids) == "");
}

TEST_CASE("a cluster master killed: its entries miss within the request timeout, the others hit, its puts fail") {
  cluster_fixture f({.request_timeout = milliseconds(300)});
  const auto prompts = long_prompts();
  const std::vector<kv_block_hash> hashes = f.insert_all(prompts);
  REQUIRE(f.store->stats().stored == 48);
  std::vector<std::size_t> owner;
  std::vector<bytes> expected;
  for (const kv_block_hash& h : hashes) {
    const std::string key = kv_redis_store::key_of(h);
    owner.push_back(f.nodes.owner_of(key));
    expected.push_back(f.nodes.value_at(owner.back(), key));
  }
  const std::size_t victim = 0;  // the first seed too
  const auto on_victim = static_cast<std::size_t>(std::count(owner.begin(), owner.end(), victim));
  REQUIRE(on_victim > 0);
  REQUIRE(on_victim < 48);

  f.nodes.stop(victim, SIGKILL);
  for (int round = 0; round < 2; ++round) {  // at once, and after the store has seen the failures
    INFO("round " << round);
    const auto started = clock_type::now();
    const std::vector<bytes> got = fetch_all(*f.store, hashes);
    CHECK(clock_type::now() - started < milliseconds(300 + 1000));
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      INFO("entry " << i << " on master " << owner[i]);
      CHECK(got[i] == (owner[i] == victim ? bytes{} : expected[i]));
    }
  }

  const kv_store_stats before = f.store->stats();
  f.cache->clear();
  for (const auto& ids : prompts) REQUIRE(f.insert(ids) == 16);
  f.store->flush();
  const kv_store_stats after = f.store->stats();
  CHECK(after.write_errors - before.write_errors == on_victim);
  CHECK(after.stored - before.stored == 48 - on_victim);
}

TEST_CASE("a value overwritten with garbage in the cluster is a miss through async_attach, never data") {
  cluster_fixture f;
  const std::vector<token_id> ids = prompt();
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();
  const std::string victim = kv_redis_store::key_of(f.cache->block_hashes(ids)[1]);
  REQUIRE(text(call(f.nodes.endpoint(f.nodes.owner_of(victim)), {"SET", victim, "garbage"})) == "OK");
  f.cache->clear();
  auto [ec, seq] = f.attach(ids);
  REQUIRE(ec == ghostlink::error_code());
  CHECK(diff(seq, std::vector<token_id>(ids.begin(), ids.begin() + 4)) == "");
  CHECK(f.cache->stats().store_rejects == 1);
  CHECK(f.cache->match(ids) == 4);
}

}  // namespace redis_cluster_tests
