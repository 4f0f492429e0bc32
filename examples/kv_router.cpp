// A KV-aware router over three servers, each a process with the decoder of
// serving_loop (tiny_llama.hpp), a prefix cache and a kv_event_publisher
// (docs/API.md, "KV events on the wire"), all on ipc:// sockets in a
// temporary directory.
//
// The router starts the servers (this program with --serve), talks to each
// over its standard input and output (one request per line), and follows
// each server's prefix cache through its events (kv_mirror.hpp): it joins
// late, after a first round of requests has been served round robin, from
// each server's dump and the batches after it. Then it sends each request
// of a multi-turn chat workload (conversations on a few shared system
// prompts; each turn's prompt is the previous turn's tokens and a new user
// message) to the server whose mirror holds the longest prefix of its
// prompt, breaking ties by the requests in flight there, then by those
// served. The same workload then runs on fresh servers round robin. The
// requests arrive turn by turn, the conversations in a shuffled order.
//
// Each server attaches a request's cached prefix, prefills the rest,
// decodes greedily and inserts what it computed; every logit row it
// computed is checked against a recompute of the whole sequence without a
// cache. The router prints the hit rate and the prefill tokens saved under
// both policies, and fails (exit 1) if any logit differs, if a mirror ends
// unlike its server's cache, or if KV-aware routing does not beat round
// robin. Every server is stopped by its process id, also on failure.
//
//   kv_router [--servers N] [--conversations N] [--turns N] [--decode N] [--layers N] [--in-flight N]
#include <ghostlink/event_publisher.hpp>
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/this_coro.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_future.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <random>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kv_mirror.hpp"
#include "tiny_llama.hpp"

