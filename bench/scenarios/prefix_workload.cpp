// prefix_workload: a request trace replayed one request at a time through
// a prefix cache under a budget small enough that entries are evicted,
// against the same trace with no prefix cache (every prompt prefilled
// whole). The trace: 64 system prompts of 512 tokens picked by a Zipf law
// (s = 1.1), each with a unique suffix of 64..256 tokens; conversations
// whose next turn extends the previous one (its prompt, its output and a
// user turn of 32..128 tokens); and exact repeats of recent requests (one
// in ten). Each request: attach(prompt minus its last token), one append
// of the rest with the ids, 16 one-token decode appends,
// insert_stored_tokens(), truncate to 0 (its blocks released when that
// completes), drop.
//
// The cache's and the pool's counters after every request must equal what
// an offline model of the contract computes over the same trace: entries
// keyed by a chain hash of their tokens, LRU by the tick of the last attach
// or insert (later blocks of one call touched first), idle leaf entries
// evicted least recently used first whenever a block is needed and the
// budget (blocks of every layer) is spent. A difference ends the benchmark
// with status 1.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/this_coro.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "../chat_trace.hpp"
#include "../row_appender.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

/// What is compared after every request: the prefix cache's and the pool's
/// counters, and the prompt tokens prefilled so far.
struct counters {
  std::uint64_t query_tokens = 0, hit_tokens = 0, inserted = 0, evicted = 0, prefilled = 0;
  std::size_t entries = 0, idle_entries = 0;
  std::size_t blocks_in_use = 0, blocks_cached = 0, blocks_cached_idle = 0;
  friend bool operator==(const counters&, const counters&) = default;
  std::string str() const {
    return "query_tokens " + std::to_string(query_tokens) + ", hit_tokens " + std::to_string(hit_tokens) +
           ", inserted " + std::to_string(inserted) + ", evicted " + std::to_string(evicted) + ", prefilled " +
           std::to_string(prefilled) + ", entries " + std::to_string(entries) + " (" + std::to_string(idle_entries) +
           " idle), pool blocks in use " + std::to_string(blocks_in_use) + ", cached " + std::to_string(blocks_cached) +
           " (" + std::to_string(blocks_cached_idle) + " idle)";
  }
};

/// The contract's LRU over the trace, offline. Entries are keyed by a
/// 64-bit chain hash of their block and every token before it.
class lru_model {
 public:
  lru_model(std::size_t layers, std::size_t block_tokens, std::size_t max_blocks)
      : layers_(layers), bt_(block_tokens), max_blocks_(max_blocks) {}

  /// One request, as the replay runs it; false if a block could not be had.
  bool run(const request& r) {
    std::vector<token_id> all = r.prompt;
    all.insert(all.end(), r.output.begin(), r.output.end());
    const std::vector<std::uint64_t> keys = chain_keys(all);
    const std::size_t p = r.prompt.size();
    // attach(prompt minus its last token)
    const std::size_t asked = (p - 1) / bt_;
    std::size_t hit = 0;
    while (hit < asked && entries_.contains(keys[hit])) ++hit;
    c_.query_tokens += asked * bt_;
    c_.hit_tokens += hit * bt_;
    for (std::size_t i = hit; i-- > 0;) touch(keys[i]);
    for (std::size_t i = 0; i < hit; ++i) set_busy(keys[i]);
    // The prefill, then the decode: a block per layer for every block begun.
    std::size_t held = 0;  // blocks per layer the sequence holds that no entry does
    for (std::size_t i = hit * bt_; i < all.size(); ++i) {
      if (i % bt_ != 0) continue;
      ++held;
      if (!allocate()) return false;
    }
    c_.prefilled += p - hit * bt_;
    // insert_stored_tokens(): an entry that exists keeps its blocks (one the
    // attach left out: the prompt's last block when its last token ends it).
    const std::size_t full = all.size() / bt_;
    for (std::size_t i = hit; i < full; ++i) {
      if (entries_.contains(keys[i])) continue;
      entry& e = entries_[keys[i]];
      e.busy = true;
      if (i > 0) {
        e.parent = keys[i - 1];
        e.has_parent = true;
        ++entries_.at(keys[i - 1]).children;  // busy: not evictable either way
      }
      ++c_.inserted;
      --held;
    }
    for (std::size_t i = full; i-- > 0;) touch(keys[i]);
    // truncate to 0: the entries idle, the rest freed.
    in_use_ -= held * layers_;
    for (std::size_t i = 0; i < full; ++i) {
      entry& e = entries_.at(keys[i]);
      e.busy = false;
      if (e.children == 0) evictable_.insert({e.tick, keys[i]});
    }
    return true;
  }

  /// The counters after the last request (every entry idle).
  counters now() const {
    counters c = c_;
    c.entries = c.idle_entries = entries_.size();
    c.blocks_in_use = in_use_;
    c.blocks_cached = c.blocks_cached_idle = entries_.size() * layers_;
    return c;
  }

