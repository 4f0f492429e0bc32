// Chat serving with a prefix cache: the decoder of serving_loop
// (tiny_llama.hpp, a small Llama-style model with random weights) serves
// multi-turn conversations that share a few system prompts, on one
// kv_block_pool whose budget is too small to keep everything, with a
// kv_prefix_cache reusing the KV of prompt prefixes across requests.
//
// Conversation c starts from system prompt c % 3 (48, 56 or 64 tokens) and
// a user message; the prompt of its turn k + 1 is the prompt of turn k, the
// reply generated for it and the next user message. Each request:
//
//   - attach(ex, prompt.first(size - 1)): a sequence holding the longest
//     cached run of the prompt's full blocks, shared copy-on-write (the last
//     prompt token is always computed, so its logits are there to sample);
//     its token ids must be the prompt's;
//   - admission: reserve() the blocks the rest of the request will write
//     (evicting idle cached entries, the lowest retention priority first,
//     least recently used among equals), as a scheduler admits a request
//     only when its blocks can be had;
//   - prefill of the uncached tokens as one causal step, then a few decode
//     steps (tiny_llama::forward: ghostlink::attend over the sequence);
//   - insert_stored_tokens(seq, "", keep): its full blocks become entries,
//     for the next turn and for other conversations on the same system
//     prompt, whose blocks `keep` holds at priority 90 (the rest at 35).
//
// `--in-flight` coroutines (lanes) on a `--threads` asio::thread_pool serve
// the requests: lane w takes conversations w, w + in_flight, ... turn by
// turn, so each conversation's next turn comes after other conversations'
// requests have pushed its blocks down the LRU order. A router-style mirror
// follows the cache through its events (stored / removed), and must agree
// with it at the end.
//
// Every logit row a request computed (each uncached prompt position and
// each decode step) is checked against a recompute of the conversation
// that uses no cache (tiny_llama::recompute); any mismatch, an attached or
// final sequence whose token ids are not the request's, counters or events
// that disagree with the cache, or no eviction when the budget cannot hold
// every prefix (as the default's cannot), fails the program (exit 1).
//
// With `--window W`, the model is hybrid: kv_model_layout::interleaved(layers,
// 2, W), every other layer attending a window of W tokens (as gpt-oss). The
// prefix cache is of that layout: each request's sequence is tracked
// (cache.track), so its blocks are cached as they fill, before its windowed
// layers drop them; an attach gives the windowed layers only the blocks of
// their windows at the match, and every logit is checked against a
// recompute under the same masks. The router's mirror hears no event when
// a windowed layer's blocks are evicted with the entry staying, so it may
// match longer than the cache, never shorter.
//
// With `--disk 1`, the cache has a disk tier below RAM: a kv_file_store in
// a temporary directory, written back (kv_store_policy::write_back: an
// entry goes to disk when RAM evicts it). At shutdown the server awaits
// cache.async_flush(), which stores what RAM still holds and completes once
// the disk has it; then a restarted server (a new pool, cache and store on
// the same directory, its RAM empty) must attach every full block of every
// conversation's last turn from disk, or the program fails.
//
//   prefix_reuse [--requests N] [--turns N] [--in-flight N] [--decode N] [--layers N] [--threads N] [--blocks N]
//                [--disk 1 | --window W]
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/this_coro.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "tiny_llama.hpp"

