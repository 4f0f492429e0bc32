// ghostlink-bench: every scenario, ghostlink and its baselines in one
// process on the same data; prints one table, and JSON with --json.
#include <cstdio>
#include <map>
#include <string>

#include "harness.hpp"
#include "scenarios.hpp"

int main(int argc, char** argv) {
  using namespace ghostlink::bench;
  const options opts = parse_options(argc, argv);
  // One scenario a line: the #if below stops clang-format from laying the list out.
  // clang-format off
  const std::map<std::string, void (*)(const options&, report&)> scenarios{
      {"read_under_write", read_under_write},
      {"attention_read", attention_read},
      {"attend", attend_kernel},
      {"attend_memory", attend_memory},
      {"attend_window", attend_window},
      {"write_single", write_single},
      {"write_concurrent", write_concurrent},
      {"decode_step", decode_step},
      {"decode_layer_order", decode_layer_order},
      {"decode_pending", decode_pending},
      {"batched_step", batched_step},
      {"decode_hybrid", decode_hybrid},
      {"decode_speculative", decode_speculative},
      {"decode_with_offloader", decode_with_offloader},
      {"memory", memory},
      {"layout_memory", layout_memory},
      {"latent_memory", latent_memory},
      {"attend_latent", attend_latent},
      {"quantized_memory", quantized_memory},
      {"attend_quantized", attend_quantized},
      {"write_quantized", write_quantized},
      {"fork", fork},
      {"prefill", prefill},
      {"memory_waste", memory_waste},
      {"storage_16bit", storage_16bit},
      {"prefix_attach", prefix_attach},
      {"prefix_hash", prefix_hash},
      {"prefix_match", prefix_match},
      {"prefix_eviction", prefix_eviction},
      {"prefix_workload", prefix_workload},
      {"prefix_workload_hybrid", prefix_workload_hybrid},
      {"retention", retention},
      {"save_load", save_load},
      {"decode_with_offload", decode_with_offload},
      {"attach_from_disk", attach_from_disk},
      {"redis_store", redis_store},
      {"redis_store_tls", redis_store_tls},
      {"attach_from_redis", attach_from_redis},
#if GHOSTLINK_BENCH_EVENTS
      {"events_insert", events_insert},
      {"events_rate", events_rate},
      {"dump_pause", dump_pause},
#endif
  };
  // clang-format on

  if (!opts.only.empty() && !scenarios.contains(opts.only)) {
    std::fprintf(stderr, "unknown scenario %s\n", opts.only.c_str());
    return 2;
  }
  report out;
  for (const char* name : {"read_under_write",
                           "attention_read",
                           "attend",
                           "attend_memory",
                           "attend_window",
                           "write_single",
                           "write_concurrent",
                           "decode_step",
                           "decode_layer_order",
                           "decode_pending",
                           "batched_step",
                           "decode_hybrid",
                           "decode_speculative",
                           "decode_with_offloader",
                           "memory",
                           "layout_memory",
                           "latent_memory",
                           "attend_latent",
                           "quantized_memory",
                           "attend_quantized",
                           "write_quantized",
                           "fork",
                           "prefill",
                           "memory_waste",
                           "storage_16bit",
                           "prefix_attach",
                           "prefix_hash",
                           "prefix_match",
                           "prefix_eviction",
                           "prefix_workload",
                           "prefix_workload_hybrid",
                           "retention",
                           "save_load",
                           "decode_with_offload",
                           "attach_from_disk",
                           "redis_store",
                           "redis_store_tls",
                           "attach_from_redis",
                           "events_insert",
                           "events_rate",
                           "dump_pause"})
    if ((opts.only.empty() || opts.only == name) && scenarios.contains(name)) scenarios.at(name)(opts, out);
  std::printf("ghostlink-bench: %zu tokens x %zu heads x %zu dims, %zu-token blocks, median of %zu run(s)%s\n",
              opts.tokens, opts.heads, opts.head_dim, opts.block_tokens, opts.runs, opts.quick ? ", --quick" : "");
  out.print();
  if (!opts.json.empty()) out.write_json(opts.json, opts);
  return 0;
}
