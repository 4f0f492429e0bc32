// ghostlink stress test: W writer coroutines and R reader threads on a
// thread pool hammer layer caches (each owned by one writer, plus one
// arena all writers share) and sequence caches with random writes,
// batches, initializes, truncates, forks and appends. Every writer keeps a
// model of its cache (the state after each of its requests) and every
// snapshot is checked against it: equal to one state (no torn batch or
// token), at least as new as every completed request (read-your-writes),
// one content per epoch number, epochs in request order, kept snapshots
// never changing, sequence layers agreeing. Bounded by --seconds; a failure
// prints the seed to replay with.
//
//   stress [--seconds S] [--seed N] [--writers W] [--readers R]
//          [--sequences Q] [--threads T]

#include "reader.hpp"

#include "testing/hooks.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <random>
#include <thread>

namespace {

using namespace stress;

[[noreturn]] void usage(const char* why) {
  std::cerr << "stress: " << why
            << "\nusage: stress [--seconds S] [--seed N] [--writers W] [--readers R] [--sequences Q] [--threads T]\n";
  std::exit(2);  // NOLINT(concurrency-mt-unsafe): parsing the command line, before any thread starts
}

options parse(int argc, char** argv) {
  options o;
  o.seed =
      std::random_device{}() ^ static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + arg).c_str());
    const char* value = argv[++i];
    char* end = nullptr;
    errno = 0;
    const double number = std::strtod(value, &end);
    if (errno != 0 || end == value || *end != '\0' || number < 0) usage(("bad value " + std::string(value)).c_str());
    const auto count = static_cast<std::size_t>(number);
    if (arg == "--seconds")
      o.seconds = number;
    else if (arg == "--seed")
      o.seed = std::strtoull(value, nullptr, 10);
    else if (arg == "--writers" && count >= 1)
      o.writers = count;
    else if (arg == "--readers" && count >= 1)
      o.readers = count;
    else if (arg == "--sequences")
      o.sequences = count;
    else if (arg == "--threads" && count >= 2)
      o.threads = count;
    else
      usage(("unknown option or value out of range: " + arg + " " + value).c_str());
  }
  return o;
}

void print_figures(const options& o, double elapsed) {
  const figures& f = g_figures;
  auto v = [](const std::atomic<std::uint64_t>& c) { return c.load(); };
  std::cout << "stress: " << elapsed << " s, seed=" << o.seed << ", " << o.writers << " writers, " << o.readers
            << " readers, " << o.sequences << " sequence writers, " << o.threads << " pool threads\n"
            << "  layer requests: " << v(f.requests) << " (writes " << v(f.writes) << ", batches " << v(f.batches)
            << ", initializes " << v(f.initializes) << ", truncates " << v(f.truncates) << ", forks " << v(f.forks)
            << "; " << v(f.rejected) << " planned to fail and did; " << v(f.delayed)
            << " waited for room behind max_pending)\n"
            << "  arena requests: " << v(f.arena_requests) << " in " << v(f.arena_rotations) + 1 << " arenas\n"
            << "  sequence ops: appends " << v(f.appends) << " (" << v(f.chunk_appends) << " of 2-9 tokens; "
            << v(f.steps) << " through steps, " << v(f.steps_abandoned) << " of them abandoned, "
            << v(f.steps_two_threads) << " written from two threads at once; " << v(f.append_capacity_failures)
            << " failed for capacity), truncates " << v(f.seq_truncates) << ", forks " << v(f.seq_forks)
            << ", conflicts " << v(f.conflicts) << " (" << v(f.conflicts_rejected) << " rejected in progress)\n"
            << "  windowed sequences: " << v(f.windowed_sequences) << " (truncates refused with outside_window "
            << v(f.window_truncates_refused) << ", dropped positions read " << v(f.dropped_reads) << ")\n"
            << "  prefix cache: inserts " << v(f.prefix_inserts) << " (" << v(f.prefix_added)
            << " entries added), attaches " << v(f.prefix_attaches) << " (" << v(f.prefix_attached_tokens)
            << " tokens attached and checked; " << v(f.prefix_adopted) << " written on), clears " << v(f.prefix_clears)
            << ", tracks " << v(f.prefix_tracks) << " (each layout has its own pool and prefix cache)\n"
            << "  generations (caches, forks, arena regions, sequences): " << v(f.generations) << "\n"
            << "  distinct epochs observed: " << v(f.epochs) << "\n"
            << "  snapshots verified: layer " << v(f.layer_snapshots) << ", arena " << v(f.arena_snapshots)
            << ", sequence " << v(f.seq_snapshots) << " (and " << v(f.hot_pins)
            << " pinned in tight loops, layers compared), writers' read-your-writes " << v(f.writer_checks)
            << ", kept and rechecked " << v(f.retained_checks) << "; async reads " << v(f.async_reads)
            << "; tokens decoded " << v(f.tokens_checked) << "\n";
}

