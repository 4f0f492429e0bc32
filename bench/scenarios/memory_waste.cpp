// memory_waste: 256 sequences of random lengths 1..N (N = 8192) on one
// pool; waste = bytes of storage held - bytes of the valid tokens' keys and
// values, as a share of the bytes held. Storage is counted twice: the
// pool's blocks, and everything the heap holds for the caches (page tables,
// epochs, actors included), from glibc's mallinfo2, plus what the pool
// holds in pages it reserves itself (kv_pool_stats::bytes_allocated),
// which the heap does not see. The seed's design
// preallocates N tokens per sequence.
#include <ghostlink/kv_cache.hpp>

#include <asio/io_context.hpp>

#include <malloc.h>

#include <random>

#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

double heap_bytes() {
  const struct mallinfo2 mi = mallinfo2();
  return double(mi.uordblks + mi.hblkhd);
}

std::size_t sequences(const options& o) { return o.quick ? 16 : 256; }

}  // namespace

void memory_waste(const options& o, report& out) {
  const std::size_t width = o.config().token_width();
  const token t(width, 7);
  std::vector<float> keys, values;  // o.tokens of t, token-major
  for (std::size_t i = 0; i < o.tokens; ++i) {
    keys.insert(keys.end(), t.keys.begin(), t.keys.end());
    values.insert(values.end(), t.values.begin(), t.values.end());
  }

  out.run("memory_waste", o, [&](std::map<std::string, metric>& m) {
    std::mt19937_64 rng(42);
    std::vector<std::size_t> lengths(sequences(o));
    for (auto& n : lengths) n = std::uniform_int_distribution<std::size_t>(1, o.tokens)(rng);
    double valid = 0;
    for (std::size_t n : lengths) valid += double(n * width * 2 * sizeof(float));

    metric& blocks =
        declare(m, "blocks", std::to_string(lengths.size()) + " seqs 1.." + std::to_string(o.tokens) + ", blocks",
                "% waste", false);
    metric& heap = declare(m, "heap", std::to_string(lengths.size()) + " seqs, whole heap", "% waste", false);

    if (o.wants("ghostlink")) {
      asio::io_context io;
      const double before = heap_bytes();
      const auto pool = kv_block_pool::for_caches(o.config());
      std::vector<sequence_kv_cache> seqs;
      // One append of n tokens per sequence; the spans live until io.run() returns.
      std::vector<std::span<const float>> spans;
      spans.reserve(2 * lengths.size());
      for (std::size_t n : lengths) {
        seqs.emplace_back(io, 1, o.config(), pool);
        spans.push_back(std::span<const float>(keys).first(n * width));
        spans.push_back(std::span<const float>(values).first(n * width));
        seqs.back().async_append(std::span(spans).last(2).first(1), std::span(spans).last(1), [](std::error_code) {});
      }
      io.run();
      const double held = double(pool.stats().bytes_in_use());
      blocks.values["ghostlink"] = 100.0 * (held - valid) / held;
      const double all = heap_bytes() - before + double(pool.stats().bytes_allocated);
      heap.values["ghostlink"] = 100.0 * (all - valid) / all;
    }
    if (o.wants("rwlock")) {
      const double held = double(lengths.size() * o.tokens * width * 2 * sizeof(float));
      blocks.values["rwlock"] = heap.values["rwlock"] = 100.0 * (held - valid) / held;
    }
  });
  out.add_note("memory_waste", "rwlock: the seed preallocates max_tokens_per_seq tokens per sequence");
}

}  // namespace ghostlink::bench