 private:
  struct entry {
    std::uint64_t parent = 0, tick = 0;
    bool has_parent = false, busy = false;
    std::size_t children = 0;
  };

  static std::uint64_t mix(std::uint64_t x) {  // splitmix64's finaliser
    x += 0x9e3779b97f4a7c15;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9;
    x = (x ^ (x >> 27)) * 0x94d049bb133111eb;
    return x ^ (x >> 31);
  }
  std::vector<std::uint64_t> chain_keys(std::span<const token_id> tokens) const {
    std::vector<std::uint64_t> keys(tokens.size() / bt_);
    std::uint64_t h = 0;
    for (std::size_t b = 0; b < keys.size(); ++b) {
      for (std::size_t i = 0; i < bt_; ++i) h = mix(h ^ static_cast<std::uint32_t>(tokens[b * bt_ + i]));
      keys[b] = h;
    }
    return keys;
  }

  void touch(std::uint64_t key) {
    entry& e = entries_.at(key);
    const bool listed = evictable_.erase({e.tick, key}) != 0;
    e.tick = ++clock_;
    if (listed) evictable_.insert({e.tick, key});
  }
  void set_busy(std::uint64_t key) {
    entry& e = entries_.at(key);
    evictable_.erase({e.tick, key});
    e.busy = true;
  }
  /// One block of one layer; evicts the least recently used evictable entry
  /// (one block of every layer) first if the budget is spent.
  bool allocate_one() {
    if (in_use_ == max_blocks_) {
      if (evictable_.empty()) return false;
      const std::uint64_t key = evictable_.begin()->second;
      evictable_.erase(evictable_.begin());
      const entry e = entries_.at(key);
      entries_.erase(key);
      if (e.has_parent) {
        entry& parent = entries_.at(e.parent);
        if (--parent.children == 0 && !parent.busy) evictable_.insert({parent.tick, e.parent});
      }
      in_use_ -= layers_;
      ++c_.evicted;
    }
    ++in_use_;
    return true;
  }
  /// One block of every layer, as one block of an append takes.
  bool allocate() {
    for (std::size_t l = 0; l < layers_; ++l)
      if (!allocate_one()) return false;
    return true;
  }

  const std::size_t layers_, bt_, max_blocks_;
  std::unordered_map<std::uint64_t, entry> entries_;
  std::set<std::pair<std::uint64_t, std::uint64_t>> evictable_;  // (tick, key)
  std::uint64_t clock_ = 0;
  std::size_t in_use_ = 0;
  counters c_;
};

counters read(const kv_prefix_cache& cache, std::uint64_t prefilled) {
  const kv_prefix_stats s = cache.stats();
  const kv_pool_stats p = cache.pool().stats();
  return {.query_tokens = s.query_tokens,
          .hit_tokens = s.hit_tokens,
          .inserted = s.inserted_blocks,
          .evicted = s.evicted_blocks,
          .prefilled = prefilled,
          .entries = s.cached_blocks,
          .idle_entries = s.idle_blocks,
          .blocks_in_use = p.blocks_in_use,
          .blocks_cached = p.blocks_cached,
          .blocks_cached_idle = p.blocks_cached_idle};
}

asio::awaitable<void> replay_cached(kv_prefix_cache& cache, const std::vector<request>& trace, const token_rows& data,
                                    std::vector<counters>& seen) {
  const auto ex = co_await asio::this_coro::executor;
  row_appender append(data, cache.num_layers());
  std::uint64_t prefilled = 0;
  for (const request& r : trace) {
    const std::span<const token_id> prompt(r.prompt);
    const sequence_kv_cache seq = cache.attach(ex, prompt.first(prompt.size() - 1));
    prefilled += prompt.size() - seq.size();
    co_await append(seq, prompt.subspan(seq.size()));
    co_await append.one_by_one(seq, r.output);
    cache.insert_stored_tokens(seq);
    co_await seq.async_truncate(0, asio::use_awaitable);
    seen.push_back(read(cache, prefilled));
  }
}

asio::awaitable<void> replay_uncached(const kv_block_pool& pool, std::size_t layers, const kv_cache_config& config,
                                      const std::vector<request>& trace, const token_rows& data,
                                      std::uint64_t& prefilled) {
  const auto ex = co_await asio::this_coro::executor;
  row_appender append(data, layers);
  for (const request& r : trace) {
    const sequence_kv_cache seq(ex, layers, config, pool);
    co_await append(seq, r.prompt);
    co_await append.one_by_one(seq, r.output);
    co_await seq.async_truncate(0, asio::use_awaitable);
    prefilled += r.prompt.size();
  }
}

}  // namespace

