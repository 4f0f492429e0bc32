// Built with one flavour's define and linked against a library: links only
// against the library of the same flavour (check_mismatch.py).
#include <ghostlink/kv_cache.hpp>

int main() {
  const auto pool = ghostlink::kv_block_pool::for_caches(ghostlink::kv_cache_config{}, {.max_blocks = 4});
  return pool.stats().max_blocks == 4 ? 0 : 1;
}
