// The Redis tier (redis_store.hpp): entries round-trip through a real
// redis-server under a prefix cache, under their documented keys; values
// tampered with in Redis are refused; a server absent, killed and
// restarted, or stopped (SIGSTOP) gives misses and counted write errors,
// never errors or waits past the request timeout, and the store reconnects.
//
// Each test starts its own redis-server (common/redis_process.hpp: found
// on PATH, without one these tests fail) on a unix socket in a temporary
// directory, without persistence, and stops it by its process id.
#include "common/files.hpp"
#include "common/prefix_support.hpp"
#include "common/redis_process.hpp"

#include <signal.h>  // NOLINT(modernize-deprecated-headers): SIGKILL

#include <ghostlink/redis_store.hpp>

#include "store/redis/connection.hpp"

#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace redis_store_tests {

using namespace ghostlink;
using namespace ghostlink::test::prefix;
namespace fs = std::filesystem;
using ghostlink::test::temp_dir;
using ghostlink::test::redis::call;
using ghostlink::test::redis::redis_server;
using ghostlink::test::redis::text;
using std::chrono::milliseconds;
using clock_type = std::chrono::steady_clock;

namespace {

struct fixture_options {
  bool server = true;        ///< start a server
  bool given_io = false;     ///< the store on the fixture's pool, not its own context
  kv_redis_store_options store{};
  std::optional<kv_redis_endpoint> endpoint{};  ///< instead of the fixture's unix socket
};

/// A Redis server, a store on it and a prefix cache of 2 layers on the
/// store. The thread pools are joined before anything is destroyed; the
/// store goes (closing its connections) before the pool it runs on is
/// joined.
struct redis_fixture {
  explicit redis_fixture(fixture_options o = {}) {
    if (o.server) server.emplace(socket);
    if (o.given_io) o.store.io_executor = io.get_executor();
    const kv_redis_endpoint endpoint = o.endpoint ? *o.endpoint : kv_redis_endpoint{.unix_socket = socket.string()};
    store = std::make_shared<kv_redis_store>(std::vector<kv_redis_endpoint>{endpoint}, o.store);
    cache.emplace(2, config(), pool, kv_prefix_options{.model = "model-a", .store = store});
  }
  redis_fixture(const redis_fixture&) = delete;
  redis_fixture& operator=(const redis_fixture&) = delete;
  ~redis_fixture() {
    store->flush();
    threads.join();
    cache.reset();
    store.reset();
    io.join();
  }

  std::size_t insert(std::span<const token_id> ids) { return insert_idle(*cache, threads, pool, ids); }
  attach_result attach(std::span<const token_id> ids) { return attach_waited(*cache, threads, ids); }
  /// insert() of `ids`' 4 entries, then flush(): each put stored, dropped or failed.
  void insert_flushed(std::span<const token_id> ids) {
    REQUIRE(insert(ids) == 4);
    store->flush();
  }

  /// The Redis key of block `b` of `ids`.
  std::string key_of(std::span<const token_id> ids, std::size_t b) const {
    return kv_redis_store::key_of(cache->block_hashes(ids)[b]);
  }

  temp_dir dir;
  fs::path socket = dir.path / "redis.sock";
  std::optional<redis_server> server;
  asio::thread_pool io{2};
  asio::thread_pool threads{2};
  kv_block_pool pool = kv_block_pool::for_caches<float>(config(), {.max_blocks = 1000});
  std::shared_ptr<kv_redis_store> store;
  std::optional<kv_prefix_cache> cache;
};

/// 16 tokens: 4 full blocks of config().
std::vector<token_id> prompt(token_id first = 100) { return run(first, 16); }

}  // namespace

TEST_CASE("a prefix cache on a Redis store attaches its entries back exactly once its RAM is cleared") {
  fixture_options o;
  SECTION("the store's own I/O context") {}
  SECTION("the store on a given executor (a pool of 2 threads), 3 connections") {
    o.given_io = true;
    o.store.connections = 3;
  }
  redis_fixture f(o);
  const std::vector<token_id> ids = prompt();
  f.insert_flushed(ids);
  kv_store_stats s = f.store->stats();
  CHECK(s.puts == 4);
  CHECK(s.stored == 4);
  CHECK(s.write_errors == 0);
  CHECK(s.pending_bytes == 0);

  f.cache->clear();
  REQUIRE(f.cache->match(ids) == 0);
  auto [ec, seq] = f.attach(ids);
  REQUIRE(ec == ghostlink::error_code());
  CHECK(diff(seq, ids) == "");
  CHECK(f.cache->stats().store_hit_tokens == 16);
  CHECK(f.cache->stats().store_rejects == 0);
  s = f.store->stats();
  CHECK(s.lookups == 4);
  CHECK(s.hits == 4);
  CHECK(s.entries == 0);  // Redis owns eviction: not counted here
}

