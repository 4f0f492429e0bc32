// Two servers sharing prompt prefixes through Redis: the first prefills
// prompts and its prefix cache writes their blocks through to a
// kv_redis_store; the second, a separate process whose RAM holds nothing,
// attaches the same prompts from Redis with async_attach and checks every
// token it got against a recompute.
//
//   shared_prefix --redis ENDPOINT [--redis ENDPOINT ...] [--cluster] [--prompts N] [--layers N]
//
// ENDPOINT is `unix:PATH` or `HOST:PORT`; with --cluster the endpoints are
// seeds of a Redis Cluster. Run so, the program is the driver: it runs
// itself twice, as two processes one after the other (`--role prefill`,
// then `--role attach`), and fails if either does. The servers are the
// decoder of serving_loop (tiny_llama.hpp, random weights, the same seed in
// both processes).
//
// - prefill: N prompts (a 40-token system prompt each starts with, then
//   10 to 60 tokens of its own) are each prefilled as one step into a
//   sequence; insert_stored_tokens() makes their full blocks entries, each
//   written through to Redis. It fails unless every new entry was stored.
// - attach: a fresh prefix cache on the same Redis (same model id) attaches
//   each prompt but its last token (whose logits a server computes):
//   every full block must come from Redis (store_hit_tokens), but those an
//   earlier prompt of this process already brought into RAM; the token ids
//   must be the prompt's, and every layer's keys and values of every
//   attached token must equal, bit for bit, those of the same tokens
//   prefilled here with no cache. The rest of the prompt and 4 greedy
//   decode steps then run on the attached sequence, each row of logits
//   checked against tiny_llama::recompute (no cache at all).
//
// examples/shared_prefix.sh starts the servers (one on a unix socket, then
// a 3-master cluster) and runs this against each.
#include <ghostlink/kv_cache.hpp>
#include <ghostlink/redis_store.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <future>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tiny_llama.hpp"

extern char** environ;  // NOLINT(readability-redundant-declaration): POSIX declares it nowhere

namespace {

using ghostlink::token_id;

constexpr std::string_view model_id = "tiny_llama/shared_prefix@seed2026";
constexpr std::size_t system_tokens = 40, decode_steps = 4;

struct options {
  std::vector<std::string> endpoints;
  bool cluster = false;
  std::size_t prompts = 6, layers = 4;
  std::string role;  // empty: the driver
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto value = [&] {
      if (i + 1 == argc) throw std::invalid_argument(std::string(a) + " needs a value");
      return std::string(argv[++i]);
    };
    if (a == "--redis") {
      o.endpoints.push_back(value());
    } else if (a == "--cluster") {
      o.cluster = true;
    } else if (a == "--prompts") {
      o.prompts = std::stoul(value());
    } else if (a == "--layers") {
      o.layers = std::stoul(value());
    } else if (a == "--role") {
      o.role = value();
    } else {
      throw std::invalid_argument("unknown argument " + std::string(a));
    }
  }
  if (o.endpoints.empty()) throw std::invalid_argument("give a Redis endpoint: --redis unix:PATH or --redis HOST:PORT");
  if (!o.role.empty() && o.role != "prefill" && o.role != "attach")
    throw std::invalid_argument("--role is prefill or attach");
  return o;
}

ghostlink::kv_redis_endpoint endpoint(const std::string& text) {
  if (text.starts_with("unix:")) return {.unix_socket = text.substr(5)};
  const std::size_t colon = text.rfind(':');
  if (colon == std::string::npos) throw std::invalid_argument("an endpoint is unix:PATH or HOST:PORT: " + text);
  return {.host = text.substr(0, colon), .port = static_cast<std::uint16_t>(std::stoul(text.substr(colon + 1)))};
}

tiny_llama::dims model_dims(const options& o) {
  tiny_llama::dims d;
  d.layers = o.layers;
  return d;
}

ghostlink::kv_cache_config cache_config(const tiny_llama::dims& d) {
  return {.max_tokens_per_seq = 256, .num_heads = d.kv_heads, .head_dim = d.head_dim};
}

