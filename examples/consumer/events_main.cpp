// A consumer of ghostlink-events, compiled with nothing but its dependency
// or target (ZeroMQ comes through it): a prefix cache whose events go out
// on a loopback port, and a dump of its one entry.
#include <ghostlink/event_publisher.hpp>
#include <ghostlink/prefix_cache.hpp>

#include <cstdio>

int main() {
  const ghostlink::kv_cache_config config{.max_tokens_per_seq = 16, .num_heads = 1, .head_dim = 4, .block_tokens = 4};
  ghostlink::kv_block_pool pool = ghostlink::kv_block_pool::for_caches(config, {.max_blocks = 16});
  ghostlink::kv_prefix_cache cache(1, config, pool);
  ghostlink::kv_event_publisher publisher(cache, {.endpoint = "tcp://127.0.0.1:*"});
  std::printf("events_consumer (%s): publishing on %s, %zu entries\n",
              GHOSTLINK_ASIO_BOOST ? "Boost.Asio" : "standalone Asio", publisher.endpoint().c_str(),
              cache.dump().entries.size());
  return publisher.endpoint().starts_with("tcp://127.0.0.1:") ? 0 : 1;
}
