// retention: a system prompt every chat shares, through a scan of one-off
// documents (TensorRT-LLM's KvCacheRetentionConfig case). Rounds of one
// chat request (the system prompt and a unique question) then one-off
// documents totalling the pool's blocks, ten rounds in all: the documents
// total 10x the pool. Each request attaches the longest cached prefix of
// its prompt (less its last token), is tracked, prefills the rest, decodes
// a few tokens and lets go. "priorities": the chats are tracked with the
// system prompt at priority 90, the documents at the default 35; "lru":
// every request at the default (plain least recently used). Reports the
// hit rate of the chat requests and of all requests, and the prompt tokens
// saved. Fails (status 1) if the system prompt does not keep hitting with
// priorities (below 90% of the chats' system prompt tokens after the
// first), or if plain LRU keeps it all the same (the workload would then
// not be a test of anything).
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/this_coro.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../row_appender.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

struct trace_request {
  std::vector<token_id> prompt;
  bool chat = false;  // the system prompt and a question
};

struct retention_shape {
  std::size_t layers, system_tokens, question_tokens, document_tokens, pool_tokens, rounds, decode;
};

retention_shape shape_for(const options& o) {
  if (o.quick) return {2, 64, 16, 64, 256, 10, 2};
  return {4, 1024, 64, 512, 4096, 10, 16};
}

std::vector<trace_request> make_trace(const retention_shape& s) {
  std::mt19937_64 rng(7);
  const std::vector<token_id> system = random_token_ids(rng, s.system_tokens);
  std::vector<trace_request> trace;
  for (std::size_t r = 0; r <= s.rounds; ++r) {  // a last chat after the last scan
    trace_request chat{system, true};
    const std::vector<token_id> question = random_token_ids(rng, s.question_tokens);
    chat.prompt.insert(chat.prompt.end(), question.begin(), question.end());
    trace.push_back(std::move(chat));
    if (r == s.rounds) break;
    for (std::size_t d = 0; d < s.pool_tokens / s.document_tokens; ++d)
      trace.push_back({random_token_ids(rng, s.document_tokens), false});
  }
  return trace;
}

struct replay_result {
  std::uint64_t chat_query = 0, chat_hit = 0, query = 0, hit = 0, prompt = 0, prefilled = 0;
  std::uint64_t chat_system_hit_after_first = 0, chat_system_after_first = 0;
  kv_prefix_stats stats;
};

asio::awaitable<void> replay(kv_prefix_cache& cache, const std::vector<trace_request>& trace,
                             const retention_shape& shape, const token_rows& data,
                             const std::optional<kv_retention>& keep, replay_result& r) {
  const auto ex = co_await asio::this_coro::executor;
  const std::size_t bt = cache.config().block_tokens;
  row_appender append(data, cache.num_layers());
  std::mt19937_64 rng(11);
  bool first_chat = true;
  for (const trace_request& q : trace) {
    const std::span<const token_id> prompt(q.prompt);
    const sequence_kv_cache seq = cache.attach(ex, prompt.first(prompt.size() - 1));
    const std::uint64_t asked = (prompt.size() - 1) / bt * bt;
    r.query += asked;
    r.hit += seq.size();
    r.prompt += prompt.size();
    r.prefilled += prompt.size() - seq.size();
    if (q.chat) {
      r.chat_query += asked;
      r.chat_hit += seq.size();
      if (!first_chat) {
        r.chat_system_after_first += shape.system_tokens;
        r.chat_system_hit_after_first += std::min<std::uint64_t>(seq.size(), shape.system_tokens);
      }
      first_chat = false;
    }
    if (q.chat && keep)
      cache.track(seq, "", *keep);
    else
      cache.track(seq);
    co_await append(seq, prompt.subspan(seq.size()));
    const std::vector<token_id> output = random_token_ids(rng, shape.decode);
    co_await append.one_by_one(seq, output);
    co_await seq.async_truncate(0, asio::use_awaitable);
  }
  r.stats = cache.stats();
}

double percent(std::uint64_t part, std::uint64_t whole) { return whole ? 100.0 * double(part) / double(whole) : 0.0; }

}  // namespace

void retention(const options& o, report& out) {
  const retention_shape shape = shape_for(o);
  const std::vector<trace_request> trace = make_trace(shape);
  const std::size_t bt = o.block_tokens;
  kv_cache_config config{.num_heads = 2, .head_dim = 64, .block_tokens = bt};
  std::size_t longest = 0;
  for (const trace_request& q : trace) longest = std::max(longest, q.prompt.size() + shape.decode);
  config.max_tokens_per_seq = (longest + bt - 1) / bt * bt;
  const token_rows data(config.token_width(), config.max_tokens_per_seq);
  const std::size_t budget = shape.pool_tokens / bt * shape.layers;
  const kv_retention keep{.ranges = {{.first = 0, .last = shape.system_tokens, .priority = 90}}};

  std::string failure;
  out.run("retention", o, [&](std::map<std::string, metric>& m) {
    metric& system = declare(m, "1 system", "system prompt tokens hit by chats after the first", "%");
    metric& chats = declare(m, "2 chats", "hit rate of chat requests", "%");
    metric& all = declare(m, "3 all", "hit rate of all requests", "%");
    metric& saved = declare(m, "4 saved", "prompt tokens saved", "%");
    metric& low = declare(m, "5 evicted 25-49", "entries evicted at priority 25-49", "entries", false);
    metric& high = declare(m, "6 evicted 75-100", "entries evicted at priority 75-100", "entries", false);
    for (const std::string impl : {"priorities", "lru"}) {
      if (!o.wants(impl)) continue;
      asio::thread_pool threads(o.threads);
      const auto pool = kv_block_pool::for_caches(config, {.max_blocks = budget});
      kv_prefix_cache cache(shape.layers, config, pool);
      replay_result r;
      const std::optional<kv_retention> given = impl == "priorities" ? std::optional(keep) : std::nullopt;
      asio::co_spawn(threads, replay(cache, trace, shape, data, given, r), asio::use_future).get();
      threads.join();
      system.values[impl] = percent(r.chat_system_hit_after_first, r.chat_system_after_first);
      chats.values[impl] = percent(r.chat_hit, r.chat_query);
      all.values[impl] = percent(r.hit, r.query);
      saved.values[impl] = 100.0 - percent(r.prefilled, r.prompt);
      low.values[impl] = double(r.stats.evictions_by_priority[1]);
      high.values[impl] = double(r.stats.evictions_by_priority[3]);
    }
    if (o.wants("priorities") && system.values["priorities"] < 90.0)
      failure = "the system prompt at priority 90 did not keep hitting";
    if (o.wants("lru") && system.values["lru"] >= 90.0)
      failure = "plain LRU kept the system prompt: the scan does not evict it";
  });
  if (!failure.empty()) fail("retention", failure);
  out.add_note(
      "retention",
      std::to_string(shape.layers) + " layers of 2 heads x 64, " + std::to_string(bt) + "-token blocks, a pool of " +
          std::to_string(shape.pool_tokens) + " tokens per layer; " + std::to_string(shape.rounds + 1) + " chats (a " +
          std::to_string(shape.system_tokens) + "-token system prompt and a " + std::to_string(shape.question_tokens) +
          "-token question), between each two " + std::to_string(shape.pool_tokens / shape.document_tokens) +
          " one-off documents of " + std::to_string(shape.document_tokens) +
          " tokens (10x the pool in all); every request attached, tracked, prefilled, " + std::to_string(shape.decode) +
          " tokens decoded; priorities: chats tracked with the system prompt at 90");
}

}  // namespace ghostlink::bench