TEST_CASE("a Redis store's entries are stored events of the store tier, REDIS, once the server has them") {
  fixture_options o;
  SECTION("a server") {}
  SECTION("no server: the puts fail, and the tier stays empty") { o.server = false; }
  redis_fixture f(o);
  CHECK(f.store->medium() == "REDIS");
  event_log log;
  f.cache->set_event_handler(log.handler());
  const std::vector<token_id> ids = prompt();
  f.insert_flushed(ids);  // every reply read: its receipt told
  const event_mirror m(f.cache->dump());
  CHECK(m.count(kv_prefix_tier::ram) == 4);
  CHECK(m.count(kv_prefix_tier::store) == (o.server ? 4 : 0));
  if (o.server) {
    const std::vector<kv_block_hash> h = f.cache->block_hashes(ids);
    CHECK(m.at(h[3], kv_prefix_tier::store).parent == h[2]);
    CHECK(m.at(h[3], kv_prefix_tier::store) == m.at(h[3]));
  }
  CHECK(replay_onto(log, {}).entries == m.entries);
}

TEST_CASE("entries are Redis strings under ghostlink:v1:<hash hex>, with the TTL asked for") {
  fixture_options o;
  std::optional<std::uint64_t> ttl;
  SECTION("no TTL") {}
  SECTION("a TTL of 100 s") {
    ttl = 100;
    o.store.ttl_seconds = ttl;
  }
  SECTION("the largest TTL the store takes, which Redis takes too") {
    ttl = kv_redis_store::max_ttl_seconds;
    o.store.ttl_seconds = ttl;
  }
  redis_fixture f(o);
  const std::vector<token_id> ids = prompt();
  f.insert_flushed(ids);
  CHECK(call(f.socket, {"DBSIZE"}).integer == 4);
  const std::vector<kv_block_hash> hashes = f.cache->block_hashes(ids);
  for (std::size_t b = 0; b < 4; ++b) {
    const std::string key = f.key_of(ids, b);
    CHECK(key == "ghostlink:v1:" + hashes[b].hex());
    CHECK(key.size() == 13 + 64);
    const detail::redis_reply value = call(f.socket, {"GET", key});
    CHECK(value.kind == detail::redis_reply::type::bulk);
    CHECK(value.bytes.size() > 512);  // 4 tokens x 8 lanes of keys and of values in 2 layers (floats), and a header
    const detail::redis_reply expiry = call(f.socket, {"TTL", key});
    REQUIRE(expiry.kind == detail::redis_reply::type::integer);
    if (ttl) {
      CHECK(expiry.integer > 0);
      CHECK(static_cast<std::uint64_t>(expiry.integer) <= *ttl);
    } else {
      CHECK(expiry.integer == -1);  // no expiry
    }
  }
}

TEST_CASE("a value overwritten with garbage or truncated in Redis is a miss, counted as a reject, never data") {
  redis_fixture f;
  const std::vector<token_id> ids = prompt();
  f.insert_flushed(ids);
  const std::string victim = f.key_of(ids, 1);
  const detail::redis_reply good = call(f.socket, {"GET", victim});
  REQUIRE(good.kind == detail::redis_reply::type::bulk);
  const std::string bytes = text(good);
  std::size_t rejects = 1;
  SECTION("garbage") { REQUIRE(text(call(f.socket, {"SET", victim, "garbage"})) == "OK"); }
  SECTION("truncated") {
    REQUIRE(text(call(f.socket, {"SET", victim, std::string_view(bytes).substr(0, bytes.size() - 9)})) == "OK");
  }
  SECTION("deleted: a plain miss") {
    REQUIRE(call(f.socket, {"DEL", victim}).integer == 1);
    rejects = 0;
  }
  f.cache->clear();
  auto [ec, seq] = f.attach(ids);
  REQUIRE(ec == ghostlink::error_code());
  CHECK(diff(seq, std::vector<token_id>(ids.begin(), ids.begin() + 4)) == "");
  CHECK(f.cache->stats().store_rejects == rejects);
  CHECK(f.cache->match(ids) == 4);
}