int finish_failed(const options& o) {
  std::lock_guard lock(g_verdict.mutex);
  std::cout.flush();
  std::cerr << "stress FAILED seed=" << o.seed << " (" << g_verdict.count << " failure(s); replay with --seed "
            << o.seed << " --writers " << o.writers << " --readers " << o.readers << " --sequences " << o.sequences
            << " --threads " << o.threads << "), first:\n"
            << g_verdict.first;
  return 1;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  g_verdict.seed = o.seed;
  std::cout << "stress: seed=" << o.seed << " seconds=" << o.seconds << std::endl;
  const auto began = std::chrono::steady_clock::now();
  std::size_t pool_blocks_after = 0, seq_pool_blocks_after = 0, layer_peak = 0, seq_peak = 0;
  kv_prefix_stats prefix_after;
  {
    asio::thread_pool io(o.threads);
    layer_world lw(io, o.writers, o.seed);
    seq_world sw(io, o.sequences);
    lw.make_arena();
    rng seeds(o.seed);
    auto done = [](const std::exception_ptr& e) {
      if (e) fail("a writer coroutine threw");
      g_writers.leave();
    };
    for (std::size_t j = 0; j < o.writers; ++j)
      g_writers.enter(), asio::co_spawn(io, lineage(lw, j, rng(seeds.next())), done);
    for (std::size_t j = 0; j < o.sequences; ++j)
      g_writers.enter(), asio::co_spawn(io, seq_lineage(sw, j, rng(seeds.next())), done);
    std::vector<std::thread> readers;
    for (std::size_t i = 0; i < o.readers; ++i)
      readers.emplace_back([&lw, &sw, seed = seeds.next()] { reader(lw, sw, seed).run(); });

    // The run's length (and an early end on failure); then every writer
    // must finish its current requests, within a bound (a lost completion
    // would hang it).
    const auto deadline = began + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                      std::chrono::duration<double>(o.seconds));
    bool writers_done = false;
    {
      std::unique_lock lock(g_verdict.mutex);
      g_verdict.changed.wait_until(lock, deadline, [] { return g_verdict.failed.load(); });
      g_verdict.stop.store(true);
      writers_done =
          g_verdict.changed.wait_for(lock, std::chrono::seconds(60), [] { return g_writers.running.load() == 0; });
    }
    for (std::thread& t : readers) t.join();
    if (!writers_done) {
      fail(str(g_writers.running.load(), " writer(s) still running 60 s after the stop: a completion was lost"));
      finish_failed(o);
      std::_Exit(1);  // the pool cannot be joined
    }
    io.join();

    for (claim& c : sw.open_claims)
      if (judge(c.target->hist, c.found) != 1) fail(failed_claim(c) + " (or never resolved)");
    sw.open_claims.clear();
    lw.live.clear();
    sw.live.clear();
    lw.current_arena.reset();
    // Every sequence gone, every entry must be idle; the clear then gives
    // their blocks back.
    for (std::size_t k = 0; k < sw.pools.size(); ++k) {
      const kv_prefix_stats s = sw.prefixes[k].stats();
      if (s.idle_blocks != s.cached_blocks)
        fail(str("prefix cache ", k, " after teardown: ", s.cached_blocks, " entries, only ", s.idle_blocks, " idle"));
      const kv_pool_stats p = sw.pools[k].stats();
      if (p.blocks_cached_idle != p.blocks_cached)
        fail(str("pool ", k, " after teardown: ", p.blocks_cached, " cached blocks, only ", p.blocks_cached_idle,
                 " idle"));
      prefix_after.cached_blocks += s.cached_blocks;
      prefix_after.evicted_blocks += s.evicted_blocks;
      prefix_after.window_evictions += s.window_evictions;
      prefix_after.hit_tokens += s.hit_tokens;
      prefix_after.query_tokens += s.query_tokens;
      sw.prefixes[k].clear();
      seq_peak += p.peak_blocks_in_use;
      seq_pool_blocks_after += sw.pools[k].stats().blocks_in_use;
    }
    layer_peak = lw.pool.stats().peak_blocks_in_use;
    pool_blocks_after = lw.pool.stats().blocks_in_use;
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  print_figures(o, elapsed);
  std::cout << "  prefix cache at the end: " << prefix_after.cached_blocks << " entries, "
            << prefix_after.evicted_blocks << " evicted by appends (and " << prefix_after.window_evictions
            << " windowed parts), hit rate " << prefix_after.hit_tokens << "/" << prefix_after.query_tokens
            << " tokens\n";
  std::cout << "  teardown: layer pool blocks_in_use " << pool_blocks_after << " (peak " << layer_peak
            << "), sequence pool blocks_in_use " << seq_pool_blocks_after << " (peak " << seq_peak << "), pools alive "
            << ghostlink::detail::pools_alive() << ", destroyed unbalanced "
            << ghostlink::detail::pools_destroyed_unbalanced() << "\n";
  if (pool_blocks_after != 0 || seq_pool_blocks_after != 0)
    fail(str("blocks still in use after teardown: layer pool ", pool_blocks_after, ", sequence pool ",
             seq_pool_blocks_after));
  if (ghostlink::detail::pools_alive() != 0 || ghostlink::detail::pools_destroyed_unbalanced() != 0)
    fail(str(ghostlink::detail::pools_alive(), " block pool(s) alive after teardown, ",
             ghostlink::detail::pools_destroyed_unbalanced(), " destroyed with blocks counted in use"));
  if (g_verdict.failed.load()) return finish_failed(o);
  std::cout << "stress passed seed=" << o.seed << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "stress: " << e.what() << std::endl;
  return 2;
}
