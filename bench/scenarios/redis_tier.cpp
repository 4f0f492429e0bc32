// The Redis tier, against a redis-server the benchmark starts on a unix
// socket (bench/redis.hpp), with a prompt of 4096 tokens x L layers (32)
// at the benchmark's head shape: 256 entries of about 1 MiB (16 tokens x
// 32 layers x 2 KiB, plus a 104-byte frame).
//
// redis_store: each run empties Redis (FLUSHALL) and the RAM cache, untimed,
// then times
// - store, ghostlink: insert_stored_tokens of the prompt's sequence into a
//   kv_prefix_cache written through to a kv_redis_store of 2 connections
//   on an I/O pool of 2 threads, then flush(): every entry encoded into its
//   SET and stored;
// - store, raw: the same values (the entries' bytes, read back once,
//   untimed) SET under keys of their own, pipelined on 2 connections, one
//   thread each, every command written at once, then the replies read;
// - fetch, ghostlink: store->fetch() of the 256 hashes, until the handler
//   has had every value;
// - fetch, raw: GETs of the raw keys on 2 connections as the SETs, each
//   bulk reply read straight into a buffer of its size (allocated once).
// Reported: the entries' bytes over each time; target ghostlink >= 0.8x.
//
// redis_store_tls: the same over TLS (TLS 1.3, a P-256 certificate
// verified against the CA the benchmark makes) to the server's loopback
// TLS port: the store with `tls`, the raw baseline with OpenSSL's
// SSL_write and SSL_read on its blocking sockets.
//
// attach_from_redis: each run clears the RAM cache and times async_attach
// of the 4096 tokens (every block from Redis: fetched, checked, copied into
// the pool, attached) against one multi-token async_append of the same
// tokens into a fresh sequence.
//
// Without redis-server on PATH both are skipped with a note.
#include <ghostlink/kv_cache.hpp>
#include <ghostlink/redis_store.hpp>

#include <asio/thread_pool.hpp>
#include <asio/use_future.hpp>

#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "../redis.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

constexpr std::size_t connections = 2;

/// The server, a prefix cache on it, and the prompt's sequence.
struct redis_tier {
  /// With `tls`: the store on the server's TLS port.
  redis_tier(const options& o, const std::string& scenario, bool tls = false)
      : n(std::min<std::size_t>(4096, o.tokens) / o.block_tokens * o.block_tokens),
        entries(n / o.block_tokens),
        config(o.config()),
        data(config.token_width(), n),
        server(scenario, tls),
        threads(o.threads),
        io(connections),
        pool(kv_block_pool::for_caches(config)),
        store(std::make_shared<kv_redis_store>(
            std::vector<kv_redis_endpoint>{tls ? kv_redis_endpoint{.host = "127.0.0.1", .port = server.tls_port()}
                                               : kv_redis_endpoint{.unix_socket = server.socket().string()}},
            // Room for every put of one insert, and time for 256 MiB of replies on a busy machine.
            kv_redis_store_options{
                .tls = tls ? std::optional(kv_redis_tls_options{.ca_file = server.ca_file()}) : std::nullopt,
                .connections = connections,
                .request_timeout = std::chrono::seconds(10),
                .max_pending_bytes = std::size_t{1} << 30,
                .io_executor = io.get_executor()})),
        cache(o.layers, config, pool,
              {.model = "ghostlink-bench", .store = store, .store_policy = kv_store_policy::write_through}),
        seq(threads, o.layers, config, pool) {
    std::mt19937_64 rng(8);
    ids = random_token_ids(rng, n);
    const std::vector<std::span<const float>> keys(o.layers, data.keys_of(0, n)),
        values(o.layers, data.values_of(0, n));
    seq.async_append(std::span<const token_id>(ids), keys, values, asio::use_future).get();
    hashes = cache.block_hashes(ids);
  }
  ~redis_tier() {
    cache.clear();
    threads.join();
  }
  redis_tier(const redis_tier&) = delete;
  redis_tier& operator=(const redis_tier&) = delete;