TEST_CASE("a value of another model, another geometry or another block forged under an entry's key is a miss, "
          "never data") {
  redis_fixture f;
  const std::vector<token_id> ids = prompt();
  f.insert_flushed(ids);
  const std::string victim = f.key_of(ids, 1);
  std::string forged;
  SECTION("another model's entry for the same tokens") {
    const kv_block_pool pool = kv_block_pool::for_caches<float>(config(), {.max_blocks = 100});  // a cache a pool
    kv_prefix_cache other(2, config(), pool, kv_prefix_options{.model = "model-b", .store = f.store});
    sequence_kv_cache seq(f.threads, 2, config(), pool);
    REQUIRE(append(seq, ids) == ghostlink::error_code());
    REQUIRE(other.insert(seq, ids) == 4);
    f.store->flush();
    forged = text(call(f.socket, {"GET", kv_redis_store::key_of(other.block_hashes(ids)[1])}));
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
    other.clear();
  }
  SECTION("an entry of another geometry (head_dim 8), same model") {
    kv_cache_config wide = config();
    wide.head_dim = 8;
    const kv_block_pool pool = kv_block_pool::for_caches<float>(wide, {.max_blocks = 100});
    kv_prefix_cache other(2, wide, pool, kv_prefix_options{.model = "model-a", .store = f.store});
    sequence_kv_cache seq(f.threads, 2, wide, pool);
    std::vector<std::vector<float>> keys(2, std::vector<float>(ids.size() * wide.token_width(), 0.5f));
    const std::vector<std::span<const float>> spans(keys.begin(), keys.end());
    REQUIRE(wait_ec([&](auto tk) { return seq.async_append(std::span<const token_id>(ids), spans, spans, tk); }) ==
            ghostlink::error_code());
    REQUIRE(other.insert(seq, ids) == 4);
    f.store->flush();
    forged = text(call(f.socket, {"GET", kv_redis_store::key_of(other.block_hashes(ids)[1])}));
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
    other.clear();
  }
  SECTION("this cache's own entry of another block") { forged = text(call(f.socket, {"GET", f.key_of(ids, 2)})); }
  REQUIRE_FALSE(forged.empty());
  REQUIRE(text(call(f.socket, {"SET", victim, forged})) == "OK");
  f.cache->clear();
  auto [ec, seq] = f.attach(ids);
  REQUIRE(ec == ghostlink::error_code());
  CHECK(diff(seq, std::vector<token_id>(ids.begin(), ids.begin() + 4)) == "");  // block 0 only
  CHECK(f.cache->stats().store_rejects == 1);
}

/// Until a put of `ids`' entries (RAM cleared first) is stored again: the
/// store has reconnected to a restarted server (10 s at most; each try
/// waits for its puts' completion with flush(), no sleep between).
bool stored_again(redis_fixture& f, std::span<const token_id> ids) {
  for (const auto deadline = clock_type::now() + std::chrono::seconds(10); clock_type::now() < deadline;) {
    const std::uint64_t before = f.store->stats().stored;
    f.cache->clear();
    REQUIRE(f.insert(ids) == 4);
    f.store->flush();
    if (f.store->stats().stored == before + 4) return true;
  }
  return false;
}

TEST_CASE("Redis killed in the middle of a write: the puts in flight are write errors, RAM keeps its entries, "
          "nothing half-written is served after the restart") {
  redis_fixture f;
  const std::vector<token_id> ids = prompt();
  f.server->pause();  // the puts are written or queued, never answered
  REQUIRE(f.insert(ids) == 4);
  const kv_store_stats during = f.store->stats();
  CHECK(during.puts == 4);
  CHECK(during.stored == 0);
  f.server->stop(SIGKILL);
  f.store->flush();  // returns: the connection's loss fails what was in flight
  const kv_store_stats after = f.store->stats();
  CHECK(after.stored == 0);
  CHECK(after.write_errors + after.dropped == 4);
  CHECK(f.cache->match(ids) == 16);  // RAM lost nothing
  f.server->start();
  f.cache->clear();
  auto [ec, none] = f.attach(ids);  // the restarted server is empty: a miss
  CHECK(ec == ghostlink::error_code());
  CHECK(none.size() == 0);
  REQUIRE(stored_again(f, ids));
  f.cache->clear();
  auto [ec2, seq] = f.attach(ids);
  CHECK(ec2 == ghostlink::error_code());
  CHECK(diff(seq, ids) == "");
}

