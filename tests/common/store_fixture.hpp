#pragma once
// A file store under a prefix cache, on pools of their own (test_block_store,
// test_store_tier).

#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <ghostlink/block_store.hpp>
#include <ghostlink/prefix_cache.hpp>

#include "common/files.hpp"
#include "common/prefix_support.hpp"

namespace ghostlink::test::prefix {

/// A file store on its own I/O pool, under a prefix cache of 2 layers; the
/// pools are joined before anything is destroyed, so no job of the store
/// outlives the test's pool.
struct store_fixture {
  explicit store_fixture(kv_file_store_limits limits = {}, kv_store_policy policy = kv_store_policy::write_through,
                         std::size_t max_blocks = 1000, std::string model = "model-a", std::size_t layers = 2)
      : store(make_store(dir.path, std::move(limits))),
        pool(kv_block_pool::for_caches<float>(config(), {.max_blocks = max_blocks})),
        cache(layers, config(), pool, {.model = std::move(model), .store = store, .store_policy = policy}) {}
  store_fixture(const store_fixture&) = delete;
  store_fixture& operator=(const store_fixture&) = delete;
  ~store_fixture() {
    store->flush();
    io.join();
    threads.join();
  }

  std::shared_ptr<kv_file_store> make_store(const std::filesystem::path& where, kv_file_store_limits limits) {
    limits.io_executor = io.get_executor();
    return std::make_shared<kv_file_store>(where, std::move(limits));
  }

  /// A sequence holding `ids`, inserted (so written through), then let go of.
  std::size_t insert(std::span<const token_id> ids, std::string_view salt = {}) {
    sequence_kv_cache seq(threads, cache.num_layers(), config(), pool);
    REQUIRE(append(seq, ids) == ghostlink::error_code());
    const std::size_t added = cache.insert(seq, ids, salt);
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
    return added;
  }

  attach_result attach(std::span<const token_id> ids, kv_attach_options options = {}, std::string_view salt = {}) {
    attach_waiter done;
    cache.async_attach(threads.get_executor(), ids, salt, options, done.handler());
    return done.get();
  }

  /// The entry file of block `b` of `ids`.
  std::filesystem::path file_of(std::span<const token_id> ids, std::size_t b) const {
    return store->path_of(cache.block_hashes(ids)[b]);
  }

  ghostlink::test::temp_dir dir;
  asio::thread_pool io{2};
  asio::thread_pool threads{2};
  std::shared_ptr<kv_file_store> store;
  kv_block_pool pool;
  kv_prefix_cache cache;
};

}  // namespace ghostlink::test::prefix