  /// Every entry of the prompt written through to Redis; fails unless each was stored.
  void store_all(const std::string& scenario) {
    const kv_store_stats before = store->stats();
    if (cache.insert_stored_tokens(seq) != entries) fail(scenario, "the prompt did not make every entry");
    store->flush();
    const kv_store_stats after = store->stats();
    if (after.stored - before.stored != entries)
      fail(scenario, std::to_string(after.stored - before.stored) + " entries stored, not " + std::to_string(entries) +
                         " (" + std::to_string(after.dropped) + " dropped, " + std::to_string(after.write_errors) +
                         " failed)");
  }

  /// FLUSHALL, and the RAM cache cleared.
  void empty() {
    redis::connection link(server.socket(), "redis");
    std::string flush;
    redis::command(flush, {"FLUSHALL"});
    link.write_all(flush);
    if (link.line() != "+OK") fail("redis", "FLUSHALL failed");
    cache.clear();
  }

  const std::size_t n, entries;
  const kv_cache_config config;
  const token_rows data;
  std::vector<token_id> ids;
  std::vector<kv_block_hash> hashes;
  redis::server server;
  asio::thread_pool threads;
  asio::thread_pool io;  // the store's: one thread a connection, as the baseline's
  const kv_block_pool pool;
  const std::shared_ptr<kv_redis_store> store;
  kv_prefix_cache cache;
  sequence_kv_cache seq;
};

bool have_redis(report& out, const std::string& scenario) {
  if (!redis::find_server().empty()) return true;
  out.add_note(scenario, "skipped: redis-server is not on PATH (Debian: redis-server)");
  return false;
}

/// redis_store and redis_store_tls.
void store_and_fetch(const options& o, report& out, const std::string& scenario, bool tls) {
  if (!have_redis(out, scenario)) return;
  redis_tier tier(o, scenario, tls);
  const redis::target raw_target = tier.server.target();
  // The values as stored, for the baseline.
  tier.store_all(scenario);
  std::vector<std::string> ghostlink_keys, raw_keys;
  for (std::size_t i = 0; i < tier.entries; ++i) {
    ghostlink_keys.push_back(kv_redis_store::key_of(tier.hashes[i]));
    raw_keys.push_back("raw:" + std::to_string(i));
  }
  std::vector<std::vector<std::byte>> values(tier.entries);
  std::size_t bytes = 0;
  {
    std::promise<void> done;
    std::size_t left = tier.entries;
    tier.store->fetch(tier.hashes, [&](std::size_t i, std::vector<std::byte> value) {
      values[i] = std::move(value);
      if (--left == 0) done.set_value();
      return true;
    });
    done.get_future().get();
  }
  for (const auto& v : values) {
    if (v.empty()) fail(scenario, "an entry stored is missing from Redis");
    bytes += v.size();
  }
  const std::vector<std::span<const std::byte>> raw_values(values.begin(), values.end());
  std::vector<std::vector<std::byte>> raw_out;
  raw_out.reserve(values.size());
  for (const auto& v : values) raw_out.emplace_back(v.size());

  out.run(scenario, o, [&](std::map<std::string, metric>& m) {
    metric& stores = declare(m, "1 store", "store " + std::to_string(tier.entries) + " entries", "bytes/s");
    metric& store_ratio = declare(m, "2 store ratio", "store / raw pipelined SETs", "x");
    metric& fetches = declare(m, "3 fetch", "fetch " + std::to_string(tier.entries) + " entries", "bytes/s");
    metric& fetch_ratio = declare(m, "4 fetch ratio", "fetch / raw pipelined GETs", "x");
    const auto rate = [&](auto op) {
      const auto t0 = clock_type::now();
      op();
      return double(bytes) / seconds_since(t0);
    };
    tier.empty();
    stores.values["ghostlink"] = rate([&] { tier.store_all(scenario); });
    stores.values["raw"] = rate([&] { redis::raw_set(raw_target, connections, raw_keys, raw_values, scenario); });
    fetches.values["ghostlink"] = rate([&] {
      std::promise<void> done;
      std::size_t left = tier.entries, missing = 0;
      tier.store->fetch(tier.hashes, [&](std::size_t, const std::vector<std::byte>& value) {
        missing += value.empty() ? 1 : 0;
        if (--left == 0) done.set_value();
        return true;
      });
      done.get_future().get();
      if (missing != 0) fail(scenario, std::to_string(missing) + " entries missing from Redis");
    });
    fetches.values["raw"] = rate([&] { redis::raw_get(raw_target, connections, raw_keys, raw_out, scenario); });
    store_ratio.values["ghostlink"] = stores.values["ghostlink"] / stores.values["raw"];
    fetch_ratio.values["ghostlink"] = fetches.values["ghostlink"] / fetches.values["raw"];
  });
  out.add_note(scenario, std::to_string(tier.n) + " tokens x " + std::to_string(o.layers) +
                             " layers: " + std::to_string(tier.entries) + " entries, " + std::to_string(bytes) +
                             " bytes, to a redis-server " +
                             (tls ? std::string("over TLS on a loopback port") : std::string("on a unix socket")) +
                             " (no persistence); ghostlink: "
                             "insert_stored_tokens written through a kv_redis_store + flush(), and store->fetch(); "
                             "raw: the same values pipelined as SETs and GETs, " +
                             std::to_string(connections) + " connections, one thread each, in both. Target >= 0.8x");
}

}  // namespace