namespace {

using ghostlink::token_id;

constexpr std::size_t system_prompts = 3;
constexpr const char* model_name = "tiny-llama-2026";

struct options {
  std::size_t servers = 3, conversations = 12, turns = 4, decode = 4, layers = 4, in_flight = 2;
  std::size_t max_tokens() const { return 80 + turns * (24 + decode) + 16; }
};

ghostlink::kv_cache_config cache_config(const options& o, const tiny_llama::dims& d) {
  return {.max_tokens_per_seq = o.max_tokens(), .num_heads = d.kv_heads, .head_dim = d.head_dim};
}

tiny_llama::dims model_dims(const options& o) {
  tiny_llama::dims d;
  d.layers = o.layers;
  return d;
}

// ---------------------------------------------------------------- server

/// Serves one request: attach the cached prefix of the prompt (its last
/// token always computed), prefill the rest, decode greedily, check every
/// computed row against the recompute, insert. The reply line.
asio::awaitable<std::string> serve_request(const tiny_llama::model& model, ghostlink::kv_prefix_cache& cache,
                                           std::uint64_t id, std::size_t decode, std::vector<token_id> prompt) {
  const auto ex = co_await asio::this_coro::executor;
  ghostlink::sequence_kv_cache seq = cache.attach(ex, std::span<const token_id>(prompt).first(prompt.size() - 1));
  const std::size_t attached = seq.size();
  auto logits = co_await tiny_llama::forward(
      model, seq, std::vector<token_id>(prompt.begin() + static_cast<std::ptrdiff_t>(attached), prompt.end()));
  std::vector<token_id> tokens = std::move(prompt);
  for (std::size_t i = 0; i < decode; ++i) {
    const token_id next = tiny_llama::greedy(logits.back());
    auto rows = co_await tiny_llama::forward(model, seq, std::vector<token_id>(1, next));
    tokens.push_back(next);
    logits.push_back(std::move(rows[0]));
  }
  const auto expected = tiny_llama::recompute(model, tokens, 0, cache.layout());
  std::size_t bad = 0;
  double worst = 0;
  for (std::size_t i = 0; i < logits.size(); ++i)
    bad += tiny_llama::logits_differ(expected[attached + i], logits[i], worst);
  cache.insert_stored_tokens(seq);
  std::ostringstream out;
  out << "done " << id << ' ' << attached << ' ' << logits.size() << ' ' << (bad == 0 ? 1 : 0);
  for (std::size_t i = tokens.size() - decode; i < tokens.size(); ++i) out << ' ' << tokens[i];
  co_return out.str();
}

/// A server process: reads `req ID DECODE N T1 .. TN`, `entries` and
/// `quit` from its standard input, one per line, and answers each on its
/// standard output.
int serve(const options& o, const std::string& pub, const std::string& replay) {
  const tiny_llama::dims dims = model_dims(o);
  const tiny_llama::model model(dims);
  const ghostlink::kv_cache_config config = cache_config(o, dims);
  ghostlink::kv_block_pool pool = ghostlink::kv_block_pool::for_caches(config, {.max_blocks = 4'096});
  ghostlink::kv_prefix_cache cache(o.layers, config, pool, {.model = model_name});
  const ghostlink::kv_event_publisher publisher(cache, {.endpoint = pub, .replay_endpoint = replay});
  asio::thread_pool threads(1);
  std::cout << "ready" << std::endl;
  for (std::string line; std::getline(std::cin, line);) {
    std::istringstream in(line);
    std::string command;
    in >> command;
    if (command == "quit") break;
    if (command == "entries") {
      std::cout << "entries " << cache.stats().cached_entries << std::endl;
      continue;
    }
    std::uint64_t id = 0;
    std::size_t decode = 0, n = 0;
    in >> id >> decode >> n;
    std::vector<token_id> prompt(n);
    for (token_id& t : prompt) in >> t;
    if (command != "req" || !in || n == 0) {
      std::cout << "error " << line << std::endl;
      continue;
    }
    std::cout
        << asio::co_spawn(threads, serve_request(model, cache, id, decode, std::move(prompt)), asio::use_future).get()
        << std::endl;
  }
  threads.join();
  return 0;
}

// ---------------------------------------------------------------- router

/// One server process and the router's view of it.
struct server_process {
  pid_t pid = -1;
  int to = -1, from = -1;  // its standard input and output
  std::string pending;     // what it wrote after the last full line
  std::string pub, replay;
  std::unique_ptr<kv_mirror::follower> follow;  // once the router has joined
  std::size_t in_flight = 0, served = 0;

  void send(const std::string& line) {
    const std::string msg = line + "\n";
    for (std::size_t at = 0; at < msg.size();) {
      const ssize_t n = ::write(to, msg.data() + at, msg.size() - at);
      if (n <= 0) throw std::runtime_error("kv_router: a server's input closed");
      at += static_cast<std::size_t>(n);
    }
  }
  /// A full line from it, if one is here already or comes in a read.
  bool take_line(std::string& line) {
    const auto end = pending.find('\n');
    if (end == std::string::npos) return false;
    line = pending.substr(0, end);
    pending.erase(0, end + 1);
    return true;
  }
  void read_some() {
    char buf[4096];
    const ssize_t n = ::read(from, buf, sizeof buf);
    if (n <= 0) throw std::runtime_error("kv_router: a server exited");
    pending.append(buf, static_cast<std::size_t>(n));
  }
  /// Its next line, waiting at most 60 s.
  std::string line() {
    std::string l;
    while (!take_line(l)) {
      pollfd p{from, POLLIN, 0};
      if (::poll(&p, 1, 60'000) <= 0) throw std::runtime_error("kv_router: a server did not answer");
      read_some();
    }
    return l;
  }
};

/// The servers of one run, stopped by process id when it ends.
class fleet {
 public:
  fleet(const options& o, const std::filesystem::path& dir, const char* self) {
    for (std::size_t i = 0; i < o.servers; ++i) start(o, dir, self, i);
    for (server_process& s : servers)
      if (s.line() != "ready") throw std::runtime_error("kv_router: a server did not start");
  }
  fleet(const fleet&) = delete;
  fleet& operator=(const fleet&) = delete;
  ~fleet() {
    for (server_process& s : servers) {
      if (s.to >= 0) ::close(s.to);  // end of input: it quits
      if (s.from >= 0) ::close(s.from);
      if (s.pid > 0 && !quit_) ::kill(s.pid, SIGTERM);
      int status = 0;
      if (s.pid > 0) ::waitpid(s.pid, &status, 0);
    }
  }
  /// Asks each to quit; false if one did not exit cleanly.
  bool quit() {
    bool clean = true;
    for (server_process& s : servers) {
      s.send("quit");
      int status = 0;
      ::waitpid(s.pid, &status, 0);
      clean = clean && WIFEXITED(status) && WEXITSTATUS(status) == 0;
      s.pid = -1;
    }
    quit_ = true;
    return clean;
  }

  std::vector<server_process> servers;

 private:
  void start(const options& o, const std::filesystem::path& dir, const char* self, std::size_t i) {
    server_process s;
    s.pub = "ipc://" + (dir / ("pub" + std::to_string(i))).string();
    s.replay = "ipc://" + (dir / ("replay" + std::to_string(i))).string();
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0)
      throw std::runtime_error("kv_router: pipe2 failed");
    const std::vector<std::string> args{self,       "--serve",
                                        "--pub",    s.pub,
                                        "--replay", s.replay,
                                        "--layers", std::to_string(o.layers),
                                        "--turns",  std::to_string(o.turns),
                                        "--decode", std::to_string(o.decode)};
    std::vector<char*> argv;
    argv.reserve(args.size() + 1);
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    s.pid = ::fork();
    if (s.pid < 0) throw std::runtime_error("kv_router: fork failed");
    if (s.pid == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      ::execv(self, argv.data());
      std::_Exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    s.to = in[1];
    s.from = out[0];
    servers.push_back(std::move(s));
  }
  bool quit_ = false;
};

/// The workload: conversations on shared system prompts (64, 48 and 80
/// tokens), user messages of 12 to 24 tokens, the same every run.
struct workload {
  std::vector<std::vector<token_id>> systems;
  std::vector<std::vector<std::vector<token_id>>> users;  // [conversation][turn]

  workload(const options& o, std::size_t vocab) {
    for (std::size_t s = 0; s < system_prompts; ++s) {
      std::mt19937_64 rng(700 + s);
      systems.emplace_back(s == 0 ? 64 : s == 1 ? 48 : 80);
      for (token_id& t : systems.back()) t = static_cast<token_id>(rng() % vocab);
    }
    for (std::size_t c = 0; c < o.conversations; ++c) {
      std::mt19937_64 rng(2000 + c);
      users.emplace_back();
      for (std::size_t k = 0; k < o.turns; ++k) {
        users.back().emplace_back(12 + rng() % 13);
        for (token_id& t : users.back().back()) t = static_cast<token_id>(rng() % vocab);
      }
    }
  }
};

struct run_result {
  std::size_t prompt_tokens = 0, hit_tokens = 0, rows = 0, bad = 0, requests = 0;
  std::size_t predicted = 0, hit_after_join = 0;  // the requests routed by the mirrors
  std::size_t joined_entries = 0;  // what the dumps held when the router joined
  bool mirrors_agree = true, clean_exit = true;
};

enum class policy { kv_aware, round_robin };

/// The block hashes of `tokens` as every server computes them: a prefix
/// cache of the same model, layout and geometry (on a pool of one block;
/// it stores nothing).
class hasher {
 public:
  hasher(const options& o, const ghostlink::kv_cache_config& c)
      : pool_(ghostlink::kv_block_pool::for_caches(c, {.max_blocks = 1})),
        cache_(o.layers, c, pool_, {.model = model_name}) {}
  std::vector<std::string> keys(std::span<const token_id> tokens) const {
    std::vector<std::string> out;
    for (const ghostlink::kv_block_hash& h : cache_.block_hashes(tokens))
      out.push_back(kv_mirror::key_of(h, ghostlink::kv_wire_hash::bytes));
    return out;
  }

 private:
  ghostlink::kv_block_pool pool_;
  ghostlink::kv_prefix_cache cache_;
};

/// The blocks of `keys` from block 0 that `view` holds.
std::size_t cached_run(const kv_mirror::mirror& view, const std::vector<std::string>& keys) {
  std::size_t n = 0;
  while (n < keys.size() && view.holds("RAM", keys[n])) ++n;
  return n;
}

run_result run(const options& o, const workload& work, policy how, const char* self) {
  const tiny_llama::dims dims = model_dims(o);
  const ghostlink::kv_cache_config config = cache_config(o, dims);
  const hasher hashes(o, config);
  const std::size_t block = config.block_tokens;
  char templ[] = "/tmp/kv_router-XXXXXX";
  if (!::mkdtemp(templ)) throw std::runtime_error("kv_router: mkdtemp failed");
  const std::filesystem::path dir(templ);
  struct remove_dir {
    std::filesystem::path p;
    ~remove_dir() {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
    }
  } cleanup{dir};
  fleet f(o, dir, self);
  std::vector<server_process>& servers = f.servers;

  struct conv_state {
    std::vector<token_id> tokens;  // after its last turn
    std::size_t next = 0;          // its next turn
  };
  std::vector<conv_state> convs(o.conversations);
  for (std::size_t c = 0; c < o.conversations; ++c) convs[c].tokens = work.systems[c % system_prompts];
  run_result r;
  std::size_t rr = 0, in_flight = 0;
  // The first round (one turn per server) goes round robin before the router follows anyone.
  const std::size_t warmup = how == policy::kv_aware ? std::min(o.servers, o.conversations) : 0;
  std::vector<std::size_t> request_conv;  // by request id
  std::vector<std::size_t> request_server;

  auto dispatch = [&](std::size_t c) {
    conv_state& cs = convs[c];
    std::vector<token_id> prompt = cs.tokens;  // its next turn's
    prompt.insert(prompt.end(), work.users[c][cs.next].begin(), work.users[c][cs.next].end());
    std::size_t to = rr++ % servers.size();
    if (how == policy::kv_aware && request_conv.size() >= warmup) {
      const std::vector<std::string> keys = hashes.keys(std::span<const token_id>(prompt).first(prompt.size() - 1));
      std::size_t best = 0;
      for (std::size_t s = 0; s < servers.size(); ++s) {
        while (servers[s].follow->step(std::chrono::milliseconds(0))) {
        }
        const std::size_t run = cached_run(servers[s].follow->view, keys);
        const auto rank = [&](std::size_t i, std::size_t n) {
          return std::tuple(n, -static_cast<long>(servers[i].in_flight), -static_cast<long>(servers[i].served));
        };
        if (s == 0 || rank(s, run) > rank(to, best)) {
          to = s;
          best = run;
        }
      }
      r.predicted += best * block;
    }
    std::ostringstream line;
    line << "req " << request_conv.size() << ' ' << o.decode << ' ' << prompt.size();
    for (const token_id t : prompt) line << ' ' << t;
    servers[to].send(line.str());
    ++servers[to].in_flight;
    ++in_flight;
    request_conv.push_back(c);
    request_server.push_back(to);
    r.prompt_tokens += prompt.size();
  };

  auto finish = [&](const std::string& line) {
    std::istringstream in(line);
    std::string word;
    std::uint64_t id = 0;
    std::size_t attached = 0, rows = 0, ok = 0;
    in >> word >> id >> attached >> rows >> ok;
    if (word != "done" || id >= request_conv.size()) throw std::runtime_error("kv_router: bad reply: " + line);
    conv_state& cs = convs[request_conv[id]];
    server_process& s = servers[request_server[id]];
    cs.tokens.insert(cs.tokens.end(), work.users[request_conv[id]][cs.next].begin(),
                     work.users[request_conv[id]][cs.next].end());
    for (token_id t = 0; in >> t;) cs.tokens.push_back(t);
    ++cs.next;
    --s.in_flight;
    ++s.served;
    --in_flight;
    r.hit_tokens += attached;
    if (warmup != 0 && id >= warmup) r.hit_after_join += attached;
    r.rows += rows;
    r.bad += ok ? 0 : 1;
    ++r.requests;
    // The router's view catches up with the insert before it routes on it.
    if (s.follow) {
      const std::vector<std::string> keys = hashes.keys(cs.tokens);
      for (int i = 0; i < 1'000 && !keys.empty() && !s.follow->view.holds("RAM", keys.back()); ++i)
        if (!s.follow->step()) break;
    }
  };

  // A reply from any server.
  auto wait_one = [&] {
    std::string line;
    for (server_process& s : servers)
      if (s.take_line(line)) return finish(line);
    std::vector<pollfd> fds;
    fds.reserve(servers.size());
    for (const server_process& s : servers) fds.push_back({s.from, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), 60'000) <= 0) throw std::runtime_error("kv_router: no server answered");
    for (std::size_t i = 0; i < fds.size(); ++i)
      if (fds[i].revents) servers[i].read_some();
  };
  // Requests arrive turn by turn, the conversations in a shuffled order
  // (the same in every run), at most `in_flight` per server at a time.
  std::mt19937_64 arrivals(42);
  for (std::size_t k = 0; k < o.turns; ++k) {
    std::vector<std::size_t> order(o.conversations);
    for (std::size_t c = 0; c < order.size(); ++c) order[c] = c;
    std::shuffle(order.begin(), order.end(), arrivals);
    for (const std::size_t c : order) {
      if (warmup != 0 && request_conv.size() == warmup) {
        // The first requests were served before the router followed
        // anyone: it joins from the servers' dumps.
        while (in_flight != 0) wait_one();
        for (server_process& s : servers) {
          s.follow = std::make_unique<kv_mirror::follower>(s.pub, s.replay);
          if (!s.follow->join()) throw std::runtime_error("kv_router: no dump from a server");
          r.joined_entries += s.follow->view.entries.size();
        }
      }
      while (in_flight >= o.servers * o.in_flight) wait_one();
      dispatch(c);
    }
    while (in_flight != 0) wait_one();
  }
  // Each mirror against its server's cache: the entries it counts.
  for (server_process& s : servers) {
    if (!s.follow) continue;
    // Each insert's last entry was waited for: what is left came before it.
    while (s.follow->step(std::chrono::milliseconds(0))) {
    }
    s.send("entries");
    const std::string reply = s.line();
    if (reply != "entries " + std::to_string(s.follow->view.entries.size())) {
      std::fprintf(stderr, "kv_router: a mirror holds %zu entries, its server says \"%s\"\n",
                   s.follow->view.entries.size(), reply.c_str());
      r.mirrors_agree = false;
    }
  }
  r.clean_exit = f.quit();
  return r;
}

double percent(std::size_t part, std::size_t whole) { return whole ? 100.0 * double(part) / double(whole) : 0; }

options parse(int argc, char** argv, std::string& pub, std::string& replay, bool& serving) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--serve") {
      serving = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument("missing value for " + a);
    const std::string v = argv[++i];
    if (a == "--pub")
      pub = v;
    else if (a == "--replay")
      replay = v;
    else {
      const std::size_t n = std::stoul(v);
      if (a == "--servers")
        o.servers = n;
      else if (a == "--conversations")
        o.conversations = n;
      else if (a == "--turns")
        o.turns = n;
      else if (a == "--decode")
        o.decode = n;
      else if (a == "--layers")
        o.layers = n;
      else if (a == "--in-flight")
        o.in_flight = n;
      else
        throw std::invalid_argument("unknown option " + a);
      if (n == 0) throw std::invalid_argument(a + " must be at least 1");
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string pub, replay;
  bool serving = false;
  const options o = parse(argc, argv, pub, replay, serving);
  if (serving) return serve(o, pub, replay);

  const workload work(o, model_dims(o).vocab);
  // Servers run this very program: a path that does not depend on PATH.
  const std::string self = std::filesystem::canonical("/proc/self/exe").string();
  const run_result kv = run(o, work, policy::kv_aware, self.c_str());
  const run_result rr = run(o, work, policy::round_robin, self.c_str());

  std::printf("kv_router: %zu servers, %zu conversations of %zu turns on %zu system prompts, %zu layers\n", o.servers,
              o.conversations, o.turns, system_prompts, o.layers);
  std::printf("  joined late: after %zu requests, from dumps of %zu entries in all\n",
              std::min(o.servers, o.conversations), kv.joined_entries);
  std::printf("  %-12s %9s %12s %12s %10s\n", "policy", "hit rate", "prompt tok", "prefilled", "saved");
  for (const auto& [name, r] : {std::pair{"kv-aware", &kv}, std::pair{"round robin", &rr}})
    std::printf("  %-12s %8.1f%% %12zu %12zu %9.1f%%\n", name, percent(r->hit_tokens, r->prompt_tokens),
                r->prompt_tokens, r->prompt_tokens - r->hit_tokens, percent(r->hit_tokens, r->prompt_tokens));
  std::printf("  the mirrors predicted %zu tokens hit, and %zu were (kv-aware, after joining)\n", kv.predicted,
              kv.hit_after_join);
  std::printf("  logits: %zu rows checked against the recompute, %zu requests with a difference\n", kv.rows + rr.rows,
              kv.bad + rr.bad);
  bool ok = true;
  if (kv.bad + rr.bad != 0) ok = false;
  if (!kv.mirrors_agree) ok = false;
  if (!kv.clean_exit || !rr.clean_exit) {
    std::fprintf(stderr, "kv_router: a server did not exit cleanly\n");
    ok = false;
  }
  if (kv.hit_tokens <= rr.hit_tokens) {
    std::fprintf(stderr, "kv_router: KV-aware routing hit %zu tokens, round robin %zu: no gain\n", kv.hit_tokens,
                 rr.hit_tokens);
    ok = false;
  }
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kv_router: %s\n", e.what());
  return 1;
}