namespace {

using ghostlink::token_id;
using clock_type = std::chrono::steady_clock;

constexpr std::size_t system_prompts = 3;
constexpr std::size_t block_tokens = ghostlink::kv_cache_config{}.block_tokens;  // 16

struct options {
  std::size_t requests = 48, turns = 4, in_flight = 4, decode = 8, layers = 8, threads = 2;
  std::size_t blocks = 0;  // the pool's budget; 0: from the trace, small enough to evict
  bool disk = false;       // a write-back kv_file_store below RAM, and a restart from it
  std::size_t window = 0;  // every other layer windowed; 0: every layer full
  std::size_t conversations() const { return (requests + turns - 1) / turns; }
  ghostlink::kv_model_layout layout() const {
    return window ? ghostlink::kv_model_layout::interleaved(layers, 2, window)
                  : ghostlink::kv_model_layout::full(layers);
  }
};

std::size_t blocks_for(std::size_t tokens) { return (tokens + block_tokens - 1) / block_tokens; }

/// One request: a turn of a conversation.
struct turn_record {
  std::size_t prompt = 0;         // its prompt's tokens
  std::size_t attached = 0;       // of those, attached from the cache
  std::size_t inserted = 0;       // entries its insert added
  std::vector<token_id> tokens;   // what its sequence held at the end: the prompt and the reply
  std::vector<std::vector<float>> logits;  // rows at positions attached, attached + 1, ..., tokens.size() - 1
  bool attached_ids_ok = false, final_ids_ok = false;
};

/// A conversation: its system prompt, the user messages of its turns, and
/// the requests served so far.
struct conversation {
  std::size_t system = 0;
  std::vector<std::vector<token_id>> user;
  std::vector<turn_record> turns;
};

/// The same trace every run: system prompts of 48, 56 and 64 tokens, and
/// user messages of 12 to 24 tokens.
struct trace {
  std::vector<std::vector<token_id>> systems;
  std::vector<conversation> conversations;

  trace(const options& o, std::size_t vocab) {
    for (std::size_t s = 0; s < system_prompts; ++s) {
      std::mt19937_64 rng(500 + s);
      systems.emplace_back(48 + 8 * s);
      for (token_id& t : systems.back()) t = static_cast<token_id>(rng() % vocab);
    }
    for (std::size_t c = 0; c < o.conversations(); ++c) {
      std::mt19937_64 rng(1000 + c);
      conversation conv;
      conv.system = c % system_prompts;
      for (std::size_t k = 0; k < o.turns; ++k) {
        conv.user.emplace_back(12 + rng() % 13);
        for (token_id& t : conv.user.back()) t = static_cast<token_id>(rng() % vocab);
      }
      conversations.push_back(std::move(conv));
    }
  }

  /// Whether turn `k` of conversation `c` is one of the `--requests`
  /// (requests are numbered turn by turn: k * conversations + c).
  static bool served(const options& o, std::size_t c, std::size_t k) { return k * o.conversations() + c < o.requests; }

  /// The tokens conversation `c` holds after its last served turn (known
  /// before it is served: each reply is `decode` tokens).
  std::size_t final_length(const options& o, std::size_t c) const {
    std::size_t n = systems[conversations[c].system].size();
    for (std::size_t k = 0; k < o.turns && served(o, c, k); ++k) n += conversations[c].user[k].size() + o.decode;
    return n;
  }
};

/// What a cache-aware router knows: the cached block hashes, mirrored from
/// the prefix cache's events, with any event that contradicts the
/// contract counted (a gap in the sequence numbers, a stored entry whose
/// parent is not cached, a removed one that is unknown or has a cached child).
class router_mirror {
 public:
  ghostlink::kv_prefix_event_handler handler() {
    return [this](const ghostlink::kv_prefix_event& e) { on_event(e); };
  }

  /// The tokens of the longest run of `hashes` from block 0 it knows cached.
  std::size_t match(const std::vector<ghostlink::kv_block_hash>& hashes) {
    std::lock_guard lock(mutex_);
    std::size_t n = 0;
    while (n < hashes.size() && entries_.contains(hashes[n])) ++n;
    return n * block_tokens;
  }
  std::size_t size() {
    std::lock_guard lock(mutex_);
    return entries_.size();
  }
  std::size_t violations() {
    std::lock_guard lock(mutex_);
    return violations_;
  }
  std::uint64_t stored() {
    std::lock_guard lock(mutex_);
    return stored_;
  }
  std::uint64_t removed() {
    std::lock_guard lock(mutex_);
    return removed_;
  }

 private:
  struct entry {
    std::optional<ghostlink::kv_block_hash> parent;
    std::size_t children = 0;
  };