/// The same prompts in both processes.
std::vector<std::vector<token_id>> prompts(const options& o, std::size_t vocab) {
  std::mt19937_64 rng(77);
  std::vector<token_id> system(system_tokens);
  for (token_id& t : system) t = static_cast<token_id>(rng() % vocab);
  std::vector<std::vector<token_id>> out;
  for (std::size_t p = 0; p < o.prompts; ++p) {
    out.push_back(system);
    for (std::size_t n = 10 + rng() % 51; n != 0; --n) out.back().push_back(static_cast<token_id>(rng() % vocab));
  }
  return out;
}

/// A process's server: the model, a pool, and a prefix cache on Redis.
struct server {
  explicit server(const options& o)
      : model(model_dims(o)),
        config(cache_config(model.shape())),
        pool(ghostlink::kv_block_pool::for_caches(config)),
        store(std::make_shared<ghostlink::kv_redis_store>(endpoints(o),
                                                          ghostlink::kv_redis_store_options{.cluster = o.cluster})),
        cache(o.layers, config, pool,
              {.model = std::string(model_id),
               .store = store,
               .store_policy = ghostlink::kv_store_policy::write_through}) {}
  ~server() { threads.join(); }
  server(const server&) = delete;
  server& operator=(const server&) = delete;

  static std::vector<ghostlink::kv_redis_endpoint> endpoints(const options& o) {
    std::vector<ghostlink::kv_redis_endpoint> out;
    out.reserve(o.endpoints.size());
    for (const std::string& e : o.endpoints) out.push_back(endpoint(e));
    return out;
  }

  /// `ids` run as one step on `seq` (tiny_llama::forward); the logits.
  std::vector<std::vector<float>> forward(const ghostlink::sequence_kv_cache& seq, std::vector<token_id> ids) {
    return asio::co_spawn(threads, tiny_llama::forward(model, seq, std::move(ids)), asio::use_future).get();
  }

  /// `tokens` attached with async_attach: RAM first, then Redis.
  std::pair<std::error_code, ghostlink::sequence_kv_cache> attach(std::span<const token_id> tokens) {
    std::promise<std::pair<std::error_code, ghostlink::sequence_kv_cache>> done;
    cache.async_attach(threads.get_executor(), tokens, {},
                       [&done](std::error_code ec, ghostlink::sequence_kv_cache seq) {
                         done.set_value({ec, std::move(seq)});
                       });
    return done.get_future().get();
  }

  asio::thread_pool threads{2};
  tiny_llama::model model;
  ghostlink::kv_cache_config config;
  ghostlink::kv_block_pool pool;
  std::shared_ptr<ghostlink::kv_redis_store> store;
  ghostlink::kv_prefix_cache cache;
};

int prefill(const options& o) {
  server s(o);
  std::uint64_t entries = 0;
  for (const std::vector<token_id>& prompt : prompts(o, s.model.shape().vocab)) {
    const ghostlink::sequence_kv_cache seq(s.threads, o.layers, s.config, s.pool);
    s.forward(seq, prompt);
    entries += s.cache.insert_stored_tokens(seq);
  }
  s.cache.async_flush(asio::use_future).get();  // the shutdown path: completes once Redis has every entry
  const ghostlink::kv_store_stats st = s.store->stats();
  std::printf("prefill: %zu prompts, %llu new entries, %llu stored in Redis, %llu write errors, %llu dropped\n",
              o.prompts, static_cast<unsigned long long>(entries), static_cast<unsigned long long>(st.stored),
              static_cast<unsigned long long>(st.write_errors), static_cast<unsigned long long>(st.dropped));
  return st.stored == entries && entries != 0 ? 0 : 1;
}

/// The first difference between layer `l` of `got` and `expected` over
/// their first `n` tokens, bit for bit; empty if none.
std::string differ(const ghostlink::sequence_snapshot& got, const ghostlink::sequence_snapshot& expected, std::size_t l,
                   std::size_t n) {
  const std::size_t width = got.layer(l).token_width();
  std::vector<float> gk(n * width), gv(n * width), ek(n * width), ev(n * width);
  if (got.layer(l).read_range(0, n, gk, gv) || expected.layer(l).read_range(0, n, ek, ev)) return "a read failed";
  for (std::size_t i = 0; i < gk.size(); ++i)
    if (std::bit_cast<std::uint32_t>(gk[i]) != std::bit_cast<std::uint32_t>(ek[i]) ||
        std::bit_cast<std::uint32_t>(gv[i]) != std::bit_cast<std::uint32_t>(ev[i]))
      return "layer " + std::to_string(l) + ", token " + std::to_string(i / width);
  return {};
}

