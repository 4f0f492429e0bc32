#include "ghostlink/layer_kv_cache.hpp"

#include <ostream>

namespace ghostlink {

layer_kv_cache::layer_kv_cache(asio::any_io_executor ex, kv_cache_config config)
    : actor_(std::make_shared<detail::actor>(std::move(ex), config)) {}

std::ostream& operator<<(std::ostream& os, const layer_kv_cache& cache) {
  return os << "layer_kv_cache{config=" << cache.config() << ", size=" << cache.size() << '}';
}

}  // namespace ghostlink