  void on_event(const ghostlink::kv_prefix_event& e) {
    using kind = ghostlink::kv_prefix_event::kind;
    std::lock_guard lock(mutex_);
    violations_ += e.sequence != ++sequence_;
    // This router routes on RAM: the store tier's events (the disk's
    // entries, with --disk) are another mirror's.
    if (e.what != kind::cleared && e.tier != ghostlink::kv_prefix_tier::ram) return;
    switch (e.what) {
      case kind::stored: {
        ++stored_;
        auto parent = e.parent ? entries_.find(*e.parent) : entries_.end();
        if (e.parent && parent == entries_.end()) ++violations_;
        if (!entries_.emplace(e.hash, entry{e.parent, 0}).second) ++violations_;
        if (parent != entries_.end()) ++parent->second.children;
        break;
      }
      case kind::removed: {
        ++removed_;
        auto it = entries_.find(e.hash);
        if (it == entries_.end() || it->second.children != 0) {
          ++violations_;
          if (it == entries_.end()) break;
        }
        const std::optional<ghostlink::kv_block_hash> parent = it->second.parent;
        entries_.erase(it);
        if (parent) {
          const auto p = entries_.find(*parent);
          if (p != entries_.end()) --p->second.children;
        }
        break;
      }
      case kind::cleared: entries_.clear(); break;
    }
  }

  std::mutex mutex_;
  std::map<ghostlink::kv_block_hash, entry> entries_;
  std::uint64_t sequence_ = 0, stored_ = 0, removed_ = 0;
  std::size_t violations_ = 0;
};

/// Blocks held by the requests in flight, sampled at each admission: with
/// reuse (the pool's blocks in use, less the idle cached ones: what live
/// requests attached, wrote and reserved), and without (each live request's
/// own blocks for all its tokens, reserved whole at admission).
class ledger {
 public:
  explicit ledger(ghostlink::kv_block_pool pool) : pool_(std::move(pool)) {}

  void admit(std::size_t own_blocks) {
    std::lock_guard lock(mutex_);
    no_reuse_ += own_blocks;
    peak_no_reuse_ = std::max(peak_no_reuse_, no_reuse_);
    const ghostlink::kv_pool_stats s = pool_.stats();
    peak_live_ = std::max(peak_live_, s.blocks_in_use - std::min(s.blocks_in_use, s.blocks_cached_idle));
  }
  void finish(std::size_t own_blocks) {
    std::lock_guard lock(mutex_);
    no_reuse_ -= own_blocks;
  }
  std::size_t peak_live() {
    std::lock_guard lock(mutex_);
    return peak_live_;
  }
  std::size_t peak_no_reuse() {
    std::lock_guard lock(mutex_);
    return peak_no_reuse_;
  }

