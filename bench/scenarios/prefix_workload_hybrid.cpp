// prefix_workload_hybrid: prefix_workload's chat trace (chat_trace.hpp)
// replayed through a prefix cache of a hybrid layout,
// interleaved(L, 6, 4 * B) (five windowed layers in six, as Gemma 3), and of
// full(L), on pools of the same bytes: each request attaches the longest
// cached prefix of its prompt (less its last token), is tracked (its
// blocks cached as they fill), prefills the rest in one append, decodes
// its output one token at a time and lets go. A sweep of pool sizes from
// 10% to 100% of what would keep every prefix of the trace: the hit rate
// of each class of request (new conversations on a shared system prompt,
// follow-up turns, exact repeats) for both layouts, the prompt tokens
// saved, and the blocks the cache holds at the end.
//
// Fails (status 1) if the hybrid layout's hit rate is 0 at any size
// (vllm#48435: hits fell to zero at about 25% occupancy), or below 0.9x
// the full layout's overall at any size.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/this_coro.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <string>
#include <unordered_set>
#include <vector>

#include "../chat_trace.hpp"
#include "../row_appender.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

constexpr std::array<const char*, 3> class_names = {"system prompt", "follow-up", "repeat"};

/// What one replay of the trace gives.
struct replay_result {
  std::array<std::uint64_t, 3> query{}, hit{};  // tokens, per request_kind
  std::uint64_t prefilled = 0, failed = 0;
  kv_prefix_stats stats;
  std::size_t blocks_cached = 0;  // the pool's, at the end

  double hit_rate(std::size_t k) const { return query[k] ? 100.0 * double(hit[k]) / double(query[k]) : 0.0; }
  double overall() const {
    std::uint64_t q = 0, h = 0;
    for (std::size_t k = 0; k < 3; ++k) {
      q += query[k];
      h += hit[k];
    }
    return q ? 100.0 * double(h) / double(q) : 0.0;
  }
};

asio::awaitable<void> replay(kv_prefix_cache& cache, const std::vector<request>& trace, const token_rows& data,
                             replay_result& r) {
  const auto ex = co_await asio::this_coro::executor;
  const std::size_t bt = cache.config().block_tokens;
  row_appender append(data, cache.num_layers());
  for (const request& q : trace) {
    const std::span<const token_id> prompt(q.prompt);
    const sequence_kv_cache seq = cache.attach(ex, prompt.first(prompt.size() - 1));
    const auto k = static_cast<std::size_t>(q.kind);
    r.query[k] += (prompt.size() - 1) / bt * bt;
    r.hit[k] += seq.size();
    r.prefilled += prompt.size() - seq.size();
    cache.track(seq);
    try {
      co_await append(seq, prompt.subspan(seq.size()));
      co_await append.one_by_one(seq, q.output);
    } catch (const std::system_error&) {  // the pool could not hold the request
      ++r.failed;
    }
    co_await seq.async_truncate(0, asio::use_awaitable);
  }
  r.stats = cache.stats();
  r.blocks_cached = cache.pool().stats().blocks_cached;
}

/// Blocks of every layer that would keep every prefix the trace holds.
std::size_t blocks_of_every_prefix(const std::vector<request>& trace, std::size_t bt, std::size_t layers) {
  std::unordered_set<std::uint64_t> seen;
  for (const request& q : trace) {
    std::uint64_t h = 0;
    const auto add = [&](token_id t, std::size_t i) {
      h = (h ^ static_cast<std::uint32_t>(t)) * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
      if ((i + 1) % bt == 0) seen.insert(h);
    };
    std::size_t i = 0;
    for (token_id t : q.prompt) add(t, i++);
    for (token_id t : q.output) add(t, i++);
  }
  return seen.size() * layers;
}

}  // namespace

