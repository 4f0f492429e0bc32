// The prefix cache's parts, each against what it replaces or is built on
// (prefix_workload.cpp replays a request trace through all of it):
// - prefix_attach: a sequence of L layers (32) holding a cached prefix of P
//   tokens (4096) at the default shape, made by attach(), against a fork of
//   a sequence holding them and a fresh sequence taking them by one
//   multi-token append; and the blocks an attach takes from the pool.
// - prefix_hash: block_hashes() of P-token prompts against a bare one-shot
//   OpenSSL SHA-256 (EVP_Digest) of the same 96-byte strings per block.
// - prefix_match: match() of cached P-token prompts with 100k entries
//   cached, against hashing those prompts alone.
// - prefix_eviction: the latency of a one-token append that must evict an
//   idle entry (the pool's budget full of 100k of them), plain LRU and with
//   retention priorities, against one that takes its block from the free
//   list.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

/// Tokens of the attached and hashed prompts: 4096, or what fits, in whole blocks.
std::size_t prompt_tokens(const options& o) {
  return std::min<std::size_t>(4096, o.tokens) / o.block_tokens * o.block_tokens;
}

/// Entries cached for prefix_match and prefix_eviction, in prompts of
/// `entry_blocks(o)` blocks each.
std::size_t entries_wanted(const options& o) { return o.quick ? 1000 : 100000; }
std::size_t entry_blocks(const options& o) { return o.quick ? 16 : 256; }

/// The small geometry that 100k entries fit in: one head of 8 dimensions.
kv_cache_config small_config(std::size_t block_tokens, std::size_t max_tokens) {
  return {.max_tokens_per_seq = max_tokens, .num_heads = 1, .head_dim = 8, .block_tokens = block_tokens};
}

/// `count` prompts of `tokens` random ids, distinct from their first block on.
std::vector<std::vector<token_id>> random_prompts(std::size_t count, std::size_t tokens, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<token_id>> prompts(count);
  for (auto& p : prompts) p = random_token_ids(rng, tokens);
  return prompts;
}

/// Caches every block of `prompts` in `cache`, all entries idle as between
/// requests: each prompt appended with its ids to one sequence on
/// `threads`, inserted (at `retentions[i]` if given), and truncated away.
void insert_idle(const std::string& scenario, kv_prefix_cache& cache, asio::thread_pool& threads,
                 const std::vector<std::vector<token_id>>& prompts,
                 const std::vector<kv_retention>* retentions = nullptr) {
  const kv_cache_config& c = cache.config();
  std::size_t longest = 0, blocks = 0;
  for (const auto& p : prompts) {
    longest = std::max(longest, p.size());
    blocks += p.size() / c.block_tokens;
  }
  const token_rows data(c.token_width(), longest);
  const sequence_kv_cache seq(threads, cache.num_layers(), c, cache.pool());
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<token_id>& p = prompts[i];
    const std::vector<std::span<const float>> keys(cache.num_layers(), data.keys_of(0, p.size()));
    const std::vector<std::span<const float>> values(cache.num_layers(), data.values_of(0, p.size()));
    seq.async_append(std::span<const token_id>(p), keys, values, asio::use_future).get();
    if (retentions)
      cache.insert_stored_tokens(seq, "", (*retentions)[i]);
    else
      cache.insert_stored_tokens(seq);
    seq.async_truncate(0, asio::use_future).get();
  }
  const kv_prefix_stats s = cache.stats();
  if (s.cached_blocks != blocks || s.idle_blocks != blocks)
    fail(scenario, "expected " + std::to_string(blocks) + " idle entries, have " + std::to_string(s.cached_blocks) +
                       " entries, " + std::to_string(s.idle_blocks) + " idle");
}

using digest = std::array<std::uint8_t, 32>;