void prefix_workload(const options& o, report& out) {
  const trace_shape shape = shape_of(o);
  const std::vector<request> trace = make_trace(shape);
  std::size_t longest = 0, prompt_tokens = 0;
  for (const request& r : trace) {
    longest = std::max(longest, r.prompt.size() + r.output.size());
    prompt_tokens += r.prompt.size();
  }
  kv_cache_config config = o.config();
  config.max_tokens_per_seq = (longest + o.block_tokens - 1) / o.block_tokens * o.block_tokens;
  if (config.max_tokens_per_seq / o.block_tokens > shape.budget)
    fail("prefix_workload", "the budget is smaller than one request");
  const token_rows data(config.token_width(), config.max_tokens_per_seq);
  const kv_pool_limits limits{.max_blocks = shape.budget * shape.layers};

  // The model's figures, after every request.
  lru_model model(shape.layers, o.block_tokens, limits.max_blocks);
  std::vector<counters> expected;
  for (std::size_t i = 0; i < trace.size(); ++i) {
    if (!model.run(trace[i])) fail("prefix_workload", "request " + std::to_string(i) + " cannot run in the budget");
    expected.push_back(model.now());
  }
  const counters last = expected.back();
  if (last.evicted == 0) fail("prefix_workload", "the budget is large enough that nothing is evicted");

  out.run("prefix_workload", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "1 rate", std::to_string(trace.size()) + " requests, one at a time", "requests/s");
    metric& hits = declare(m, "2 hit rate", "hit rate (hit / query tokens)", "%");
    metric& prefill = declare(m, "3 prefill", "prompt tokens prefilled", "tokens", false);
    metric& saved = declare(m, "4 saved", "prompt tokens saved", "%");
    metric& evicted = declare(m, "5 evicted", "entries evicted", "entries", false);
    hits.values["simulated"] = 100.0 * double(last.hit_tokens) / double(last.query_tokens);
    prefill.values["simulated"] = double(last.prefilled);
    evicted.values["simulated"] = double(last.evicted);
    const auto saved_of = [&](double prefilled) { return 100.0 * (1.0 - prefilled / double(prompt_tokens)); };
    saved.values["simulated"] = saved_of(double(last.prefilled));

    if (o.wants("ghostlink")) {
      asio::thread_pool threads(o.threads);
      const auto pool = kv_block_pool::for_caches(config, limits);
      kv_prefix_cache cache(shape.layers, config, pool);
      std::vector<counters> seen;
      seen.reserve(trace.size());
      const auto t0 = clock_type::now();
      asio::co_spawn(threads, replay_cached(cache, trace, data, seen), asio::use_future).get();
      rate.values["ghostlink"] = double(trace.size()) / seconds_since(t0);
      threads.join();
      for (std::size_t i = 0; i < trace.size(); ++i)
        if (seen[i] != expected[i])
          fail("prefix_workload", "after request " + std::to_string(i) + " the cache has " + seen[i].str() +
                                      "; the LRU model has " + expected[i].str());
      const kv_prefix_stats s = cache.stats();
      hits.values["ghostlink"] = 100.0 * double(s.hit_tokens) / double(s.query_tokens);
      prefill.values["ghostlink"] = double(seen.back().prefilled);
      saved.values["ghostlink"] = saved_of(double(seen.back().prefilled));
      evicted.values["ghostlink"] = double(s.evicted_blocks);
    }
    if (o.wants("no_cache")) {
      asio::thread_pool threads(o.threads);
      const auto pool = kv_block_pool::for_caches(config, limits);
      std::uint64_t prefilled = 0;
      const auto t0 = clock_type::now();
      asio::co_spawn(threads, replay_uncached(pool, shape.layers, config, trace, data, prefilled), asio::use_future)
          .get();
      rate.values["no_cache"] = double(trace.size()) / seconds_since(t0);
      threads.join();
      prefill.values["no_cache"] = double(prefilled);
      saved.values["no_cache"] = saved_of(double(prefilled));
    }
  });
  out.add_note("prefix_workload",
               std::to_string(shape.layers) + " layers of " + std::to_string(o.heads) + " heads x " +
                   std::to_string(o.head_dim) + ", budget " + std::to_string(shape.budget) + " blocks per layer; " +
                   std::to_string(shape.system_prompts) + " system prompts of " + std::to_string(shape.system_tokens) +
                   " tokens (Zipf s = 1.1) + a unique suffix, conversations of up to " +
                   std::to_string(shape.max_turns) + " turns, 1 in 10 a repeat of a recent request, " +
                   std::to_string(shape.decode) + " decoded tokens per request, " + std::to_string(prompt_tokens) +
                   " prompt tokens in all; simulated: the contract's LRU offline, equal to the cache's counters "
                   "after every request (checked); no_cache: every prompt prefilled whole. No model runs: a "
                   "prefilled token costs a copy, so requests/s shows the cache's bookkeeping, not the compute "
                   "it saves");
}

}  // namespace ghostlink::bench
