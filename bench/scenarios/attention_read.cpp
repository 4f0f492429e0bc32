// attention_read: per decode step, read tokens [0, R) and compute that
// step's attention (q . k for every token, softmax, weighted sum of v).
// ghostlink feeds the kernel straight from its blocks (for_each_block);
// rwlock_zero_copy straight from its buffer under the shared lock; the
// other baselines copy the range out first, as their read does. With
// --read-tokens 8192 this is attention_long.
#include <ghostlink/kv_cache.hpp>

#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <asio/use_future.hpp>

#include <thread>

#include "../baselines/locked_cache.hpp"
#include "../baselines/strand_cache.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

/// Fills `write` (a callable taking (index, token)) with R tokens.
template <class Write>
void fill(const options& o, Write write) {
  for (std::size_t i = 0; i < o.read_tokens; ++i) write(i, token(o.config().token_width(), i));
}

}  // namespace

void attention_read(const options& o, report& out) {
  out.run("attention_read", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "steps", "attention steps", "steps/s");

    if (o.wants("ghostlink")) {
      asio::io_context io;
      layer_kv_cache cache(io, o.config());
      cache.async_initialize(1, [](std::error_code) {});
      std::vector<token> data;
      std::vector<kv_write> batch;
      fill(o, [&](std::size_t, token t) { data.push_back(std::move(t)); });
      for (std::size_t i = 0; i < data.size(); ++i) batch.push_back({i, data[i].keys, data[i].values});
      cache.async_write_batch(batch, [](std::error_code) {});
      io.run();
      rate.values["ghostlink"] = ops_per_second(o.seconds, [&](std::size_t) {
        attention a(o.heads, o.head_dim);
        a.over(cache.snapshot(), o.read_tokens);
        keep(a.checksum());
      });
    }
    auto locked = [&](auto& cache) {
      cache.initialize(1);
      fill(o, [&](std::size_t i, const token& t) { cache.write(i, t.keys, t.values); });
      kv_range r;
      return ops_per_second(o.seconds, [&](std::size_t) {
        attention a(o.heads, o.head_dim);
        cache.read_range(0, o.read_tokens, r);
        a.over(r.keys, r.values);
        keep(a.checksum());
      });
    };
    if (o.wants("rwlock_zero_copy")) {
      rwlock_cache c(o.config());
      c.initialize(1);
      fill(o, [&](std::size_t i, const token& t) { c.write(i, t.keys, t.values); });
      rate.values["rwlock_zero_copy"] = ops_per_second(o.seconds, [&](std::size_t) {
        attention a(o.heads, o.head_dim);
        c.visit_range(0, o.read_tokens, [&](auto k, auto v) { a.over(k, v); });
        keep(a.checksum());
      });
    }
    if (o.wants("rwlock")) {
      rwlock_cache c(o.config());
      rate.values["rwlock"] = locked(c);
    }
    if (o.wants("mutex")) {
      mutex_cache c(o.config());
      rate.values["mutex"] = locked(c);
    }
    if (o.wants("strand_only")) {
      asio::io_context io;
      auto work = asio::make_work_guard(io);
      std::thread runner([&] { io.run(); });
      strand_cache cache(io.get_executor(), o.config());
      cache.async_initialize(1, asio::use_future).get();
      std::vector<token> data;
      fill(o, [&](std::size_t, token t) { data.push_back(std::move(t)); });
      for (std::size_t i = 0; i < data.size(); ++i)
        cache.async_write(i, data[i].keys, data[i].values, asio::use_future).get();
      kv_range r;
      rate.values["strand_only"] = ops_per_second(o.seconds, [&](std::size_t) {
        attention a(o.heads, o.head_dim);
        cache.async_read_range(0, o.read_tokens, r, asio::use_future).get();
        a.over(r.keys, r.values);
        keep(a.checksum());
      });
      work.reset();
      runner.join();
    }
  });
}

}  // namespace ghostlink::bench