 private:
  ghostlink::kv_block_pool pool_;
  std::mutex mutex_;
  std::size_t no_reuse_ = 0, peak_no_reuse_ = 0, peak_live_ = 0;
};

struct server {
  const options& o;
  const tiny_llama::model& model;
  trace& work;
  ghostlink::kv_block_pool& pool;
  ghostlink::kv_prefix_cache& cache;
  ledger& blocks;
};

/// Serves turn `k` of conversation `c`: attach, admit, prefill the rest,
/// decode, insert.
asio::awaitable<void> serve_turn(server& srv, std::size_t c, std::size_t k) {
  conversation& conv = srv.work.conversations[c];
  std::vector<token_id> prompt = k == 0 ? srv.work.systems[conv.system] : conv.turns[k - 1].tokens;
  prompt.insert(prompt.end(), conv.user[k].begin(), conv.user[k].end());
  turn_record r;
  r.prompt = prompt.size();

  // The cached blocks of the prompt but its last token.
  const auto ex = co_await asio::this_coro::executor;
  ghostlink::sequence_kv_cache seq = srv.cache.attach(ex, std::span<const token_id>(prompt).first(prompt.size() - 1));
  r.attached = seq.size();
  // The system prompt every conversation on it shares stays cached at
  // priority 90 through other conversations' turns; the rest of the
  // conversation at the default 35.
  const ghostlink::kv_retention keep{
      .ranges = {{.first = 0, .last = srv.work.systems[conv.system].size(), .priority = 90}}};
  // A hybrid model's blocks are cached as they fill: the windowed layers
  // drop theirs as the request goes on.
  if (srv.o.window) srv.cache.track(seq, "", keep);
  const std::vector<token_id> attached_ids = seq.snapshot().token_ids();
  r.attached_ids_ok =
      attached_ids.size() == r.attached && std::equal(attached_ids.begin(), attached_ids.end(), prompt.begin());

  // Admission: every block the request will write, at once.
  const std::size_t length = prompt.size() + srv.o.decode;
  const std::size_t own = srv.o.layers * blocks_for(length);
  const std::size_t need = own - srv.o.layers * (r.attached / block_tokens);
  std::error_code ec;
  ghostlink::kv_block_reservation reservation = srv.pool.reserve(need, ec);
  if (ec)
    throw std::runtime_error("conversation " + std::to_string(c) + " turn " + std::to_string(k) + ": reserving " +
                             std::to_string(need) + " blocks (" + std::to_string(srv.pool.blocks_available()) +
                             " available): " + ec.message());
  seq.use_reservation(std::move(reservation));
  srv.blocks.admit(own);

  // The prefill: the uncached prompt tokens, one causal step.
  r.logits = co_await tiny_llama::forward(
      srv.model, seq, std::vector<token_id>(prompt.begin() + static_cast<std::ptrdiff_t>(r.attached), prompt.end()));
  r.tokens = std::move(prompt);
  std::mt19937_64 rng(c * 100 + k);
  for (std::size_t i = 0; i < srv.o.decode; ++i) {
    const token_id next = tiny_llama::sample(r.logits.back(), rng);
    auto rows = co_await tiny_llama::forward(srv.model, seq, std::vector<token_id>(1, next));
    r.tokens.push_back(next);
    r.logits.push_back(std::move(rows[0]));
  }
  r.final_ids_ok = seq.size() == r.tokens.size() && seq.snapshot().token_ids() == r.tokens;

  // Its full blocks become entries: the prompt's and the reply's (tracked:
  // they are already).
  r.inserted = srv.o.window ? 0 : srv.cache.insert_stored_tokens(seq, "", keep);
  seq = {};  // the blocks are the cache's alone now (idle once the layers let go)
  srv.blocks.finish(own);
  conv.turns.push_back(std::move(r));
}

/// Lane `w`: conversations w, w + in_flight, ..., turn by turn.
asio::awaitable<void> lane(server& srv, std::size_t w) {
  for (std::size_t k = 0; k < srv.o.turns; ++k)
    for (std::size_t c = w; c < srv.o.conversations(); c += srv.o.in_flight)
      if (trace::served(srv.o, c, k)) co_await serve_turn(srv, c, k);
}

/// The rows of conversation `conv` that differ from its cacheless
/// recompute, the largest difference, and the rows checked.
struct verdict {
  std::size_t bad = 0, rows = 0;
  double worst = 0;
};

verdict check(const tiny_llama::model& m, const ghostlink::kv_model_layout& layout, const conversation& conv) {
  verdict v;
  if (conv.turns.empty()) return v;
  // Every turn's tokens are a prefix of the last turn's: one recompute
  // serves them all (position p's logits depend on tokens 0..p only).
  const std::vector<token_id>& all = conv.turns.back().tokens;
  const auto expected = tiny_llama::recompute(m, all, 0, layout);
  for (const turn_record& r : conv.turns) {
    const bool prefix = r.tokens.size() <= all.size() && std::equal(r.tokens.begin(), r.tokens.end(), all.begin());
    if (!prefix || r.logits.size() != r.tokens.size() - r.attached) {
      ++v.bad;
      continue;
    }
    for (std::size_t i = 0; i < r.logits.size(); ++i)
      v.bad += tiny_llama::logits_differ(expected[r.attached + i], r.logits[i], v.worst);
    v.rows += r.logits.size();
  }
  return v;
}

options parse(int argc, char** argv, bool& budget_given) {
  options o;
  budget_given = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument("missing value for " + flag);
    const std::size_t value = std::strtoull(argv[i + 1], nullptr, 10);
    if (value == 0) throw std::invalid_argument("values must be positive: " + flag);
    if (flag == "--requests")
      o.requests = value;
    else if (flag == "--turns")
      o.turns = value;
    else if (flag == "--in-flight")
      o.in_flight = value;
    else if (flag == "--decode")
      o.decode = value;
    else if (flag == "--layers")
      o.layers = value;
    else if (flag == "--threads")
      o.threads = value;
    else if (flag == "--disk")
      o.disk = true;
    else if (flag == "--window")
      o.window = value;
    else if (flag == "--blocks") {
      o.blocks = value;
      budget_given = true;
    } else
      throw std::invalid_argument("unknown flag " + flag);
  }
  // A write-back stores an entry as it leaves RAM whole, not a windowed
  // layer's blocks evicted alone: a restart would not find every window.
  if (o.disk && o.window) throw std::invalid_argument("--disk and --window are not served together");
  return o;
}

