// memory: bytes held for L layer caches after writing 1, 100 and N tokens
// to each, ghostlink against the seed's preallocated buffers. Counted with
// glibc's mallinfo2 (heap in use plus mmapped chunks), as the difference
// from before the caches existed, plus what ghostlink's pools hold in pages
// they reserve themselves (kv_pool_stats::bytes_allocated: committed
// blocks and extent headers), which the heap does not see.
#include <ghostlink/kv_cache.hpp>

#include <asio/io_context.hpp>

#include <malloc.h>

#include <memory>

#include "../baselines/locked_cache.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

double held_bytes() {
  const struct mallinfo2 mi = mallinfo2();
  return double(mi.uordblks + mi.hblkhd);
}

double ghostlink_bytes(const options& o, std::size_t tokens, const std::vector<token>& data) {
  asio::io_context io;
  const double before = held_bytes();
  std::vector<layer_kv_cache> layers;
  std::vector<kv_write> batch;
  for (std::size_t i = 0; i < tokens; ++i) batch.push_back({i, data[i].keys, data[i].values});
  for (std::size_t l = 0; l < o.layers; ++l) {
    layers.emplace_back(io, o.config());
    layers.back().async_initialize(1, [](std::error_code) {});
    layers.back().async_write_batch(batch, [](std::error_code) {});
  }
  io.run();
  double pages = 0;
  for (const layer_kv_cache& layer : layers) pages += double(layer.pool().stats().bytes_allocated);
  return held_bytes() - before - double(batch.capacity() * sizeof(kv_write)) + pages;
}

double rwlock_bytes(const options& o, std::size_t tokens, const std::vector<token>& data) {
  const double before = held_bytes();
  std::vector<std::unique_ptr<rwlock_cache>> layers;
  for (std::size_t l = 0; l < o.layers; ++l) {
    layers.push_back(std::make_unique<rwlock_cache>(o.config()));
    layers.back()->initialize(1);
    for (std::size_t i = 0; i < tokens; ++i) layers.back()->write(i, data[i].keys, data[i].values);
  }
  return held_bytes() - before;
}

}  // namespace

void memory(const options& o, report& out) {
  std::vector<token> data = tokens_for(o, o.tokens);
  out.run("memory", o, [&](std::map<std::string, metric>& m) {
    int key = 0;
    for (std::size_t tokens : {std::size_t{1}, std::min<std::size_t>(100, o.tokens), o.tokens}) {
      metric& bytes =
          declare(m, std::to_string(key++),
                  std::to_string(o.layers) + " layers x " + std::to_string(tokens) + " tokens", "bytes", false);
      if (o.wants("ghostlink")) bytes.values["ghostlink"] = ghostlink_bytes(o, tokens, data);
      if (o.wants("rwlock")) bytes.values["rwlock"] = rwlock_bytes(o, tokens, data);
      bytes.values["payload"] = double(o.layers * tokens * o.config().token_width() * 2 * sizeof(float));
    }
  });
  out.add_note("memory", "payload: the bytes of keys and values written, for reference");
}

}  // namespace ghostlink::bench
