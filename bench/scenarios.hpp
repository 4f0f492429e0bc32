#pragma once
// One function per scenario; each runs ghostlink and the baselines on the
// same data and adds their figures to the report.

#include "harness.hpp"

namespace ghostlink::bench {

void read_under_write(const options& opts, report& out);
void attention_read(const options& opts, report& out);
void attend_kernel(const options& opts, report& out);
void attend_memory(const options& opts, report& out);
void attend_window(const options& opts, report& out);
void write_single(const options& opts, report& out);
void write_concurrent(const options& opts, report& out);
void decode_step(const options& opts, report& out);
void decode_layer_order(const options& opts, report& out);
void decode_pending(const options& opts, report& out);
void batched_step(const options& opts, report& out);
void decode_hybrid(const options& opts, report& out);
void decode_speculative(const options& opts, report& out);
void decode_with_offloader(const options& opts, report& out);
void memory(const options& opts, report& out);
void layout_memory(const options& opts, report& out);
void latent_memory(const options& opts, report& out);
void attend_latent(const options& opts, report& out);
void quantized_memory(const options& opts, report& out);
void attend_quantized(const options& opts, report& out);
void write_quantized(const options& opts, report& out);
void fork(const options& opts, report& out);
void prefill(const options& opts, report& out);
void memory_waste(const options& opts, report& out);
void storage_16bit(const options& opts, report& out);
void prefix_attach(const options& opts, report& out);
void prefix_hash(const options& opts, report& out);
void prefix_match(const options& opts, report& out);
void prefix_eviction(const options& opts, report& out);
void prefix_workload(const options& opts, report& out);
void prefix_workload_hybrid(const options& opts, report& out);
void retention(const options& opts, report& out);
void save_load(const options& opts, report& out);
void decode_with_offload(const options& opts, report& out);
void attach_from_disk(const options& opts, report& out);
void redis_store(const options& opts, report& out);
void redis_store_tls(const options& opts, report& out);
void attach_from_redis(const options& opts, report& out);
#if GHOSTLINK_BENCH_EVENTS
void events_insert(const options& opts, report& out);
void events_rate(const options& opts, report& out);
void dump_pause(const options& opts, report& out);
#endif

}  // namespace ghostlink::bench