std::string describe(const ghostlink::kv_model_layout& layout) {
  std::ostringstream os;
  os << layout;
  return os.str();
}

double percent(std::uint64_t part, std::uint64_t whole) { return whole ? 100.0 * double(part) / double(whole) : 0; }

/// A new directory for the disk tier, removed with it.
struct scratch_dir {
  std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("ghostlink-prefix_reuse-" + std::to_string(std::random_device{}()));
  scratch_dir() { std::filesystem::create_directories(path); }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  ~scratch_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

/// A restarted server: a new pool, cache and store on `dir`, its RAM
/// empty, attaches each conversation's last turn. The conversations whose
/// every full block did not come from disk.
std::size_t restart_misses(const options& o, const ghostlink::kv_cache_config& config, const trace& work,
                           const std::filesystem::path& dir) {
  asio::thread_pool threads(o.threads);
  auto disk = std::make_shared<ghostlink::kv_file_store>(dir);
  ghostlink::kv_block_pool pool = ghostlink::kv_block_pool::for_caches(config, {.max_blocks = o.blocks});
  ghostlink::kv_prefix_cache cache(
      o.layers, config, pool,
      {.model = "tiny-llama-2026", .store = disk, .store_policy = ghostlink::kv_store_policy::write_back});
  std::size_t misses = 0;
  for (const conversation& conv : work.conversations) {
    if (conv.turns.empty()) continue;
    const std::vector<token_id>& t = conv.turns.back().tokens;
    const ghostlink::sequence_kv_cache seq = cache.async_attach(threads.get_executor(), t, {}, asio::use_future).get();
    const std::size_t full = std::min(t.size(), config.max_tokens_per_seq) / block_tokens * block_tokens;
    misses += seq.size() != full || seq.snapshot().token_ids() !=
                                        std::vector<token_id>(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(full));
  }
  const std::uint64_t from_disk = cache.stats().store_hit_tokens;
  std::printf("  restart:     %llu tokens attached from disk by a restarted server (its RAM empty); %zu "
              "conversations short\n",
              static_cast<unsigned long long>(from_disk), misses);
  return misses;
}

}  // namespace

