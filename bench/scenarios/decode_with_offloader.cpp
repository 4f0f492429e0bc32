// decode_with_offloader: L layers x B sequences prefilled with 2048 tokens
// each (untimed), decoded layer by layer (write the token, attend over the
// whole context) from T threads, while one background thread offloads
// every cache once per second, as an offloader or checkpointer does: a pass
// over all caches, then a wait for the next second. The lock design copies
// each cache out under its shared lock, then checksums the copy; ghostlink
// (one sequence of L layers per sequence, decoded through steps: a begin,
// per layer write() and an attend over snapshot(l), a commit) checksums
// straight from each layer's snapshot's blocks. Reported: decode steps/s,
// the p50/p99 time between two tokens of one sequence (TPOT), and the bytes
// the offloader checksummed per second.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <atomic>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

#include <xxhash.h>

#include "../baselines/locked_cache.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

constexpr std::size_t context = 2048;
constexpr std::size_t decode_room = 1024;  // steps a run may take (about 30 a second at the default shape)

/// What both offloaders compute over the bytes they move: XXH3, 64 bits,
/// chained over the spans.
std::uint64_t checksum(std::span<const float> data, std::uint64_t seed) {
  return XXH3_64bits_withSeed(data.data(), data.size_bytes(), seed);
}

struct outcome {
  double steps_per_s = 0, offloaded_bytes_per_s = 0;
  latencies tpot;
};

/// Phase length: at least three offloader passes.
double phase_seconds(const options& o) { return o.quick ? o.seconds : std::max(o.seconds, 3.0); }

kv_cache_config offload_config(const options& o) {
  kv_cache_config c = o.config();
  c.max_tokens_per_seq = context + decode_room;
  return c;
}

/// The offloader: passes over `caches` (a callable offloading cache i and
/// returning its bytes) once per second until `stop`.
template <class Offload>
void offloader(std::size_t caches, const std::atomic<bool>& stop, Offload offload, double& bytes_per_s) {
  const auto t0 = clock_type::now();
  double bytes = 0;
  for (int pass = 1; !stop.load(std::memory_order_relaxed); ++pass) {
    for (std::size_t i = 0; i < caches && !stop.load(std::memory_order_relaxed); ++i) bytes += double(offload(i));
    const auto next = t0 + std::chrono::seconds(pass);
    while (!stop.load(std::memory_order_relaxed) && clock_type::now() < next)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // pacing, not synchronisation
  }
  bytes_per_s = bytes / seconds_since(t0);
}

/// The timed phase: starts the decoders (`start`), lets them run while the
/// offloader runs, stops both and waits for them (`join`, then `off`);
/// fills `out` from every sequence's progress.
template <class Start, class Join>
void timed_phase(const options& o, std::atomic<bool>& stop, std::thread& off, const std::vector<progress>& seqs,
                 Start start, Join join, outcome& out) {
  const auto t0 = clock_type::now();
  start();
  while (seconds_since(t0) < phase_seconds(o)) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  stop = true;
  join();
  const double elapsed = seconds_since(t0);
  off.join();
  const std::size_t tokens = add_tpot(seqs, out.tpot);
  out.steps_per_s = double(tokens) / double(seqs.size()) / elapsed;
}

/// Decode steps of `seq` through sequence steps: one begin request, per
/// layer write() then attend over snapshot(l), one commit request.
asio::awaitable<void> decode(const options& o, sequence_kv_cache& seq, const std::vector<token>& data,
                             const std::atomic<bool>& stop, progress& done) {
  for (std::size_t step = context; !stop.load(std::memory_order_relaxed) && step < context + decode_room; ++step) {
    const token& t = data[step % data.size()];
    const auto open = co_await seq.async_begin_step(1, asio::use_awaitable);
    for (std::size_t l = 0; l < o.layers; ++l) {
      keep(float(open.write(l, t.keys, t.values).value()));
      attention a(o.heads, o.head_dim);
      a.over(open.snapshot(l), step + 1);
      keep(a.checksum());
    }
    co_await open.async_commit(asio::use_awaitable);
    done.tick();
  }
}

