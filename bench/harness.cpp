#include "harness.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

namespace ghostlink::bench {

perf_window::perf_window() {
  const char* path = std::getenv("GHOSTLINK_BENCH_PERF_CTL");  // NOLINT(concurrency-mt-unsafe): no setenv here
  if (path) control_ = std::fopen(path, "w");
  if (!control_) return;
  std::fputs("enable\n", control_);
  std::fflush(control_);
}

perf_window::~perf_window() {
  if (!control_) return;
  std::fputs("disable\n", control_);
  std::fclose(control_);
}

namespace {

void usage(int code) {
  std::printf("ghostlink-bench: ghostlink against the seed's designs, side by side in one process\n"
              "  --quick             tiny sizes, one run (for CI; no timing claims)\n"
              "  --runs N            median of N runs per figure (default 5)\n"
              "  --seconds S         length of one timed phase (default 0.25)\n"
              "  --tokens N --heads N --head-dim N --block-tokens N   cache shape (default 8192 x 4 x 64, 16)\n"
              "  --read-tokens N     tokens read per step in read_under_write/attention_read (default 1024)\n"
              "  --layers N --sequences N --steps N                   decode_step shape (default 32 x 16, 64)\n"
              "  --coroutines N --threads N                           write_concurrent/decode_step (default 64, 2)\n"
              "  --batch N           tokens per batched request in write_concurrent (default 32)\n"
              "  --element T         float, half, bfloat16 or q8_0: storage of the decode scenarios and\n"
              "                      attend_window (default float)\n"
              "  --only SCENARIO     one of read_under_write attention_read attend attend_memory attend_window\n"
              "                      write_single write_concurrent decode_step decode_layer_order\n"
              "                      decode_pending batched_step decode_hybrid decode_speculative\n"
              "                      decode_with_offloader memory layout_memory latent_memory attend_latent\n"
              "                      quantized_memory attend_quantized write_quantized fork prefill memory_waste\n"
              "                      storage_16bit\n"
              "                      prefix_attach prefix_hash prefix_match prefix_eviction prefix_workload\n"
              "                      prefix_workload_hybrid retention\n"
              "                      save_load decode_with_offload attach_from_disk\n"
              "                      redis_store redis_store_tls attach_from_redis\n"
              "  --impl A,B          only these of ghostlink rwlock_zero_copy rwlock mutex strand_only (default: all)\n"
              "  --json FILE         also write every figure as JSON\n");
  std::exit(code);  // NOLINT(concurrency-mt-unsafe): parsing the command line, before any thread starts
}

}  // namespace

options parse_options(int argc, char** argv) {
  options o;
  std::map<std::string, std::size_t*> sizes{{"--runs", &o.runs},
                                            {"--tokens", &o.tokens},
                                            {"--heads", &o.heads},
                                            {"--head-dim", &o.head_dim},
                                            {"--block-tokens", &o.block_tokens},
                                            {"--read-tokens", &o.read_tokens},
                                            {"--layers", &o.layers},
                                            {"--sequences", &o.sequences},
                                            {"--steps", &o.steps},
                                            {"--coroutines", &o.coroutines},
                                            {"--threads", &o.threads},
                                            {"--batch", &o.batch}};
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") usage(0);
    if (flag == "--quick") {
      quick = true;
      continue;
    }
    if (i + 1 >= argc) usage(2);
    const std::string value = argv[++i];
    if (auto it = sizes.find(flag); it != sizes.end()) {
      const long long v = std::atoll(value.c_str());
      if (v <= 0) usage(2);
      *it->second = static_cast<std::size_t>(v);
    } else if (flag == "--seconds") {
      o.seconds = std::atof(value.c_str());
      if (o.seconds <= 0) usage(2);
    } else if (flag == "--only") {
      o.only = value;
    } else if (flag == "--impl") {
      o.impls = value;
    } else if (flag == "--element") {
      if (value != "float" && value != "half" && value != "bfloat16" && value != "q8_0") usage(2);
      o.element = value;
    } else if (flag == "--json") {
      o.json = value;
    } else {
      usage(2);
    }
  }
  if (quick) {
    o.quick = true;
    o.runs = 1;
    o.seconds = 0.01;
    o.tokens = std::min<std::size_t>(o.tokens, 512);
    o.read_tokens = std::min<std::size_t>(o.read_tokens, 128);
    o.layers = std::min<std::size_t>(o.layers, 4);
    o.sequences = std::min<std::size_t>(o.sequences, 4);
    o.steps = std::min<std::size_t>(o.steps, 8);
    o.coroutines = std::min<std::size_t>(o.coroutines, 8);
  }
  o.read_tokens = std::min(o.read_tokens, o.tokens);
  o.steps = std::min(o.steps, o.tokens);
  return o;
}

