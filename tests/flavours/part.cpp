// Compiled twice: once against ghostlink (standalone Asio), once against
// ghostlink-boost, into one executable (one_process.cpp).
#include "part.hpp"

#include <ghostlink/kv_cache.hpp>

#include "common/asio_compat.hpp"

#include <typeinfo>
#include <vector>

#if GHOSTLINK_ASIO_BOOST
#define PART_FUNCTION run_boost_part
#else
#define PART_FUNCTION run_standalone_part
#endif

std::string PART_FUNCTION(std::string& flavour) {
  using namespace ghostlink;
  flavour = typeid(kv_block_pool).name();
  asio::io_context io;
  kv_cache_config config;
  config.num_heads = 2;
  config.head_dim = 4;
  config.max_tokens_per_seq = 16;
  layer_kv_cache cache(io, config);
  std::vector<float> keys(config.token_width(), 1.5f), values(config.token_width(), -2.0f);
  ghostlink::error_code init_ec = kv_errc::invalid_config, write_ec = kv_errc::invalid_config;
  ghostlink::error_code bad_ec;
  cache.async_initialize(2, [&](ghostlink::error_code ec) { init_ec = ec; });
  cache.async_write(1, keys, values, [&](ghostlink::error_code ec) { write_ec = ec; });
  cache.async_write(99, keys, values, [&](ghostlink::error_code ec) { bad_ec = ec; });
  io.run();
  if (init_ec || write_ec) return "initialize or write failed: " + (init_ec ? init_ec : write_ec).message();
  if (bad_ec != kv_errc::index_out_of_range) return "a write past the end did not fail with index_out_of_range";
  kv_entry entry;
  if (const std::error_code ec = cache.snapshot().read_kv(1, entry)) return "read failed: " + ec.message();
  if (entry.keys != keys || entry.values != values) return "read back other data than written";
  return {};
}