TEST_CASE("Redis killed in the middle of a read: the attach completes with what it had, no error, no wait; then "
          "the store recovers") {
  redis_fixture f;
  const std::vector<token_id> ids = prompt();
  f.insert_flushed(ids);
  REQUIRE(f.store->stats().stored == 4);
  f.cache->clear();
  f.server->pause();  // the lookups are sent or queued, never answered
  const kv_store_stats before = f.store->stats();
  attach_waiter done;
  f.cache->async_attach(f.threads.get_executor(), ids, {}, {}, done.handler());
  std::future<attach_result> result = done.done.get_future();
  CHECK(result.wait_for(std::chrono::seconds(0)) != std::future_status::ready);  // waiting on the stopped server
  f.server->stop(SIGKILL);
  auto [ec, none] = result.get();
  CHECK(ec == ghostlink::error_code());
  CHECK(none.size() == 0);
  CHECK(f.store->stats().lookups > before.lookups);  // the attach asked the store
  CHECK(f.store->stats().hits == before.hits);        // and got nothing
  f.server->start();
  REQUIRE(stored_again(f, ids));
  f.cache->clear();
  auto [ec2, seq] = f.attach(ids);
  CHECK(ec2 == ghostlink::error_code());
  CHECK(diff(seq, ids) == "");
}

TEST_CASE("a fetch delivers every index once, a miss as no bytes, and stops when its handler says so") {
  redis_fixture f;
  const std::vector<token_id> ids = prompt();
  f.insert_flushed(ids);
  std::vector<kv_block_hash> hashes = f.cache->block_hashes(ids);
  hashes.push_back(f.cache->block_hashes(prompt(500))[0]);  // never stored

  /// Fetches `hashes`, the handler saying "more" `more` times; the sizes
  /// delivered by index (-1: none), once every reply is in.
  const auto fetch = [&](std::size_t more) {
    auto sizes = std::make_shared<std::vector<long>>(hashes.size(), -1);
    auto calls = std::make_shared<std::atomic<std::size_t>>(0);
    std::promise<void> done;
    auto remaining = std::make_shared<std::atomic<std::size_t>>(hashes.size());
    f.store->fetch(hashes, [=, &done](std::size_t i, const std::vector<std::byte>& bytes) {
      (*sizes)[i] = static_cast<long>(bytes.size());
      const bool go_on = calls->fetch_add(1) + 1 < more;
      if (remaining->fetch_sub(1) == 1 || !go_on) done.set_value();
      return go_on;
    });
    done.get_future().wait();
    // A second fetch on the same connections: once it is answered, every
    // reply to the first one has been read (each connection answers in order).
    std::promise<void> second;
    auto left = std::make_shared<std::atomic<std::size_t>>(hashes.size());
    f.store->fetch(hashes, [&second, left](std::size_t, const std::vector<std::byte>&) {
      if (left->fetch_sub(1) == 1) second.set_value();
      return true;
    });
    second.get_future().wait();
    return std::make_pair(*sizes, calls->load());
  };

  const auto [sizes, calls] = fetch(hashes.size());
  CHECK(calls == 5);
  for (std::size_t b = 0; b < 4; ++b) CHECK(sizes[b] > 0);
  CHECK(sizes[4] == 0);  // a miss: no bytes
  kv_store_stats s = f.store->stats();
  CHECK(s.lookups == 10);
  CHECK(s.hits == 8);

  const auto [stopped_sizes, stopped_calls] = fetch(1);
  CHECK(stopped_calls == 1);  // the store's own context: one thread, so no call races the "stop"
}

TEST_CASE("puts beyond max_pending_bytes are dropped and counted; RAM keeps the entries") {
  fixture_options o;
  o.store.max_pending_bytes = 1;
  redis_fixture f(o);
  const std::vector<token_id> ids = prompt();
  f.insert_flushed(ids);
  const kv_store_stats s = f.store->stats();
  CHECK(s.puts == 4);
  CHECK(s.dropped == 4);
  CHECK(s.stored == 0);
  CHECK(s.pending_bytes == 0);
  CHECK(call(f.socket, {"DBSIZE"}).integer == 0);
  CHECK(f.cache->match(ids) == 16);
}

