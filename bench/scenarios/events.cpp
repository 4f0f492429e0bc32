// KV events on the wire (ghostlink-events; docs/API.md, "KV events on the
// wire"), on one layer of the small geometry (1 head x 8 dims), 16-token
// blocks:
// - events_insert: prefix-cache inserts per second, each adding the 16
//   entries of a new 256-token prompt, with a kv_event_publisher on the
//   cache and one subscriber reading its PUB socket on another thread,
//   against the same inserts with no publisher.
// - events_rate: the events one subscriber receives per second, each batch
//   decoded (nlohmann::json's from_msgpack), while one thread inserts as
//   fast as it can: from the first insert until the last event arrived.
// - dump_pause: the latency of an insert of one new entry with 100k
//   entries cached, while another thread calls dump() in a loop, against
//   the same inserts with no dump running; and one dump's duration.
#include <ghostlink/event_publisher.hpp>
#include <ghostlink/kv_cache.hpp>

#include <asio/thread_pool.hpp>
#include <asio/use_future.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../../examples/kv_mirror.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"
#include "testing/temp_dir.hpp"

namespace ghostlink::bench {
namespace {

constexpr std::size_t block = 16;

kv_cache_config events_config(std::size_t max_tokens) {
  return {.max_tokens_per_seq = max_tokens, .num_heads = 1, .head_dim = 8, .block_tokens = block};
}

/// Sequences holding `count` distinct prompts of `tokens` ids each, ready
/// to be inserted (the appends are not timed).
struct prepared {
  std::vector<std::vector<token_id>> prompts;
  std::vector<sequence_kv_cache> seqs;

  prepared(asio::thread_pool& threads, const kv_block_pool& pool, std::size_t count, std::size_t tokens,
           std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    const kv_cache_config c = events_config(tokens);
    const token_rows data(c.token_width(), tokens);
    for (std::size_t i = 0; i < count; ++i) {
      prompts.push_back(random_token_ids(rng, tokens));
      seqs.emplace_back(threads, 1, c, pool);
      const std::vector<std::span<const float>> keys{data.keys_of(0, tokens)}, values{data.values_of(0, tokens)};
      seqs.back().async_append(std::span<const token_id>(prompts.back()), keys, values, asio::use_future).get();
    }
  }
  /// Inserts them all; the seconds it took.
  double insert_all(kv_prefix_cache& cache) const {
    const auto t0 = clock_type::now();
    for (std::size_t i = 0; i < seqs.size(); ++i) cache.insert(seqs[i], prompts[i]);
    return seconds_since(t0);
  }
};

/// A subscriber on its own thread, counting what it receives (decoding
/// every payload if asked), until stopped.
class counting_subscriber {
 public:
  counting_subscriber(const kv_event_publisher& p, bool decode)
      : client_(p.endpoint(), p.replay_endpoint()), thread_([this, decode] { run(decode); }) {}
  counting_subscriber(const counting_subscriber&) = delete;
  counting_subscriber& operator=(const counting_subscriber&) = delete;
  ~counting_subscriber() {
    stop_ = true;
    thread_.join();
  }
  std::uint64_t batches() const { return batches_.load(); }
  std::uint64_t entries() const { return entries_.load(); }

 private:
  void run(bool decode) {
    while (!stop_) {
      const std::optional<kv_mirror::batch> b = client_.next(std::chrono::milliseconds(5));
      if (!b) continue;
      if (decode) {
        const kv_mirror::json j = kv_mirror::json::from_msgpack(b->payload);
        std::uint64_t n = 0;
        for (const kv_mirror::json& e : j.at(1))
          if (e.contains("block_hashes")) n += e.at("block_hashes").size();
        entries_ += n;
      }
      ++batches_;
    }
  }
  kv_mirror::wire_client client_;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> batches_{0}, entries_{0};
  std::thread thread_;
};

/// The subscriber is connected: probe entries go in until it has a batch.
void wait_connected(kv_prefix_cache& cache, asio::thread_pool& threads, const kv_block_pool& pool,
                    const counting_subscriber& sub) {
  const kv_cache_config c = events_config(block);
  const token_rows data(c.token_width(), block);
  for (token_id probe = 0; probe < 100'000 && sub.batches() == 0; ++probe) {
    const std::vector<token_id> ids(block, -2 - probe);  // never a prompt's (random ids are >= 0)
    sequence_kv_cache seq(threads, 1, c, pool);
    const std::vector<std::span<const float>> keys{data.keys_of(0, block)}, values{data.values_of(0, block)};
    seq.async_append(std::span<const token_id>(ids).first(block), keys, values, asio::use_future).get();
    cache.insert(seq, ids);
    for (int i = 0; i < 1'000 && sub.batches() == 0; ++i) std::this_thread::yield();
  }
  if (sub.batches() == 0) fail("events", "the subscriber never received a batch");
}

kv_event_publisher_options ipc(const testing::temp_dir& dir) {
  return {.endpoint = "ipc://" + (dir.path / "pub").string(),
          .replay_endpoint = "ipc://" + (dir.path / "replay").string()};
}

}  // namespace

void events_insert(const options& o, report& out) {
  const std::size_t prompts = o.quick ? 50 : 10'000, tokens = 256;
  const std::size_t entries = prompts * tokens / block;
  out.run("events_insert", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "inserts", "entries inserted per second", "entries/s");
    for (const std::string impl : {"none", "publisher", "no_subscriber"}) {
      if (!o.wants(impl)) continue;
      asio::thread_pool threads(1);
      const auto pool =
          kv_block_pool::for_caches(events_config(tokens), {.max_blocks = 2 * prompts * tokens / block + 64});
      kv_prefix_cache cache(1, events_config(tokens), pool);
      const prepared work(threads, pool, prompts, tokens, 5);
      testing::temp_dir dir;
      std::optional<kv_event_publisher> publisher;
      std::optional<counting_subscriber> sub;
      if (impl != "none") publisher.emplace(cache, ipc(dir));
      if (impl == "publisher") {
        sub.emplace(*publisher, false);
        wait_connected(cache, threads, pool, *sub);
      }
      rate.values[impl] = static_cast<double>(entries) / work.insert_all(cache);
      sub.reset();
      publisher.reset();
      threads.join();
    }
  });
  out.add_note("events_insert", std::to_string(prompts) + " prompts of " + std::to_string(tokens) +
                                    " tokens inserted one after the other (16 new entries each); publisher: a "
                                    "kv_event_publisher on ipc://, one subscriber reading on another thread");
}

