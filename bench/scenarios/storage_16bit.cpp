// storage_16bit: the same R tokens in a float, a half and a bfloat16 cache:
// the pool bytes each holds, and attention_read's step rate over each, fed
// zero-copy from the blocks (16-bit runs widened to floats a block at a
// time by ghostlink's bulk conversion).
#include <ghostlink/kv_cache.hpp>

#include <asio/io_context.hpp>

#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

template <class T>
void measure(const options& o, const std::vector<token>& data, metric& rate, metric& bytes, const char* name) {
  asio::io_context io;
  basic_layer_kv_cache<T> cache(io, o.config());
  cache.async_initialize(1, [](std::error_code) {});
  std::vector<kv_write> batch;
  for (std::size_t i = 0; i < data.size(); ++i) batch.push_back({i, data[i].keys, data[i].values});
  cache.async_write_batch(batch, [](std::error_code) {});
  io.run();
  bytes.values[name] = double(cache.pool().stats().bytes_in_use());
  const auto snap = cache.snapshot();
  rate.values[name] = ops_per_second(o.seconds, [&](std::size_t) {
    attention a(o.heads, o.head_dim);
    a.over(snap);  // it holds o.read_tokens tokens
    keep(a.checksum());
  });
}

}  // namespace

void storage_16bit(const options& o, report& out) {
  std::vector<token> data = tokens_for(o, o.read_tokens);
  out.run("storage_16bit", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "rate", "attention over " + std::to_string(o.read_tokens) + " tokens", "steps/s");
    metric& bytes = declare(m, "bytes", "pool bytes for them", "bytes", false);
    if (o.wants("ghostlink")) {
      measure<float>(o, data, rate, bytes, "ghostlink");
      measure<half>(o, data, rate, bytes, "half");
      measure<bfloat16>(o, data, rate, bytes, "bfloat16");
    }
  });
  out.add_note("storage_16bit", "ghostlink: float storage; half and bfloat16: the same tokens stored in 16 bits");
}

}  // namespace ghostlink::bench
