// attend_memory: the memory side of a decode step alone. --layers x
// --sequences caches (512 at the default shape) of 2048 tokens each (2 GiB
// of keys and values at 4 x 64 floats, far beyond any processor cache),
// every one attended once per lap, one after another on one thread, as a
// decode thread reads them; tokens attended per second:
// - ghostlink: layer_kv_caches of one preallocated pool without a memory
//   resource, attended over their snapshots (a cache's blocks lie in
//   64-block reserved extents: runs of 1,024 tokens' keys at 16-token
//   blocks, then of their values, the next run elsewhere);
// - ghostlink_resource: the same on a pool whose memory resource is the
//   arena below (16-block extents: runs of 256 tokens);
// - rwlock_zero_copy: the lock baseline's caches (bench/baselines/
//   locked_cache.hpp: all of a cache's keys in one buffer, its values in
//   another), attended straight from the buffers under the shared lock.
// No writes and no actor between the attentions: what differs is where the
// bytes are and the snapshot's walk over the block table.
// ghostlink_resource and the baseline take their memory from one arena
// (bench/arena.hpp) in turn, the order alternating run by run, each filled
// and then attended for three laps (the median counts); ghostlink's own
// pool preallocates its pages before its caches fill. Then the baseline
// fills and attends the same memory a second time: "control" is that lap
// against its first, the same code on the same bytes, so its distance
// from 1 is this machine's noise at this scale.
#include <ghostlink/kv_cache.hpp>

#include <asio/thread_pool.hpp>
#include <asio/use_future.hpp>

#include <algorithm>
#include <future>
#include <memory>

#include "../arena.hpp"
#include "../attention.hpp"
#include "../baselines/locked_cache.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

constexpr std::size_t laps = 3;

std::size_t context(const options& o) { return o.quick ? 256 : 2048; }

kv_cache_config memory_config(const options& o) {
  kv_cache_config c = o.config();
  c.max_tokens_per_seq = context(o);
  return c;
}

/// Tokens attended per second over `caches` caches of `context(o)` tokens:
/// the median of `laps` laps of `attend_all()`.
template <class AttendAll>
double tokens_per_second(const options& o, std::size_t caches, AttendAll attend_all) {
  std::vector<double> seconds;
  for (std::size_t lap = 0; lap < laps; ++lap) {
    const perf_window profiled;
    const auto t0 = clock_type::now();
    attend_all();
    seconds.push_back(seconds_since(t0));
  }
  std::sort(seconds.begin(), seconds.end());
  return double(caches * context(o)) / seconds[laps / 2];
}

/// Over caches on `pool`'s blocks.
double run_ghostlink(const options& o, const token_rows& prompt, kv_block_pool pool) {
  const std::size_t caches = o.layers * o.sequences;
  const kv_cache_config config = memory_config(o);
  asio::thread_pool threads(1);
  pool.preallocate(preallocated_blocks(config, caches, pool.blocks_per_extent()));
  std::vector<kv_write> prefill;
  for (std::size_t i = 0; i < context(o); ++i) prefill.push_back({i, prompt.keys_of(i, 1), prompt.values_of(i, 1)});
  std::vector<layer_kv_cache> layers;
  layers.reserve(caches);
  for (std::size_t c = 0; c < caches; ++c) {
    layers.emplace_back(threads, config, pool);
    layers.back().async_initialize(1, asio::use_future).get();
    layers.back().async_write_batch(prefill, asio::use_future).get();
  }
  const double rate = tokens_per_second(o, caches, [&] {
    for (const layer_kv_cache& cache : layers) {
      attention a(o.heads, o.head_dim);
      a.over(cache.snapshot());
      keep(a.checksum());
    }
  });
  layers.clear();
  threads.join();
  return rate;
}

double run_ghostlink(const options& o, const token_rows& prompt) {
  return run_ghostlink(o, prompt, kv_block_pool::for_caches(memory_config(o)));
}

double run_ghostlink(const options& o, const token_rows& prompt, arena& memory) {
  arena::resource resource(memory);  // outlives the pool: the caches are gone when run_ghostlink returns
  return run_ghostlink(o, prompt, kv_block_pool::for_caches(memory_config(o), {.memory = &resource}));
}

double run_locked(const options& o, const token_rows& prompt, arena& memory) {
  const std::size_t caches = o.layers * o.sequences;
  arena::resource resource(memory);
  std::vector<std::unique_ptr<rwlock_cache>> layers;
  layers.reserve(caches);
  for (std::size_t c = 0; c < caches; ++c) {
    layers.push_back(std::make_unique<rwlock_cache>(memory_config(o), &resource));
    layers.back()->initialize(1);
    for (std::size_t i = 0; i < context(o); ++i) layers.back()->write(i, prompt.keys_of(i, 1), prompt.values_of(i, 1));
  }
  return tokens_per_second(o, caches, [&] {
    for (const auto& cache : layers) {
      attention a(o.heads, o.head_dim);
      cache->visit_range(0, context(o), [&](auto k, auto v) { a.over(k, v); });
      keep(a.checksum());
    }
  });
}

}  // namespace

void attend_memory(const options& o, report& out) {
  const token_rows prompt(o.config().token_width(), context(o));
  arena memory(arena_bytes(memory_config(o), o.layers * o.sequences));
  std::size_t runs = 0;
  out.run("attend_memory", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "1 tokens", "attention over every cache, one thread", "tokens/s");
    metric& control = declare(m, "2 control", "control: the baseline's second lap / its first", "x");
    const bool ghostlink_first = runs++ % 2 == 0;
    const auto ghostlink = [&] {
      rate.values["ghostlink"] = run_ghostlink(o, prompt);
      rate.values["ghostlink_resource"] = run_ghostlink(o, prompt, memory);
    };
    if (ghostlink_first && o.wants("ghostlink")) ghostlink();
    if (o.wants("rwlock_zero_copy")) {
      const double first = run_locked(o, prompt, memory);
      rate.values["rwlock_zero_copy"] = first;
      control.values["rwlock_zero_copy"] = run_locked(o, prompt, memory) / first;
    }
    if (!ghostlink_first && o.wants("ghostlink")) ghostlink();
  });
  out.add_note("attend_memory",
               std::to_string(o.layers * o.sequences) + " caches of " + std::to_string(context(o)) +
                   " tokens, each attended once per lap on one thread, no writes. ghostlink: layer_kv_caches of "
                   "a preallocated pool (64-block reserved extents), over snapshots; ghostlink_resource: the same "
                   "on the arena as a memory resource (16-block extents), in turn with the baseline; zero_copy: two "
                   "buffers "
                   "per cache, under the shared lock. control: the baseline filled and attended again on the "
                   "same memory, against its first time (the noise floor)");
}

}  // namespace ghostlink::bench