int main(int argc, char** argv) try {
  bool budget_given = false;
  options o = parse(argc, argv, budget_given);
  tiny_llama::dims dims;
  dims.layers = o.layers;
  const tiny_llama::model model(dims);
  trace work(o, dims.vocab);

  // The budget. Admission needs room for the requests in flight, each
  // reserving at most `largest` blocks (what it attaches included), and a
  // little slack (an idle entry whose child a live request holds cannot be
  // evicted). Keeping every prefix the trace computes would take `distinct`
  // blocks: each conversation's full blocks, its system prompt's counted
  // once. The default budget is three quarters of that; below it, the cache
  // cannot hold every entry it is given, so evicting none is a failure.
  std::size_t longest = 0, distinct = 0;
  std::vector<bool> system_used(system_prompts, false);
  for (std::size_t c = 0; c < work.conversations.size(); ++c) {
    const std::size_t system = work.conversations[c].system;
    longest = std::max(longest, work.final_length(o, c));
    distinct += work.final_length(o, c) / block_tokens - work.systems[system].size() / block_tokens;
    system_used[system] = true;
  }
  for (std::size_t s = 0; s < system_prompts; ++s)
    if (system_used[s]) distinct += work.systems[s].size() / block_tokens;
  distinct *= o.layers;
  const std::size_t largest = o.layers * blocks_for(longest);
  const std::size_t admission = std::min(o.in_flight, o.conversations()) * largest + 2 * o.layers;
  if (!budget_given) o.blocks = std::max(admission, distinct * 3 / 4);
  if (o.blocks < admission)
    throw std::invalid_argument("--blocks " + std::to_string(o.blocks) + " cannot admit " +
                                std::to_string(o.in_flight) + " requests of up to " + std::to_string(largest) +
                                " blocks: " + std::to_string(admission) + " at least");
  const bool must_evict = o.blocks < distinct;

  const ghostlink::kv_cache_config config{
      .max_tokens_per_seq = longest, .num_heads = dims.kv_heads, .head_dim = dims.head_dim};
  router_mirror mirror;
  std::optional<scratch_dir> disk_dir;
  std::shared_ptr<ghostlink::kv_file_store> disk;
  if (o.disk) {
    disk_dir.emplace();
    disk = std::make_shared<ghostlink::kv_file_store>(disk_dir->path);
  }
  asio::thread_pool threads(o.threads);
  ghostlink::kv_block_pool pool = ghostlink::kv_block_pool::for_caches(config, {.max_blocks = o.blocks});
  ghostlink::kv_prefix_cache cache(
      o.layout(), config, pool,
      {.model = "tiny-llama-2026", .store = disk, .store_policy = ghostlink::kv_store_policy::write_back});
  cache.set_event_handler(mirror.handler());
  ledger blocks(pool);
  server srv{o, model, work, pool, cache, blocks};
  const ghostlink::kv_model_layout layout = o.layout();

  const auto start = clock_type::now();
  std::vector<std::future<void>> lanes;
  for (std::size_t w = 0; w < std::min(o.in_flight, o.conversations()); ++w)
    lanes.push_back(asio::co_spawn(threads, lane(srv, w), asio::use_future));
  std::exception_ptr failure;  // every lane done before any error leaves main
  for (auto& l : lanes) try {
      l.get();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  if (failure) std::rethrow_exception(failure);
  const double serving = std::chrono::duration<double>(clock_type::now() - start).count();
  const ghostlink::kv_prefix_stats stats = cache.stats();
  const ghostlink::kv_pool_stats pool_stats = pool.stats();

  // The checks, one conversation per task on the same threads.
  const auto check_start = clock_type::now();
  std::vector<std::future<verdict>> checks;
  checks.reserve(work.conversations.size());
  for (const conversation& conv : work.conversations)
    checks.push_back(asio::co_spawn(
        threads, [&model, &layout, &conv]() -> asio::awaitable<verdict> { co_return check(model, layout, conv); },
        asio::use_future));
  verdict total;
  for (std::size_t c = 0; c < checks.size(); ++c) {
    const verdict v = checks[c].get();
    if (v.bad) std::fprintf(stderr, "prefix_reuse: conversation %zu: %zu rows differ from the recompute\n", c, v.bad);
    total.bad += v.bad;
    total.rows += v.rows;
    total.worst = std::max(total.worst, v.worst);
  }
  const double checking = std::chrono::duration<double>(clock_type::now() - check_start).count();

  std::size_t prompt_tokens = 0, attached = 0, decoded = 0, served = 0, ids_bad = 0, inserted = 0;
  for (const conversation& conv : work.conversations)
    for (const turn_record& r : conv.turns) {
      ++served;
      prompt_tokens += r.prompt;
      attached += r.attached;
      decoded += o.decode;
      inserted += r.inserted;
      ids_bad += !r.attached_ids_ok + !r.final_ids_ok;
    }
  if (ids_bad) std::fprintf(stderr, "prefix_reuse: %zu sequences hold token ids that are not the request's\n", ids_bad);

  // The counters, and the router's mirror, against the cache, now that
  // every request is done.
  // (Tracked, the entries are counted by the cache alone.)
  std::size_t router_disagrees = (!o.window && inserted != stats.inserted_blocks) || stats.queries != served ||
                                 mirror.size() != stats.cached_blocks || mirror.stored() != stats.inserted_blocks ||
                                 mirror.removed() != stats.evicted_blocks;
  for (const conversation& conv : work.conversations)
    if (!conv.turns.empty()) {
      const auto& t = conv.turns.back().tokens;
      const std::size_t mirrored = mirror.match(cache.block_hashes(t)), cached = cache.match(t);
      router_disagrees += o.window ? mirrored < cached : mirrored != cached;
    }
  router_disagrees += mirror.violations();
  if (router_disagrees)
    std::fprintf(stderr, "prefix_reuse: the counters or the event mirror disagree with the cache\n");

  // The shutdown: what RAM holds goes to disk, and the flush completes
  // once the disk has it, so a restarted server finds it there.
  if (disk) {
    asio::co_spawn(
        threads, [&cache]() -> asio::awaitable<void> { co_await cache.async_flush(asio::use_awaitable); },
        asio::use_future)
        .get();
  }

  // Once every sequence is gone (the threads joined: no layer holds a
  // block any more), clearing the cache gives every block back.
  threads.join();
  cache.clear();
  const std::size_t leaked = pool.stats().blocks_in_use;
  if (leaked) std::fprintf(stderr, "prefix_reuse: %zu blocks in use after clear() with no sequence alive\n", leaked);
  const bool eviction_missing = must_evict && stats.evicted_blocks + stats.window_evictions == 0;
  if (eviction_missing)
    std::fprintf(stderr, "prefix_reuse: nothing was evicted, yet %zu blocks cannot hold the %zu of every prefix\n",
                 o.blocks, distinct);

  const std::size_t computed = prompt_tokens - attached + decoded;
  std::printf(
      "prefix_reuse: %zu requests (%zu conversation%s of up to %zu turns on %zu system prompts of 48-64 tokens, "
      "%zu-token replies), %zu-layer model, %zu in flight, %zu threads\n",
      served, o.conversations(), o.conversations() == 1 ? "" : "s", o.turns, system_prompts, o.decode, o.layers,
      o.in_flight, o.threads);
  std::printf("  pool:        %zu blocks of %zu tokens (%zu per layer); keeping every prefix would take %zu\n",
              o.blocks, block_tokens, o.blocks / o.layers, distinct);
  std::printf("  hit rate:    %.1f%% (hit_tokens %llu / query_tokens %llu over %llu queries)\n",
              percent(stats.hit_tokens, stats.query_tokens), static_cast<unsigned long long>(stats.hit_tokens),
              static_cast<unsigned long long>(stats.query_tokens), static_cast<unsigned long long>(stats.queries));
  std::printf("  prompts:     %zu tokens: %zu reused (attached, %.1f%%), %zu computed; %zu decoded\n", prompt_tokens,
              attached, percent(attached, prompt_tokens), prompt_tokens - attached, decoded);
  std::printf("  compute:     %zu tokens through the model, against %zu without reuse (%.2fx)\n", computed,
              prompt_tokens + decoded, double(prompt_tokens + decoded) / double(computed));
  std::printf("  blocks:      live requests held at most %zu at once (attached + reserved), against %zu without reuse\n"
              "               (the sum of the concurrently live requests' own blocks, each reserved whole at "
              "admission);\n"
              "               the pool peaked at %zu of %zu (idle cached entries fill what the requests leave)\n",
              blocks.peak_live(), blocks.peak_no_reuse(), pool_stats.peak_blocks_in_use, o.blocks);
  std::printf("  evictions:   %llu entries and %llu windowed parts of %llu inserted, %s; %zu cached at the end "
              "(%zu blocks)\n",
              static_cast<unsigned long long>(stats.evicted_blocks),
              static_cast<unsigned long long>(stats.window_evictions),
              static_cast<unsigned long long>(stats.inserted_blocks),
              must_evict ? "required (the pool cannot hold every prefix)" : "none required", stats.cached_blocks,
              pool_stats.blocks_cached);
  if (o.window) std::printf("  layout:      %s\n", describe(layout).c_str());
  std::printf("  events:      %llu stored, %llu removed: the router's mirror %s the cache\n",
              static_cast<unsigned long long>(mirror.stored()), static_cast<unsigned long long>(mirror.removed()),
              router_disagrees ? "DISAGREES with" : "matches");
  std::printf("  time:        %.3f s serving (%.0f tokens/s computed), %.3f s checking\n", serving,
              double(computed) / serving, checking);
  std::printf("  recompute:   %s (max abs logit diff %.2e over %zu rows: every position every request computed); "
              "token ids %s\n",
              total.bad ? "MISMATCH" : "match", total.worst, total.rows, ids_bad ? "MISMATCH" : "match");
  const std::size_t restart_short = disk && disk_dir ? restart_misses(o, config, work, disk_dir->path) : 0;
  const bool failed = total.bad || ids_bad || router_disagrees || leaked || eviction_missing || restart_short;
  return failed ? 1 : 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "prefix_reuse: %s\n", e.what());
  return 2;
}