int attach(const options& o) {
  server s(o);
  std::size_t failures = 0, attached_tokens = 0;
  double worst = 0;
  for (const std::vector<token_id>& prompt : prompts(o, s.model.shape().vocab)) {
    const std::span<const token_id> head = std::span(prompt).first(prompt.size() - 1);
    const std::uint64_t hits_before = s.cache.stats().store_hit_tokens;
    const std::size_t in_ram = s.cache.match(head);  // blocks an earlier prompt already brought from Redis
    auto [ec, seq] = s.attach(head);
    const std::size_t expected = head.size() / s.config.block_tokens * s.config.block_tokens;
    const std::size_t from_store = s.cache.stats().store_hit_tokens - hits_before;
    const std::vector<token_id> ids = seq.valid() ? seq.snapshot().token_ids() : std::vector<token_id>{};
    const bool ids_ok = ids.size() == expected && std::equal(ids.begin(), ids.end(), prompt.begin());
    if (ec || seq.size() != expected || !ids_ok) {
      std::printf("attach: %s, %zu tokens attached of %zu expected, ids %s\n", ec ? ec.message().c_str() : "ok",
                  seq.valid() ? seq.size() : 0, expected, ids_ok ? "right" : "wrong");
      ++failures;
      continue;
    }
    attached_tokens += expected;
    // Every attached token, every layer, against the same tokens computed here.
    const ghostlink::sequence_kv_cache fresh(s.threads, o.layers, s.config, s.pool);
    s.forward(fresh, std::vector<token_id>(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(expected)));
    for (std::size_t l = 0; l < o.layers; ++l)
      if (const std::string d = differ(seq.snapshot(), fresh.snapshot(), l, expected); !d.empty()) {
        std::printf("attach: an attached token differs from its recompute: %s\n", d.c_str());
        ++failures;
      }
    if (from_store != expected - in_ram) {
      std::printf("attach: %zu of the %zu attached tokens came from Redis, %zu from RAM\n", from_store, expected,
                  in_ram);
      ++failures;
    }
    // The attached sequence serves: the prompt's rest, then greedy decoding.
    std::vector<token_id> tokens = prompt;
    std::vector<std::vector<float>> rows =
        s.forward(seq, std::vector<token_id>(prompt.begin() + static_cast<std::ptrdiff_t>(expected), prompt.end()));
    for (std::size_t step = 0; step < decode_steps; ++step) {
      tokens.push_back(tiny_llama::greedy(rows.back()));
      rows.push_back(s.forward(seq, {tokens.back()}).front());
    }
    tokens.pop_back();  // the last row's input is its own; recompute up to it
    const std::vector<std::vector<float>> want = tiny_llama::recompute(s.model, tokens, expected);
    for (std::size_t r = 0; r < want.size(); ++r)
      if (tiny_llama::logits_differ(want[r], rows[r], worst)) ++failures;
  }
  std::printf("attach: %zu prompts, %zu tokens attached and checked bit for bit, logits within %.2g of "
              "the recompute, %zu failures\n",
              o.prompts, attached_tokens, worst, failures);
  return failures == 0 && attached_tokens != 0 ? 0 : 1;
}

/// Runs this program with `--role role` and the driver's own arguments.
int run_role(int argc, char** argv, const char* role) {
  std::vector<char*> args(argv, argv + argc);
  std::string flag = "--role", name = role;
  args.push_back(flag.data());
  args.push_back(name.data());
  args.push_back(nullptr);
  pid_t pid = 0;
  if (::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, args.data(), environ) != 0) return 1;
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return 1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse(argc, argv);
    if (o.role == "prefill") return prefill(o);
    if (o.role == "attach") return attach(o);
    if (const int failed = run_role(argc, argv, "prefill")) return failed;
    const int result = run_role(argc, argv, "attach");
    std::printf("shared_prefix: %s\n", result == 0 ? "the second process attached every prefix exactly" : "FAILED");
    return result;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shared_prefix: %s\n", e.what());
    return 2;
  }
}