void redis_store(const options& o, report& out) { store_and_fetch(o, out, "redis_store", false); }
void redis_store_tls(const options& o, report& out) { store_and_fetch(o, out, "redis_store_tls", true); }

void attach_from_redis(const options& o, report& out) {
  const std::string scenario = "attach_from_redis";
  if (!have_redis(out, scenario)) return;
  redis_tier tier(o, scenario);
  tier.store_all(scenario);
  const std::vector<std::span<const float>> keys(o.layers, tier.data.keys_of(0, tier.n)),
      values(o.layers, tier.data.values_of(0, tier.n));

  out.run(scenario, o, [&](std::map<std::string, metric>& m) {
    metric& time = declare(m, "1 time", "sequence ready, " + std::to_string(tier.n) + " tokens", "us", false);
    metric& time_ratio = declare(m, "2 time ratio", "attach from Redis / append time", "x", false);
    const kv_prefix_stats before = tier.cache.stats();
    tier.cache.clear();
    {
      const auto t0 = clock_type::now();
      const sequence_kv_cache seq =
          tier.cache.async_attach(tier.threads.get_executor(), tier.ids, {}, asio::use_future).get();
      time.values["ghostlink"] = 1e6 * seconds_since(t0);
      if (seq.size() != tier.n)
        fail(scenario, "attached " + std::to_string(seq.size()) + " tokens, not " + std::to_string(tier.n));
      if (tier.cache.stats().store_hit_tokens - before.store_hit_tokens != tier.n)
        fail(scenario, "not every block came from Redis");
    }  // released untimed
    tier.cache.clear();
    {
      std::optional<sequence_kv_cache> seq;
      const auto t0 = clock_type::now();
      seq.emplace(tier.threads, o.layers, tier.config, tier.pool);
      seq->async_append(std::span<const token_id>(tier.ids), keys, values, asio::use_future).get();
      time.values["append"] = 1e6 * seconds_since(t0);
    }
    time_ratio.values["ghostlink"] = time.values["ghostlink"] / time.values["append"];
  });
  out.add_note(scenario, std::to_string(tier.n) + " tokens x " + std::to_string(o.layers) +
                             " layers written through to a redis-server on a unix socket (untimed); each run clears "
                             "the RAM cache and times async_attach (every block from Redis, " +
                             std::to_string(connections) +
                             " connections) against one async_append of the same tokens into a fresh sequence");
}

}  // namespace ghostlink::bench
