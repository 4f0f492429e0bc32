#pragma once
// The chat trace prefix_workload and prefix_workload_hybrid replay: 64
// system prompts of 512 tokens picked by a Zipf law (s = 1.1), each with a
// unique suffix of 64..256 tokens; conversations whose next turn extends
// the previous one (its prompt, its output and a user turn of 32..128
// tokens); and exact repeats of recent requests (one in ten).

#include <ghostlink/kv_cache.hpp>

#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

#include "scenarios.hpp"
#include "workload.hpp"

namespace ghostlink::bench {

struct trace_shape {
  std::size_t layers = 4;
  std::size_t system_prompts = 64, system_tokens = 512;
  std::size_t suffix_min = 64, suffix_max = 256;
  std::size_t turn_min = 32, turn_max = 128, max_turns = 4;
  std::size_t decode = 16;
  std::size_t requests = 1000;
  std::size_t budget = 768;  // blocks per layer
  double zipf_s = 1.1;
  double follow_up = 0.25;     // share of requests that continue an open conversation
  double open_share = 0.3;     // share of new requests that open one
  std::size_t max_open = 16;   // conversations open at once
  double repeat = 0.1;         // share of requests that repeat a recent one exactly (greedy decoding: same output)
  std::size_t recent = 64;     // how far back a repeat looks
};

inline trace_shape shape_of(const options& o) {
  trace_shape s;
  if (o.quick) {
    s.layers = 2;
    s.system_prompts = 8;
    s.system_tokens = 64;
    s.suffix_min = 16;
    s.suffix_max = 64;
    s.turn_min = 16;
    s.turn_max = 32;
    s.decode = 4;
    s.requests = 40;
    s.budget = 48;
  }
  return s;
}

/// Which kind of request a trace's request is.
enum class request_kind { system_prompt, follow_up, repeat };

struct request {
  std::vector<token_id> prompt, output;
  request_kind kind = request_kind::system_prompt;
};

inline std::vector<request> make_trace(const trace_shape& s) {
  std::mt19937_64 rng(42);
  std::vector<std::vector<token_id>> system(s.system_prompts);
  for (auto& p : system) p = random_token_ids(rng, s.system_tokens);
  std::vector<double> weights(s.system_prompts);
  for (std::size_t k = 0; k < weights.size(); ++k) weights[k] = 1.0 / std::pow(double(k + 1), s.zipf_s);
  std::discrete_distribution<std::size_t> zipf(weights.begin(), weights.end());
  std::bernoulli_distribution follow(s.follow_up), open(s.open_share), repeat(s.repeat);
  const auto tokens = [&](std::size_t lo, std::size_t hi) {
    return random_token_ids(rng, std::uniform_int_distribution<std::size_t>(lo, hi)(rng));
  };
  struct conversation {
    std::size_t last = 0, turns = 1;
  };
  std::vector<conversation> live;
  std::vector<request> trace(s.requests);
  for (std::size_t r = 0; r < trace.size(); ++r) {
    request& q = trace[r];
    if (r > 0 && repeat(rng)) {  // all its blocks cached (unless evicted): used again, none added
      q = trace[r - 1 - std::uniform_int_distribution<std::size_t>(0, std::min(r, s.recent) - 1)(rng)];
      q.kind = request_kind::repeat;
      continue;
    }
    if (!live.empty() && follow(rng)) {
      const std::size_t c = std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng);
      const request& prev = trace[live[c].last];
      q.prompt = prev.prompt;
      q.prompt.insert(q.prompt.end(), prev.output.begin(), prev.output.end());
      q.kind = request_kind::follow_up;
      const std::vector<token_id> turn = tokens(s.turn_min, s.turn_max);
      q.prompt.insert(q.prompt.end(), turn.begin(), turn.end());
      live[c].last = r;
      if (++live[c].turns == s.max_turns) live.erase(live.begin() + std::ptrdiff_t(c));
    } else {
      q.prompt = system[zipf(rng)];
      const std::vector<token_id> suffix = tokens(s.suffix_min, s.suffix_max);
      q.prompt.insert(q.prompt.end(), suffix.begin(), suffix.end());
      if (live.size() < s.max_open && open(rng)) live.push_back({r, 1});
    }
    q.output = random_token_ids(rng, s.decode);
  }
  return trace;
}

}  // namespace ghostlink::bench
