// read_under_write: one thread copies tokens [0, R) out in a loop while
// another writes single tokens as fast as it can, and each side alone for
// reference. The cache is full (all N tokens stored) and the writer
// overwrites tokens in [R, N) cyclically, so ghostlink copies a block per
// drain that touches it (copy-on-write keeps every published epoch
// intact). "As fast as it can": the locked baselines call write() in a
// loop; ghostlink's writer keeps 64 single-token writes in flight.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <functional>
#include <thread>

#include "../baselines/locked_cache.hpp"
#include "../baselines/strand_cache.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

struct phase_result {
  latencies reads;
  double reads_per_s = 0, writes_per_s = 0;
};

/// Index of the writer's i-th write: cycles over [R, N).
std::size_t write_index(const options& o, std::size_t i) {
  const std::size_t span = o.tokens - o.read_tokens;
  return span == 0 ? 0 : o.read_tokens + i % span;
}

template <class Read>
void reader_loop(const options& o, phase_result& r, Read read) {
  r.reads_per_s = ops_per_second(o.seconds, [&](std::size_t) {
    const auto s = clock_type::now();
    read();
    r.reads.add(s);
  });
}

/// Runs the reader and/or writer for one phase; `writer` runs on its own
/// thread and returns its writes per second.
template <class Read, class Writer>
phase_result phase(const options& o, bool with_reader, bool with_writer, Read read, Writer writer) {
  phase_result r;
  std::thread w;
  if (with_writer) w = std::thread([&] { r.writes_per_s = writer(); });
  if (with_reader) reader_loop(o, r, read);
  if (w.joinable()) w.join();
  return r;
}

struct scenario_result {
  phase_result alone_read, alone_write, both;
};

template <class Read, class Writer>
scenario_result three_phases(const options& o, Read read, Writer writer) {
  return {phase(o, true, false, read, writer), phase(o, false, true, read, writer), phase(o, true, true, read, writer)};
}

scenario_result run_ghostlink(const options& o) {
  asio::io_context io;
  layer_kv_cache cache(io, o.config());
  const std::size_t width = o.config().token_width();
  std::vector<token> data;
  for (std::size_t i = 0; i < o.tokens; ++i) data.emplace_back(width, i);
  std::vector<kv_write> fill;
  for (std::size_t i = 0; i < o.tokens; ++i) fill.push_back({i, data[i].keys, data[i].values});
  cache.async_initialize(1, asio::use_future);
  auto filled = cache.async_write_batch(fill, asio::use_future);
  io.run();
  filled.get();

  std::vector<float> keys(o.read_tokens * width), values(keys.size());
  auto read = [&] { cache.snapshot().read_range(0, o.read_tokens, keys, values); };
  auto writer = [&] {
    // The writer keeps `in_flight` writes outstanding (each completion
    // starts the next), on `io`, run by this thread alone with the cache's
    // strand: an async writer going as fast as it can.
    constexpr std::size_t in_flight = 64;
    std::size_t started = 0, completed = 0;
    const auto t0 = clock_type::now();
    std::function<void()> start_one = [&] {
      const std::size_t i = started++;
      const token& t = data[write_index(o, i)];
      cache.async_write(write_index(o, i), t.keys, t.values, [&](std::error_code) {
        ++completed;
        if (seconds_since(t0) < o.seconds) start_one();
      });
    };
    for (std::size_t k = 0; k < in_flight; ++k) start_one();
    io.restart();
    io.run();
    return double(completed) / seconds_since(t0);
  };
  return three_phases(o, read, writer);
}

template <class Cache>
scenario_result run_locked(const options& o) {
  Cache cache(o.config());
  const std::size_t width = o.config().token_width();
  cache.initialize(1);
  std::vector<token> data;
  for (std::size_t i = 0; i < o.tokens; ++i) {
    data.emplace_back(width, i);
    cache.write(i, data[i].keys, data[i].values);
  }
  kv_range out;
  auto read = [&] { cache.read_range(0, o.read_tokens, out); };
  auto writer = [&] {
    return ops_per_second(o.seconds, [&](std::size_t i) {
      const token& t = data[write_index(o, i)];
      cache.write(write_index(o, i), t.keys, t.values);
    });
  };
  return three_phases(o, read, writer);
}

}  // namespace

void read_under_write(const options& o, report& out) {
  out.run("read_under_write", o, [&](std::map<std::string, metric>& m) {
    metric& w_alone = declare(m, "1", "writer alone", "writes/s");
    metric& w_both = declare(m, "2", "writer with reader", "writes/s");
    metric& keep = declare(m, "3", "writer kept with reader", "%");
    metric& r_p50_alone = declare(m, "4", "reader alone p50", "us", false);
    metric& r_p50 = declare(m, "5", "reader with writer p50", "us", false);
    metric& r_p99 = declare(m, "6", "reader with writer p99", "us", false);
    metric& r_rate = declare(m, "7", "reader with writer", "reads/s");
    auto record = [&](const std::string& impl, scenario_result r) {
      w_alone.values[impl] = r.alone_write.writes_per_s;
      w_both.values[impl] = r.both.writes_per_s;
      keep.values[impl] = r.alone_write.writes_per_s > 0 ? 100 * r.both.writes_per_s / r.alone_write.writes_per_s : 0;
      r_p50_alone.values[impl] = r.alone_read.reads.p(0.5) / 1e3;
      r_p50.values[impl] = r.both.reads.p(0.5) / 1e3;
      r_p99.values[impl] = r.both.reads.p(0.99) / 1e3;
      r_rate.values[impl] = r.both.reads_per_s;
    };
    if (o.wants("ghostlink")) record("ghostlink", run_ghostlink(o));
    if (o.wants("rwlock")) record("rwlock", run_locked<rwlock_cache>(o));
    if (o.wants("mutex")) record("mutex", run_locked<mutex_cache>(o));
  });
  out.add_note("read_under_write",
               "writer overwrites published tokens; ghostlink keeps 64 writes in flight (write_single "
               "has one at a time); strand_only omitted: its reads and writes share one thread by design");
}

}  // namespace ghostlink::bench
