// The first server of test_prefix_write_back's restart: a write-back prefix
// cache on a kv_file_store in <dir>, holding the entries of store_writer's
// run 0 (tests/store/store_writer.hpp: its geometry, tokens and data),
// flushed with async_flush before it exits, as a server shuts down. Nothing
// is ever evicted, so only the flush can have stored them. Prints
// "flushed <entries put>" and exits 0 when the flush completed without an
// error.
//
// Usage: prefix_writer <dir>
#include <ghostlink/kv_cache.hpp>
#include <ghostlink/prefix_cache.hpp>

#include "common/asio_compat.hpp"

#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>

#include "store/store_writer.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fputs("usage: prefix_writer <dir>\n", stderr);
    return 2;
  }
  try {
    using namespace ghostlink;
    namespace w = ghostlink::test::store_writer;
    asio::thread_pool threads(2);
    auto store = std::make_shared<kv_file_store>(std::filesystem::path(argv[1]));
    kv_block_pool pool = kv_block_pool::for_caches<float>(w::config(), {.max_blocks = 4096});
    kv_prefix_cache cache(w::layers, w::config(), pool,
                          {.model = "restart", .store = store, .store_policy = kv_store_policy::write_back});
    sequence_kv_cache seq(threads, w::layers, w::config(), pool);
    w::fill(seq, w::tokens(0));
    if (cache.insert_stored_tokens(seq) != w::length / w::config().block_tokens) return 1;
    cache.async_flush(asio::use_future).get();  // throws the error, if any; completes once the files are written
    std::printf("flushed %llu\n", static_cast<unsigned long long>(cache.stats().store_puts));
    threads.join();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "prefix_writer: %s\n", e.what());
    return 1;
  }
}