void prefix_workload_hybrid(const options& o, report& out) {
  trace_shape shape = shape_of(o);
  shape.layers = o.quick ? 6 : 12;
  const std::vector<request> trace = make_trace(shape);
  const std::size_t bt = o.block_tokens;
  std::size_t longest = 0, prompt_tokens = 0;
  for (const request& q : trace) {
    longest = std::max(longest, q.prompt.size() + q.output.size());
    prompt_tokens += q.prompt.size();
  }
  // The hit rates do not depend on the geometry: a small one keeps the copies cheap.
  kv_cache_config config{.num_heads = 2, .head_dim = 64, .block_tokens = bt};
  config.max_tokens_per_seq = (longest + bt - 1) / bt * bt;
  const token_rows data(config.token_width(), config.max_tokens_per_seq);
  const kv_model_layout hybrid = kv_model_layout::interleaved(shape.layers, 6, 4 * bt);
  const kv_model_layout full = kv_model_layout::full(shape.layers);
  const std::size_t every = blocks_of_every_prefix(trace, bt, shape.layers);
  const std::size_t one_request = (config.max_tokens_per_seq / bt + 1) * shape.layers;
  const std::array<std::size_t, 5> percent = {10, 25, 50, 75, 100};

  std::string failure;
  out.run("prefix_workload_hybrid", o, [&](std::map<std::string, metric>& m) {
    for (const std::size_t p : percent) {
      const std::string at = std::to_string(p) + "%";
      std::array<char, 8> digits{};
      std::snprintf(digits.data(), digits.size(), "%03zu", p);  // metrics sort by key
      const std::string order(digits.data());
      metric& overall = declare(m, order + " 0 hit", "hit rate, pool " + at + " of every prefix", "%");
      std::array<metric*, 3> per_class{};
      for (std::size_t k = 0; k < 3; ++k)
        per_class[k] = &declare(m, order + " " + std::to_string(k + 1) + " " + class_names[k],
                                std::string("hit rate of ") + class_names[k] + " requests, pool " + at, "%");
      metric& saved = declare(m, order + " 4 saved", "prompt tokens saved, pool " + at, "%");
      metric& held = declare(m, order + " 5 held", "blocks the cache holds at the end, pool " + at, "blocks", false);
      metric& window = declare(m, order + " 6 windowed", "windowed parts evicted alone, pool " + at, "parts", false);
      metric& cached = declare(m, order + " 7 entries", "entries cached at the end, pool " + at, "entries");
      const std::size_t budget = std::max(one_request, every * p / 100);
      replay_result got[2];
      for (std::size_t i = 0; i < 2; ++i) {
        const std::string impl = i == 0 ? "full" : "hybrid";
        if (!o.wants(impl)) continue;
        asio::thread_pool threads(o.threads);
        const auto pool = kv_block_pool::for_caches(config, {.max_blocks = budget});
        kv_prefix_cache cache(i == 0 ? full : hybrid, config, pool);
        asio::co_spawn(threads, replay(cache, trace, data, got[i]), asio::use_future).get();
        threads.join();
        const replay_result& r = got[i];
        overall.values[impl] = r.overall();
        for (std::size_t k = 0; k < 3; ++k) per_class[k]->values[impl] = r.hit_rate(k);
        saved.values[impl] = 100.0 * (1.0 - double(r.prefilled) / double(prompt_tokens));
        held.values[impl] = double(r.blocks_cached);
        window.values[impl] = double(r.stats.window_evictions);
        cached.values[impl] = double(r.stats.cached_entries);
        if (r.failed != 0) failure = impl + ": " + std::to_string(r.failed) + " requests did not fit a pool of " + at;
      }
      if (o.wants("full") && o.wants("hybrid")) {
        if (got[1].overall() == 0.0) failure = "the hybrid layout's hit rate is 0 with a pool of " + at;
        if (got[1].overall() < 0.9 * got[0].overall())
          failure = "the hybrid layout's hit rate is below 0.9x the full layout's with a pool of " + at;
      }
    }
  });
  if (!failure.empty()) fail("prefix_workload_hybrid", failure);
  out.add_note("prefix_workload_hybrid",
               std::to_string(shape.layers) + " layers of 2 heads x 64, interleaved(" + std::to_string(shape.layers) +
                   ", 6, " + std::to_string(4 * bt) + ") against full(" + std::to_string(shape.layers) +
                   "), pools of the same blocks: " + std::to_string(every) +
                   " blocks keep every prefix of the trace (100%), never fewer than one request's " +
                   std::to_string(one_request) + "; prefix_workload's trace of " + std::to_string(trace.size()) +
                   " requests; each attaches, is tracked, prefills, decodes " + std::to_string(shape.decode) +
                   " tokens and lets go");
}

}  // namespace ghostlink::bench