void add_u64(std::vector<std::uint8_t>& bytes, std::uint64_t v) {
  for (std::size_t i = 0; i < 8; ++i) bytes.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

/// SHA-256 one-shot: EVP_Digest with the algorithm fetched once.
class one_shot_sha256 {
 public:
  one_shot_sha256() : md_(EVP_MD_fetch(nullptr, "SHA256", nullptr), &EVP_MD_free) {
    if (!md_) fail("prefix_hash", "EVP_MD_fetch(SHA256) failed");
  }
  void operator()(const void* data, std::size_t n, std::uint8_t* out) const {
    if (EVP_Digest(data, n, out, nullptr, md_.get(), nullptr) != 1) fail("prefix_hash", "EVP_Digest failed");
  }

 private:
  std::unique_ptr<EVP_MD, void (*)(EVP_MD*)> md_;
};

/// The root hash of the contract (prefix_cache.hpp) for float storage and
/// an empty salt.
digest root_hash(const one_shot_sha256& sha, std::string_view model, std::size_t layers, const kv_cache_config& c) {
  static constexpr std::string_view tag = "ghostlink-prefix-v1";
  std::vector<std::uint8_t> bytes(tag.begin(), tag.end());
  add_u64(bytes, model.size());
  bytes.insert(bytes.end(), model.begin(), model.end());
  add_u64(bytes, 0);  // the salt's length
  add_u64(bytes, layers);
  add_u64(bytes, c.num_heads);
  add_u64(bytes, c.head_dim);
  add_u64(bytes, c.block_tokens);
  bytes.push_back(0);  // float
  digest d{};
  sha(bytes.data(), bytes.size(), d.data());
  return d;
}

/// The bare chain: for each block, SHA-256(previous hash || its tokens as
/// little-endian i32) into `out`, one EVP_Digest call each.
class bare_chain {
 public:
  bare_chain(const digest& root, std::size_t block_tokens) : root_(root), buffer_(32 + 4 * block_tokens) {}
  void operator()(const one_shot_sha256& sha, std::span<const token_id> tokens, std::vector<digest>& out) {
    const std::size_t bt = (buffer_.size() - 32) / 4;
    out.resize(tokens.size() / bt);
    const digest* prev = &root_;
    for (std::size_t b = 0; b < out.size(); ++b) {
      std::memcpy(buffer_.data(), prev->data(), 32);
      if constexpr (std::endian::native == std::endian::little) {
        std::memcpy(buffer_.data() + 32, tokens.data() + b * bt, 4 * bt);
      } else {
        for (std::size_t i = 0; i < bt; ++i)
          for (std::size_t k = 0; k < 4; ++k)
            buffer_[32 + 4 * i + k] =
                static_cast<std::uint8_t>(static_cast<std::uint32_t>(tokens[b * bt + i]) >> (8 * k));
      }
      sha(buffer_.data(), buffer_.size(), out[b].data());
      prev = &out[b];
    }
  }

 private:
  digest root_;
  std::vector<std::uint8_t> buffer_;
};

/// `n` one-token appends to a new sequence of one layer on a one-thread
/// io_context, each into a block of its own (one-token blocks); their
/// latencies.
latencies one_token_appends(const kv_cache_config& config, const kv_block_pool& pool, std::size_t n) {
  latencies lat;
  lat.ns.reserve(n);
  asio::io_context io;
  const token t(config.token_width(), 5);
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        const sequence_kv_cache seq(io, 1, config, pool);
        const std::array<std::span<const float>, 1> keys{t.keys}, values{t.values};
        for (std::size_t i = 0; i < n; ++i) {
          const auto s = clock_type::now();
          co_await seq.async_append(keys, values, asio::use_awaitable);
          lat.add(s);
        }
        co_await seq.async_truncate(0, asio::use_awaitable);
      },
      [](const std::exception_ptr& e) {
        if (e) std::rethrow_exception(e);
      });
  io.run();
  return lat;
}

}  // namespace

