#include "ghostlink/layer_kv_cache.hpp"

#include <ostream>

namespace ghostlink {

kv_block_pool::kv_block_pool(std::size_t block_bytes, kv_pool_limits limits) {
  const std::size_t by_bytes = block_bytes == 0 ? 0 : limits.max_bytes / block_bytes;
  const std::size_t max_blocks = limits.max_blocks < by_bytes ? limits.max_blocks : by_bytes;
  if (block_bytes == 0 || block_bytes % 2 != 0 || max_blocks == 0)
    throw std::system_error(make_error_code(kv_errc::invalid_config));
  state_ = detail::ref_ptr<detail::block_pool>::adopt(new detail::block_pool(block_bytes, max_blocks));
}

kv_pool_stats kv_block_pool::stats() const noexcept {
  const detail::block_pool& p = *state_;
  kv_pool_stats s;
  s.block_bytes = p.payload_bytes();
  s.max_blocks = p.max_blocks();
  s.blocks_in_use = p.blocks_in_use();
  s.blocks_free = p.blocks_free();
  s.peak_blocks_in_use = p.peak_blocks_in_use();
  s.blocks_shared = p.blocks_shared();
  s.cow_copies = p.cow_copies();
  s.blocks_allocated = p.blocks_allocated();
  return s;
}

namespace detail {

std::ostream& print_cache(std::ostream& os, const actor& a) {
  return os << "layer_kv_cache{config=" << a.config() << ", size=" << a.size() << '}';
}

}  // namespace detail
}  // namespace ghostlink