double latencies::p(double q) {
  if (ns.empty()) return 0;
  const auto at = static_cast<std::size_t>(q * double(ns.size() - 1));
  std::nth_element(ns.begin(), ns.begin() + std::ptrdiff_t(at), ns.end());
  return ns[at];
}

void report::run(const std::string& scenario, const options& opts,
                 const std::function<void(std::map<std::string, metric>&)>& measure) {
  std::map<std::string, std::map<std::string, std::vector<double>>> samples;  // metric -> impl -> runs
  std::map<std::string, metric> shape;
  std::vector<std::string> order;
  for (std::size_t r = 0; r < opts.runs; ++r) {
    std::map<std::string, metric> one;
    measure(one);
    for (auto& [name, m] : one) {
      if (!shape.contains(name)) order.push_back(name);
      shape[name] = m;
      for (auto& [impl, v] : m.values) samples[name][impl].push_back(v);
    }
    std::fprintf(stderr, "  %s: run %zu/%zu done\n", scenario.c_str(), r + 1, opts.runs);
  }
  for (const auto& name : order) {
    metric m = shape[name];
    m.scenario = scenario;
    for (auto& [impl, runs] : samples[name]) {
      std::sort(runs.begin(), runs.end());
      m.values[impl] = runs[runs.size() / 2];
    }
    metrics_.push_back(std::move(m));
  }
}

namespace {

std::string human(double v) {
  char buf[32];
  const double a = v < 0 ? -v : v;
  if (a >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2fG", v / 1e9);
  else if (a >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", v / 1e6);
  else if (a >= 1e4)
    std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

}  // namespace

void report::print() const {
  std::printf("%-18s %-34s %10s %10s %10s %10s %10s   %s\n", "scenario", "metric", "ghostlink", "zero_copy", "rwlock",
              "mutex", "strand", "ghostlink vs zero_copy / rwlock / mutex / strand (x better)");
  std::string last;
  for (const metric& m : metrics_) {
    std::printf("%-18s %-34s", m.scenario == last ? "" : m.scenario.c_str(), (m.name + " (" + m.unit + ")").c_str());
    last = m.scenario;
    for (const auto& impl : implementations()) {
      auto it = m.values.find(impl);
      std::printf(" %10s", it == m.values.end() ? "-" : human(it->second).c_str());
    }
    std::printf("  ");
    auto g = m.values.find("ghostlink");
    for (const auto& impl : implementations()) {
      if (impl == "ghostlink") continue;
      auto it = m.values.find(impl);
      if (g == m.values.end() || it == m.values.end() || it->second == 0 || g->second == 0) {
        std::printf(" %8s", "-");
        continue;
      }
      const double better = m.higher_is_better ? g->second / it->second : it->second / g->second;
      std::printf(" %7.2fx", better);
    }
    for (const auto& [impl, v] : m.values)
      if (std::find(implementations().begin(), implementations().end(), impl) == implementations().end())
        std::printf("  %s=%s", impl.c_str(), human(v).c_str());
    std::printf("\n");
  }
  for (const auto& [scenario, notes] : notes_)
    for (const auto& n : notes) std::printf("note %s: %s\n", scenario.c_str(), n.c_str());
}

void report::write_json(const std::string& path, const options& opts) const {
  std::ofstream out(path);
  out << "{\n  \"options\": {\"quick\": " << (opts.quick ? "true" : "false") << ", \"runs\": " << opts.runs
      << ", \"seconds\": " << opts.seconds << ", \"tokens\": " << opts.tokens << ", \"heads\": " << opts.heads
      << ", \"head_dim\": " << opts.head_dim << ", \"block_tokens\": " << opts.block_tokens
      << ", \"threads\": " << opts.threads << "},\n  \"metrics\": [\n";
  for (std::size_t i = 0; i < metrics_.size(); ++i) {
    const metric& m = metrics_[i];
    out << R"(    {"scenario": ")" << m.scenario << R"(", "metric": ")" << m.name << R"(", "unit": ")" << m.unit
        << R"(", "higher_is_better": )" << (m.higher_is_better ? "true" : "false") << R"(, "values": {)";
    bool first = true;
    for (const auto& [impl, v] : m.values) {
      out << (first ? "" : ", ") << '"' << impl << "\": " << v;
      first = false;
    }
    out << "}}" << (i + 1 < metrics_.size() ? "," : "") << "\n";
  }
  out << "  ]\n}\n";
}

}  // namespace ghostlink::bench