void prefix_attach(const options& o, report& out) {
  const std::size_t n = prompt_tokens(o);
  const token_rows data(o.config().token_width(), n);
  std::mt19937_64 rng(1);
  const std::vector<token_id> ids = random_token_ids(rng, n);
  const std::vector<std::span<const float>> keys(o.layers, data.keys_of(0, n)), values(o.layers, data.values_of(0, n));
  const std::string shape = std::to_string(n) + " tokens x " + std::to_string(o.layers) + " layers";

  out.run("prefix_attach", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "1 rate", "sequences holding " + shape, "ops/s");
    metric& taken = declare(m, "2 blocks", "blocks one takes from the budget", "blocks", false);
    metric& memory = declare(m, "3 memory", "new block memory one allocates", "blocks", false);
    metric& referenced = declare(m, "4 referenced", "cached blocks one references", "blocks", false);

    asio::thread_pool threads(o.threads);
    const auto appended = [&](const kv_block_pool& pool) {  // a new sequence taking the tokens by one append
      sequence_kv_cache seq(threads, o.layers, o.config(), pool);
      seq.async_append(std::span<const token_id>(ids), keys, values, asio::use_future).get();
      return seq;
    };
    // Records what `make()` adds to `pool`'s counters, once, then times it
    // (the sequence it makes is destroyed after the clock stops).
    const auto measure = [&](const std::string& impl, const kv_block_pool& pool, auto make) {
      const kv_pool_stats before = pool.stats();
      {
        const sequence_kv_cache seq = make();
        if (seq.size() != n) fail("prefix_attach", impl + " made a sequence of " + std::to_string(seq.size()));
        const kv_pool_stats after = pool.stats();
        taken.values[impl] = double(after.blocks_in_use - before.blocks_in_use);
        memory.values[impl] = double(after.blocks_allocated - before.blocks_allocated);
        referenced.values[impl] = double(after.blocks_cached - after.blocks_cached_idle);
        if ((impl == "ghostlink" || impl == "hybrid") &&
            (after.blocks_in_use != before.blocks_in_use || after.blocks_allocated != before.blocks_allocated))
          fail("prefix_attach", "an attach allocated blocks");
      }
      rate.values[impl] = laps_per_second(o.seconds, [&] {
        const auto t0 = clock_type::now();
        const sequence_kv_cache seq = make();
        const double s = seconds_since(t0);
        keep(float(seq.size()));
        return s;
      });
    };

    // Each on a pool of its own.
    if (o.wants("ghostlink")) {
      const auto pool = kv_block_pool::for_caches(o.config());
      kv_prefix_cache cache(o.layers, o.config(), pool);
      {
        const sequence_kv_cache seq = appended(pool);
        cache.insert_stored_tokens(seq);
        seq.async_truncate(0, asio::use_future).get();  // the entries idle, as between requests
      }
      measure("ghostlink", pool, [&] { return cache.attach(threads, ids); });
    }
    if (o.wants("hybrid")) {  // interleaved(L, 6, 4 * B): what its windowed layers need at the end
      const auto pool = kv_block_pool::for_caches(o.config());
      const kv_model_layout layout = kv_model_layout::interleaved(o.layers, 6, 4 * o.block_tokens);
      kv_prefix_cache cache(layout, o.config(), pool);
      {
        sequence_kv_cache seq(threads, layout, o.config(), pool);
        cache.track(seq);  // every block cached as it fills
        seq.async_append(std::span<const token_id>(ids), keys, values, asio::use_future).get();
        seq.async_truncate(0, asio::use_future).get();
      }
      measure("hybrid", pool, [&] { return cache.attach(threads, ids); });
    }
    if (o.wants("fork")) {
      const auto pool = kv_block_pool::for_caches(o.config());
      const sequence_kv_cache seq = appended(pool);
      measure("fork", pool, [&] { return seq.async_fork(asio::use_future).get(); });
    }
    if (o.wants("append")) {
      const auto pool = kv_block_pool::for_caches(o.config());
      measure("append", pool, [&] { return appended(pool); });
    }
    threads.join();
  });
  out.add_note("prefix_attach", "ghostlink: attach() of " + shape +
                                    " cached (idle entries); hybrid: the same of interleaved(" +
                                    std::to_string(o.layers) + ", 6, " + std::to_string(4 * o.block_tokens) +
                                    "), tracked as it filled, whose windowed layers reference the blocks of their "
                                    "windows alone; fork: async_fork of a sequence holding them; append: a "
                                    "new sequence and one async_append of them with their ids. Each makes a new "
                                    "sequence; its destruction is not timed");
}