void events_rate(const options& o, report& out) {
  const std::size_t prompts = o.quick ? 50 : 4'000, tokens = 256;
  const std::size_t entries = prompts * tokens / block;
  out.run("events_rate", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "events", "events received and decoded per second", "events/s");
    asio::thread_pool threads(1);
    const auto pool = kv_block_pool::for_caches(events_config(tokens), {.max_blocks = 2 * entries + 64});
    kv_prefix_cache cache(1, events_config(tokens), pool);
    const prepared work(threads, pool, prompts, tokens, 6);
    testing::temp_dir dir;
    kv_event_publisher publisher(cache, ipc(dir));
    counting_subscriber sub(publisher, true);
    wait_connected(cache, threads, pool, sub);
    const std::uint64_t before = sub.entries();
    const auto t0 = clock_type::now();
    work.insert_all(cache);
    while (sub.entries() < before + entries && seconds_since(t0) < 30) std::this_thread::yield();
    const double seconds = seconds_since(t0);
    if (sub.entries() < before + entries) fail("events_rate", "the subscriber lost events");
    rate.values["publisher"] = double(entries) / seconds;
    threads.join();
  });
  out.add_note("events_rate", std::to_string(prompts) + " prompts of " + std::to_string(tokens) + " tokens (" +
                                  std::to_string(entries) +
                                  " events) inserted as fast as one thread can; one subscriber on ipc:// decoding "
                                  "every batch");
}

void dump_pause(const options& o, report& out) {
  const std::size_t cached = o.quick ? 1'000 : 100'000, inserts = o.quick ? 200 : 4'000, tokens = 256;
  out.run("dump_pause", o, [&](std::map<std::string, metric>& m) {
    metric& p50 = declare(m, "1 p50", "insert of one entry, p50", "ns", false);
    metric& p99 = declare(m, "2 p99", "insert of one entry, p99", "ns", false);
    metric& p999 = declare(m, "3 p99.9", "insert of one entry, p99.9", "ns", false);
    metric& worst = declare(m, "4 max", "insert of one entry, max", "ns", false);
    metric& one = declare(m, "5 dump", "one dump of the cache", "ms", false);
    for (const std::string impl : {"idle", "dumping"}) {
      if (!o.wants(impl)) continue;
      asio::thread_pool threads(1);
      const auto pool = kv_block_pool::for_caches(events_config(tokens), {.max_blocks = cached + 2 * inserts + 64});
      kv_prefix_cache cache(1, events_config(tokens), pool);
      const std::size_t bulk_prompts = cached * block / tokens, have = bulk_prompts * tokens / block;
      {
        const prepared bulk(threads, pool, bulk_prompts, tokens, 7);
        bulk.insert_all(cache);
      }
      const prepared singles(threads, pool, inserts, block, 8);
      std::atomic<bool> stop{false};
      std::atomic<std::uint64_t> dumps{0};
      std::atomic<double> dump_seconds{0};
      std::thread dumper;
      if (impl == "dumping")
        dumper = std::thread([&] {
          while (!stop) {
            const auto t0 = clock_type::now();
            if (cache.dump().entries.size() < have) fail("dump_pause", "a dump missed entries");
            dump_seconds = dump_seconds + seconds_since(t0);
            ++dumps;
          }
        });
      for (int i = 0; i < 100'000 && impl == "dumping" && dumps == 0; ++i) std::this_thread::yield();
      latencies lat;
      for (std::size_t i = 0; i < inserts; ++i) {
        const auto t0 = clock_type::now();
        cache.insert(singles.seqs[i], singles.prompts[i]);
        lat.add(t0);
      }
      stop = true;
      if (dumper.joinable()) dumper.join();
      p50.values[impl] = lat.p(0.5);
      p99.values[impl] = lat.p(0.99);
      p999.values[impl] = lat.p(0.999);
      worst.values[impl] = lat.p(1.0);
      if (impl == "dumping") one.values[impl] = 1000 * dump_seconds / double(dumps);
      threads.join();
    }
  });
  out.add_note("dump_pause", std::to_string(cached) + " entries cached; " + std::to_string(inserts) +
                                 " inserts of one new entry each, timed one by one; dumping: another thread "
                                 "calls dump() in a loop meanwhile (256 entries copied per lock)");
}

}  // namespace ghostlink::bench
