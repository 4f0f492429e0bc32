#pragma once
// The benchmark's frame: options, timing, percentiles, medians over runs,
// and the side-by-side report (table and JSON).

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ghostlink/config.hpp>

namespace ghostlink::bench {

struct options {
  bool quick = false;        // tiny sizes and one run: CI keeps the benchmark from rotting
  std::size_t runs = 5;      // each figure is the median of this many runs
  double seconds = 0.25;     // length of one timed phase
  std::size_t tokens = 8192, heads = 4, head_dim = 64, block_tokens = 16;
  std::size_t read_tokens = 1024;  // read_under_write, attention_read
  std::size_t layers = 32, sequences = 16, steps = 64;  // decode_step
  std::size_t coroutines = 64, threads = 2;             // write_concurrent, decode_step
  std::size_t batch = 32;                                // write_concurrent: tokens per batched request
  std::string element = "float";                         // decode scenarios: float, half, bfloat16 or q8_0
  std::string only;          // run just this scenario
  std::string impls;         // comma-separated implementations to run (default: all)
  std::string json;          // also write the results here

  /// Whether `impl` is to run (--impl).
  bool wants(const std::string& impl) const {
    return impls.empty() || ("," + impls + ",").find("," + impl + ",") != std::string::npos;
  }

  kv_cache_config config() const {
    return {.max_tokens_per_seq = tokens, .num_heads = heads, .head_dim = head_dim, .block_tokens = block_tokens};
  }
};

/// Parses the command line; prints usage and exits on --help or a bad flag.
options parse_options(int argc, char** argv);

/// While it lives, `perf record -D -1 --control fifo:PATH` samples, PATH
/// being the FIFO named by GHOSTLINK_BENCH_PERF_CTL (no variable: nothing
/// happens). Scenarios hold one over their timed phases, so a profile
/// leaves out their setup (docs/PERFORMANCE.md shows the commands).
class perf_window {
 public:
  perf_window();
  ~perf_window();
  perf_window(const perf_window&) = delete;
  perf_window& operator=(const perf_window&) = delete;

 private:
  std::FILE* control_ = nullptr;
};

using clock_type = std::chrono::steady_clock;
inline double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// Calls `op(i)` for i = 0, 1, ... until `seconds` have passed; returns
/// calls per second.
template <class Op>
double ops_per_second(double seconds, Op op) {
  const auto t0 = clock_type::now();
  std::size_t i = 0;
  for (; seconds_since(t0) < seconds; ++i) op(i);
  return double(i) / seconds_since(t0);
}

/// Calls `lap()`, which returns the seconds of it that count (untimed setup
/// left out), until those add up to `seconds`; returns laps per counted
/// second.
template <class Lap>
double laps_per_second(double seconds, Lap lap) {
  double timed = 0;
  std::size_t laps = 0;
  for (; timed < seconds; ++laps) timed += lap();
  return double(laps) / timed;
}

/// Latencies in nanoseconds; p(0.5), p(0.99).
struct latencies {
  std::vector<double> ns;
  void add(clock_type::time_point t0) {
    ns.push_back(std::chrono::duration<double, std::nano>(clock_type::now() - t0).count());
  }
  double p(double q);
};

/// One sequence's decoding: when each of its tokens was done.
struct progress {
  std::vector<clock_type::time_point> at;
  void tick() { at.push_back(clock_type::now()); }
};

/// Adds every sequence's times between two of its tokens (time per output
/// token) to `tpot`; returns the tokens done in all.
inline std::size_t add_tpot(const std::vector<progress>& seqs, latencies& tpot) {
  std::size_t tokens = 0;
  for (const progress& p : seqs) {
    tokens += p.at.size();
    for (std::size_t i = 1; i < p.at.size(); ++i)
      tpot.ns.push_back(std::chrono::duration<double, std::nano>(p.at[i] - p.at[i - 1]).count());
  }
  return tokens;
}

/// One figure per implementation, e.g. {"ghostlink": 1.2e6, "rwlock": 3e5}.
using figures = std::map<std::string, double>;

/// A metric of a scenario: its figures, and whether more is better (for
/// the ratio's direction).
struct metric {
  std::string scenario, name, unit;
  bool higher_is_better = true;
  figures values;
};

/// Declares metric `key` of a scenario's run: its name, unit, and whether
/// higher is better; its other fields keep their defaults.
inline metric& declare(std::map<std::string, metric>& m, const std::string& key, std::string name, std::string unit,
                       bool higher_is_better = true) {
  metric& x = m[key];
  x.name = std::move(name);
  x.unit = std::move(unit);
  x.higher_is_better = higher_is_better;
  return x;
}

/// Collects metrics; each run of a scenario adds its figures, and the
/// report keeps the median of every figure over the runs.
class report {
 public:
  /// Runs `measure` opts.runs times; `measure` adds figures by name.
  void run(const std::string& scenario, const options& opts,
           const std::function<void(std::map<std::string, metric>&)>& measure);
  void add_note(const std::string& scenario, const std::string& note) { notes_[scenario].push_back(note); }
  void print() const;
  void write_json(const std::string& path, const options& opts) const;

 private:
  std::vector<metric> metrics_;
  std::map<std::string, std::vector<std::string>> notes_;
};

/// The implementations, in the order they appear in the table.
inline const std::vector<std::string>& implementations() {
  static const std::vector<std::string> names{"ghostlink", "rwlock_zero_copy", "rwlock", "mutex", "strand_only"};
  return names;
}

}  // namespace ghostlink::bench