void prefix_hash(const options& o, report& out) {
  const std::size_t n = prompt_tokens(o);
  const auto prompts = random_prompts(16, n, 2);
  const auto pool = kv_block_pool::for_caches(o.config());
  const kv_prefix_cache cache(o.layers, o.config(), pool);
  const one_shot_sha256 sha;
  bare_chain chain(root_hash(sha, "", o.layers, o.config()), o.block_tokens);
  std::vector<digest> hashes;
  // The baseline computes what the contract defines, and so does ghostlink.
  chain(sha, prompts[0], hashes);
  const std::vector<kv_block_hash> mine = cache.block_hashes(prompts[0]);
  if (mine.size() != hashes.size() || !std::equal(mine.begin(), mine.end(), hashes.begin(),
                                                  [](const kv_block_hash& a, const digest& b) { return a.bytes == b; }))
    fail("prefix_hash", "block_hashes() differs from the contract's SHA-256 chain");

  out.run("prefix_hash", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "1 rate", "block hashes of " + std::to_string(n) + "-token prompts", "tokens/s");
    metric& ratio = declare(m, "2 ratio", "speed against bare OpenSSL", "x");
    const double tokens = double(n);
    rate.values["ghostlink"] = tokens * ops_per_second(o.seconds, [&](std::size_t i) {
                                 const std::vector<kv_block_hash> h = cache.block_hashes(prompts[i % prompts.size()]);
                                 keep(float(h.back().bytes[0]));
                               });
    rate.values["openssl"] = tokens * ops_per_second(o.seconds, [&](std::size_t i) {
                               chain(sha, prompts[i % prompts.size()], hashes);
                               keep(float(hashes.back()[0]));
                             });
    ratio.values["ghostlink"] = rate.values["ghostlink"] / rate.values["openssl"];
  });
  out.add_note("prefix_hash", "openssl: one EVP_Digest (SHA-256, fetched once) per block of the 32-byte previous hash "
                              "|| the block's tokens as little-endian i32, checked equal to block_hashes(); one "
                              "thread; target ghostlink >= 0.8x");
}

void prefix_match(const options& o, report& out) {
  const std::size_t bt = o.block_tokens, n = entry_blocks(o) * bt;
  const std::size_t count = (entries_wanted(o) + entry_blocks(o) - 1) / entry_blocks(o);
  const auto prompts = random_prompts(count, n, 3);
  asio::thread_pool threads(1);
  const kv_cache_config config = small_config(bt, n);
  const auto pool = kv_block_pool::for_caches(config);
  kv_prefix_cache cache(1, config, pool);
  insert_idle("prefix_match", cache, threads, prompts);
  if (cache.match(prompts.back()) != n) fail("prefix_match", "a cached prompt does not match whole");
  const std::string entries = std::to_string(cache.stats().cached_blocks);

  out.run("prefix_match", o, [&](std::map<std::string, metric>& m) {
    // Each a full hit, one lookup per block: every cached prompt in turn
    // (the whole index), then one prompt over and over (its entries in the
    // processor's caches).
    const auto measure = [&](const std::string& key, const std::string& name, std::size_t prompts_used) {
      metric& rate = declare(m, key + " rate", name, "calls/s");
      metric& ratio = declare(m, key + " ratio", "match / hashing time, " + key, "x", false);
      rate.values["ghostlink"] =
          ops_per_second(o.seconds, [&](std::size_t i) { keep(float(cache.match(prompts[i % prompts_used]))); });
      rate.values["hash_only"] = ops_per_second(o.seconds, [&](std::size_t i) {
        keep(float(cache.block_hashes(prompts[i % prompts_used]).back().bytes[0]));
      });
      ratio.values["ghostlink"] = rate.values["hash_only"] / rate.values["ghostlink"];
    };
    measure("all", std::to_string(n) + "-token prompts, " + entries + " entries", prompts.size());
    measure("one", "one of them over and over", 1);
  });
  threads.join();
  out.add_note("prefix_match", "1 layer of 1 head x 8 dims, " + std::to_string(bt) + "-token blocks, " +
                                   std::to_string(count) +
                                   " prompts cached; all: each matched in turn (full hits); "
                                   "one: one prompt over and over; hash_only: block_hashes() of the same prompts; "
                                   "one thread; target match <= 1.5x the hashing time");
}