TEST_CASE(
    "a store without an endpoint, with 0 connections or a unix socket path too long throws from its constructor") {
  CHECK_THROWS_AS(kv_redis_store({}), std::invalid_argument);
  CHECK_THROWS_AS(kv_redis_store({{.unix_socket = "/tmp/s"}}, {.connections = 0}), std::invalid_argument);
  CHECK_THROWS_AS(kv_redis_store({{.unix_socket = "/tmp/" + std::string(200, 's')}}), std::invalid_argument);
}

TEST_CASE("with no Redis server, attaches miss without an error, RAM keeps serving, puts are write errors") {
  fixture_options o{.server = false};
  SECTION("a unix socket with no server") {}
  SECTION("a TCP port with no server (127.0.0.1:1)") { o.endpoint = kv_redis_endpoint{.host = "127.0.0.1", .port = 1}; }
  redis_fixture f(o);
  const std::vector<token_id> ids = prompt();
  f.insert_flushed(ids);
  kv_store_stats s = f.store->stats();
  CHECK(s.puts == 4);
  CHECK(s.stored == 0);
  CHECK(s.write_errors == 4);
  CHECK(f.cache->match(ids) == 16);
  auto [ec, seq] = f.attach(ids);
  CHECK(ec == ghostlink::error_code());
  CHECK(diff(seq, ids) == "");
  f.cache->clear();
  const auto started = clock_type::now();
  auto [ec2, none] = f.attach(ids);
  CHECK(clock_type::now() - started < std::chrono::seconds(1));  // fails fast, not at the timeout
  CHECK(ec2 == ghostlink::error_code());
  CHECK(none.size() == 0);
  s = f.store->stats();
  CHECK(s.lookups >= 1);
  CHECK(s.hits == 0);
}

TEST_CASE("Redis killed and restarted on the same socket: misses during the outage, then puts and fetches work") {
  redis_fixture f;
  const std::vector<token_id> ids = prompt();
  f.insert_flushed(ids);
  REQUIRE(f.store->stats().stored == 4);

  f.server->stop(SIGKILL);
  f.cache->clear();
  auto [ec, none] = f.attach(ids);
  CHECK(ec == ghostlink::error_code());
  CHECK(none.size() == 0);
  REQUIRE(f.insert(ids) == 4);  // into RAM; the puts fail
  f.store->flush();
  CHECK(f.store->stats().stored == 4);
  CHECK(f.store->stats().write_errors >= 1);

  f.server->start();  // empty: no persistence
  // Reconnected within 10 s (the backoff is 100 ms): a put is stored again.
  const std::vector<token_id> other = prompt(300);
  REQUIRE(stored_again(f, other));
  f.cache->clear();
  auto [ec2, seq] = f.attach(other);
  CHECK(ec2 == ghostlink::error_code());
  CHECK(diff(seq, other) == "");
}

TEST_CASE("a Redis server that does not answer (SIGSTOP) gives misses within the request timeout, then recovers") {
  fixture_options o;
  o.store.request_timeout = milliseconds(300);
  redis_fixture f(o);
  const std::vector<token_id> ids = prompt();
  f.insert_flushed(ids);
  REQUIRE(f.store->stats().stored == 4);

  f.server->pause();
  f.cache->clear();
  const auto started = clock_type::now();
  auto [ec, none] = f.attach(ids);
  const auto took = clock_type::now() - started;
  CHECK(ec == ghostlink::error_code());
  CHECK(none.size() == 0);
  CHECK(took < milliseconds(300 + 1000));
  // A put while it is stopped is a write error, after the timeout at most.
  const std::vector<token_id> other = prompt(300);
  REQUIRE(f.insert(other) == 4);
  f.store->flush();
  CHECK(f.store->stats().write_errors >= 1);
  f.server->resume();

  // Its entries are still there: reconnected within 10 s, they attach. Each
  // try waits for its attach's handler, no sleep between.
  bool attached = false;
  for (const auto deadline = clock_type::now() + std::chrono::seconds(10); !attached && clock_type::now() < deadline;) {
    f.cache->clear();
    auto [ec2, seq] = f.attach(ids);
    REQUIRE(ec2 == ghostlink::error_code());
    attached = seq.size() == 16 && diff(seq, ids).empty();
  }
  CHECK(attached);
}

}  // namespace redis_store_tests
