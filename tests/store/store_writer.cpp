// The process test_block_store kills in the middle of its writes: it saves
// one of two sequences to <dir>/saved.kv (async_save: a temporary file,
// fsync, rename), alternately, and writes every entry of the one it just
// saved through a durable kv_file_store in <dir>/store, over and over, until
// it is killed. After each save it prints "saved <n>" on standard output.
// Both sequences hold tokens whose keys and values follow from (layer,
// position, token id), as tests/common/prefix_support.hpp's key() says, so the
// test checks whatever it finds against them.
//
// Usage: store_writer <dir>
#include <ghostlink/kv_cache.hpp>
#include <ghostlink/persist.hpp>
#include <ghostlink/prefix_cache.hpp>

#include "common/asio_compat.hpp"

#include <cstdio>
#include <exception>
#include <filesystem>
#include <future>
#include <memory>
#include <stdexcept>
#include <vector>

#include "store_writer.hpp"

namespace {

[[noreturn]] void write_forever(const std::filesystem::path& dir) {
  using namespace ghostlink;
  namespace w = ghostlink::test::store_writer;
  asio::thread_pool threads(2);
  auto store = std::make_shared<kv_file_store>(dir / "store", kv_file_store_limits{.durable = true});
  kv_block_pool pool = kv_block_pool::for_caches<float>(w::config(), {.max_blocks = 4096});
  kv_prefix_cache cache(w::layers, w::config(), pool, {.model = "writer", .store = store});
  std::vector<sequence_kv_cache> seqs;
  for (std::size_t r = 0; r < 2; ++r) {
    seqs.emplace_back(threads, w::layers, w::config(), pool);
    w::fill(seqs.back(), w::tokens(r));
  }
  for (std::size_t n = 0;; ++n) {
    const sequence_kv_cache& seq = seqs[n % 2];
    std::promise<ghostlink::error_code> saved;
    async_save(seq.snapshot(), dir / "saved.kv", kv_save_options{.config = w::config(), .model = "writer"},
               [&](ghostlink::error_code ec) { saved.set_value(ec); });
    if (const ghostlink::error_code ec = saved.get_future().get()) throw std::runtime_error(ec.message());
    std::printf("saved %zu\n", n);
    std::fflush(stdout);
    cache.clear();
    cache.insert_stored_tokens(seq);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fputs("usage: store_writer <dir>\n", stderr);
    return 2;
  }
  try {
    write_forever(argv[1]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "store_writer: %s\n", e.what());
    return 1;
  }
}