void prefix_eviction(const options& o, report& out) {
  // One-token blocks, so that every append needs a new block.
  const std::size_t per_prompt = entry_blocks(o);
  const std::size_t count = (entries_wanted(o) + per_prompt - 1) / per_prompt;
  const std::size_t entries = count * per_prompt;
  const std::size_t appends = o.quick ? 256 : 20000;
  const kv_cache_config config = small_config(1, std::max(per_prompt, appends));
  const auto prompts = random_prompts(count, per_prompt, 4);

  out.run("prefix_eviction", o, [&](std::map<std::string, metric>& m) {
    metric& p50 = declare(m, "1 p50", "one-token append p50", "ns", false);
    metric& p99 = m["2 p99"];
    p99 = p50;
    p99.name = "one-token append p99";
    metric& ratio = m["3 ratio"];
    ratio = p50;
    ratio.name = "p99 evicting / p99 free list";
    ratio.unit = "x";
    metric& evicted = declare(m, "4 evicted", "entries evicted per append", "entries");
    metric& versus = m["5 vs lru"];
    versus = p50;
    versus.name = "p99 with priorities / p99 plain LRU";
    versus.unit = "x";

    // The budget full of idle entries: every append evicts one. `name`'s
    // entries at `retentions` (none: plain LRU).
    const auto evicting = [&](const std::string& name, const std::vector<kv_retention>* retentions) {
      asio::thread_pool threads(1);
      const auto pool = kv_block_pool::for_caches(config, {.max_blocks = entries});
      kv_prefix_cache cache(1, config, pool);
      insert_idle("prefix_eviction", cache, threads, prompts, retentions);
      if (pool.stats().blocks_in_use != entries || pool.stats().blocks_cached_idle != entries)
        fail("prefix_eviction", "the budget is not full of idle entries");
      latencies lat = one_token_appends(config, pool, appends);
      p50.values[name] = lat.p(0.5);
      p99.values[name] = lat.p(0.99);
      evicted.values[name] = double(cache.stats().evicted_blocks) / double(appends);
      if (cache.stats().evicted_blocks != appends) fail("prefix_eviction", "not every append evicted one entry");
      threads.join();
    };
    evicting("ghostlink", nullptr);
    {  // Each prompt's entries at random priorities over four ranges, a
       // quarter with a duration (an hour: none ends, each is in the set of
       // deadlines that every eviction looks at).
      std::mt19937_64 rng(5);
      std::uniform_int_distribution<int> priority(0, 100);
      std::vector<kv_retention> retentions(prompts.size());
      for (kv_retention& r : retentions) {
        r.default_priority = static_cast<std::uint8_t>(priority(rng));
        for (std::size_t q = 0; q < 4; ++q)
          r.ranges.push_back({.first = q * per_prompt / 4,
                              .last = (q + 1) * per_prompt / 4,
                              .priority = static_cast<std::uint8_t>(priority(rng)),
                              .duration = rng() % 4 == 0 ? std::chrono::milliseconds(std::chrono::hours(1))
                                                         : std::chrono::milliseconds(0)});
      }
      evicting("priorities", &retentions);
    }
    {  // The same budget, no entry: every append takes a block the free list holds.
      const auto pool = kv_block_pool::for_caches(config, {.max_blocks = entries});
      const kv_prefix_cache cache(1, config, pool);
      one_token_appends(config, pool, appends);  // leaves `appends` blocks on the free list
      const kv_pool_stats before = pool.stats();
      if (before.blocks_free < appends) fail("prefix_eviction", "the free list is short");
      latencies lat = one_token_appends(config, pool, appends);
      p50.values["free_list"] = lat.p(0.5);
      p99.values["free_list"] = lat.p(0.99);
      evicted.values["free_list"] = double(cache.stats().evicted_blocks) / double(appends);
      if (pool.stats().blocks_allocated != before.blocks_allocated)
        fail("prefix_eviction", "an append took memory the free list did not hold");
    }
    ratio.values["ghostlink"] = p99.values["ghostlink"] / p99.values["free_list"];
    ratio.values["priorities"] = p99.values["priorities"] / p99.values["free_list"];
    versus.values["priorities"] = p99.values["priorities"] / p99.values["ghostlink"];
  });
  out.add_note("prefix_eviction", std::to_string(appends) +
                                      " one-token appends (co_await on a one-thread io_context) to a sequence of "
                                      "1 layer, 1 head x 8 dims, 1-token blocks. ghostlink: the budget full of " +
                                      std::to_string(entries) + " idle entries (" + std::to_string(count) +
                                      " prompts of " + std::to_string(per_prompt) +
                                      " blocks), each append evicts one (plain LRU: every entry at the default "
                                      "priority); priorities: the same, each prompt's entries at random "
                                      "priorities 0-100 over four ranges, a quarter of them with a duration; "
                                      "free_list: the same budget and no entry, each append pops a freed block; "
                                      "targets: p99 ratio <= 2x, priorities / plain LRU p99 <= 1.2x");
}

}  // namespace ghostlink::bench