outcome run_ghostlink(const options& o, const std::vector<token>& data) {
  asio::thread_pool pool(o.threads);
  // The prefill: one append of `context` tokens per sequence.
  std::vector<float> keys, values;
  for (std::size_t i = 0; i < context; ++i) {
    const token& t = data[i % data.size()];
    keys.insert(keys.end(), t.keys.begin(), t.keys.end());
    values.insert(values.end(), t.values.begin(), t.values.end());
  }
  const std::vector<std::span<const float>> key_spans(o.layers, keys), value_spans(o.layers, values);
  std::vector<sequence_kv_cache> seqs;
  seqs.reserve(o.sequences);
  for (std::size_t s = 0; s < o.sequences; ++s) {
    seqs.emplace_back(pool, o.layers, offload_config(o));
    seqs.back().async_append(key_spans, value_spans, asio::use_future).get();
  }

  outcome out;
  std::atomic<bool> stop{false};
  std::thread off([&] {
    offloader(
        o.sequences * o.layers, stop,
        [&](std::size_t i) {
          const kv_snapshot snap = seqs[i / o.layers].layer(i % o.layers).snapshot();
          std::uint64_t h = 0;
          snap.for_each_block(0, snap.size(),
                              [&](std::size_t, std::size_t, auto k, auto v) { h = checksum(v, checksum(k, h)); });
          keep(float(h & 0xff));
          return 2 * snap.size() * snap.token_width() * sizeof(float);
        },
        out.offloaded_bytes_per_s);
  });
  std::vector<progress> done(o.sequences);
  std::vector<std::future<void>> running;
  timed_phase(
      o, stop, off, done,
      [&] {
        for (std::size_t s = 0; s < o.sequences; ++s)
          running.push_back(asio::co_spawn(pool, decode(o, seqs[s], data, stop, done[s]), asio::use_future));
      },
      [&] {
        for (auto& f : running) f.get();
      },
      out);
  return out;
}

outcome run_locked(const options& o, const std::vector<token>& data) {
  std::vector<std::vector<std::unique_ptr<rwlock_cache>>> seqs(o.sequences);
  for (auto& layers : seqs)
    for (std::size_t l = 0; l < o.layers; ++l) {
      layers.push_back(std::make_unique<rwlock_cache>(offload_config(o)));
      layers.back()->initialize(1);
      for (std::size_t i = 0; i < context; ++i)
        layers.back()->write(i, data[i % data.size()].keys, data[i % data.size()].values);
    }
  outcome out;
  std::atomic<bool> stop{false};
  std::thread off([&] {
    kv_range copy;
    offloader(
        o.sequences * o.layers, stop,
        [&](std::size_t i) {
          rwlock_cache& c = *seqs[i / o.layers][i % o.layers];
          c.read_range(0, c.size(), copy);  // copied out under the shared lock
          keep(float(checksum(copy.values, checksum(copy.keys, 0)) & 0xff));
          return (copy.keys.size() + copy.values.size()) * sizeof(float);
        },
        out.offloaded_bytes_per_s);
  });
  std::vector<progress> done(o.sequences);
  auto decode_from = [&](std::size_t first_seq) {
    // Round robin over this thread's sequences, one step each, as the pool
    // interleaves ghostlink's coroutines.
    for (std::size_t step = context; !stop.load(std::memory_order_relaxed) && step < context + decode_room; ++step)
      for (std::size_t s = first_seq; s < o.sequences; s += o.threads) {
        for (auto& cache : seqs[s]) {
          const token& t = data[step % data.size()];
          cache->write(step, t.keys, t.values);
          attention a(o.heads, o.head_dim);
          cache->visit_range(0, step + 1, [&](auto k, auto v) { a.over(k, v); });
          keep(a.checksum());
        }
        done[s].tick();
      }
  };
  std::vector<std::thread> workers;
  timed_phase(
      o, stop, off, done,
      [&] {
        for (std::size_t t = 0; t < o.threads; ++t) workers.emplace_back(decode_from, t);
      },
      [&] {
        for (auto& w : workers) w.join();
      },
      out);
  return out;
}

}  // namespace

void decode_with_offloader(const options& o, report& out) {
  std::vector<token> data = tokens_for(o, 256);
  out.run("decode_with_offloader", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "1 steps", "decode steps, offloader running", "steps/s");
    metric& p50 = declare(m, "2 p50", "TPOT p50", "ns", false);
    metric& p99 = m["3 p99"];
    p99 = p50;
    p99.name = "TPOT p99";
    metric& bytes = declare(m, "4 bytes", "offloaded", "bytes/s");
    auto record = [&](const std::string& impl, outcome r) {
      rate.values[impl] = r.steps_per_s;
      p50.values[impl] = r.tpot.p(0.5);
      p99.values[impl] = r.tpot.p(0.99);
      bytes.values[impl] = r.offloaded_bytes_per_s;
    };
    if (o.wants("ghostlink")) record("ghostlink", run_ghostlink(o, data));
    if (o.wants("rwlock_zero_copy")) record("rwlock_zero_copy", run_locked(o, data));
  });
  out.add_note("decode_with_offloader",
               std::to_string(o.layers) + " layers x " + std::to_string(o.sequences) +
                   " sequences, 2048-token contexts, " + std::to_string(o.threads) +
                   " decode threads + 1 offloader thread passing over every cache once a second; "
                   "the lock copies under its shared lock then checksums, ghostlink checksums "
                   "from a snapshot");
}

}  // namespace ghostlink::bench
