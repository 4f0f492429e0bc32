#pragma once
// What the Redis store's puts and fetches share, on one server or on a
// Redis Cluster (store.cpp): the keys, the SET command, the counters
// (and the puts flush() waits for), and a fetch's delivery to its handler.

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "ghostlink/block_store.hpp"
#include "ghostlink/error.hpp"
#include "store/counting.hpp"
#include "store/pending_puts.hpp"
#include "store/redis/connection.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

inline constexpr std::string_view redis_key_prefix = "ghostlink:v1:";

/// The key of an entry: `ghostlink:v1:<hash hex>`.
inline std::string redis_key(const kv_block_hash& hash) { return std::string(redis_key_prefix) + hash.hex(); }

/// `SET key value [EX ttl]`, the value encoded in place.
std::string redis_set_command(const kv_store_value& value, const std::optional<std::uint64_t>& ttl);

/// Whether a SET's reply says it stored (`+OK`).
inline bool redis_stored(const redis_reply& reply) noexcept {
  return reply.kind == redis_reply::type::status && reply.text() == "OK";
}

/// The counters, and the puts flush() and when_flushed() wait for.
class redis_counters {
 public:
  explicit redis_counters(std::size_t max_pending_bytes) : max_pending_bytes_(max_pending_bytes) {}

  /// Counts a put; its ticket, or 0 if it is dropped (over the pending
  /// bytes, or memory refused for its ticket).
  pending_puts::ticket begin_put(std::size_t size) noexcept {
    std::lock_guard lock(mutex_);
    ++stats_.puts;
    if (pending_bytes_ + size > max_pending_bytes_) {
      ++stats_.dropped;
      return 0;
    }
    try {
      const pending_puts::ticket t = puts_.add();
      pending_bytes_ += size;
      return t;
    } catch (...) {
      ++stats_.dropped;
      return 0;
    }
  }
  void finish_put(pending_puts::ticket t, std::size_t size, bool stored) noexcept {
    pending_puts::ready_list ready;
    {
      std::lock_guard lock(mutex_);
      ++(stored ? stats_.stored : stats_.write_errors);
      pending_bytes_ -= size;
      puts_.settle(t, ready);
      idle_.notify_all();
    }
    run_ready(ready);
  }
  void lookups(std::size_t n) noexcept {
    std::lock_guard lock(mutex_);
    stats_.lookups += n;
  }
  void hit() noexcept {
    std::lock_guard lock(mutex_);
    ++stats_.hits;
  }
  /// Records `e` as the last error (now); an auth or TLS failure is counted too.
  void error(kv_errc e) noexcept {
    std::lock_guard lock(mutex_);
    if (e == kv_errc::store_auth_failed) ++stats_.auth_errors;
    if (e == kv_errc::store_tls_failed) ++stats_.tls_errors;
    record_error(stats_, make_error_code(e));
  }
  /// Records an error reply other than an auth error (the connection
  /// records those): the server refusing the request (`-OOM`, `-LOADING`,
  /// `-CLUSTERDOWN`, ...) as `store_unavailable`.
  void refused(const redis_reply& reply) noexcept {
    if (reply.kind == redis_reply::type::error && !is_redis_auth_error(reply.text())) error(kv_errc::store_unavailable);
  }
  /// Counts a value larger than the cap (not an error: the cap is the caller's).
  void oversized() noexcept {
    std::lock_guard lock(mutex_);
    ++stats_.oversized;
  }
  /// The largest value read (limit_value_size()); no cap until set.
  std::uint64_t value_cap() const noexcept { return value_cap_.get(); }
  /// Raises the cap to `bytes` (the first call sets it; the largest holds).
  void limit_value_size(std::size_t bytes) noexcept { value_cap_.raise(bytes); }
  kv_store_stats stats() const noexcept {
    std::lock_guard lock(mutex_);
    kv_store_stats s = stats_;
    s.pending_bytes = pending_bytes_;
    return s;
  }
  void flush() { wait_settled(mutex_, idle_, puts_); }
  /// kv_block_store::when_flushed.
  void when_flushed(std::function<void()> done) { call_when_settled(mutex_, puts_, std::move(done)); }

 private:
  const std::size_t max_pending_bytes_;
  mutable std::mutex mutex_;
  std::condition_variable idle_;
  kv_store_stats stats_;
  std::size_t pending_bytes_ = 0;
  pending_puts puts_;
  value_size_cap value_cap_;
};

/// A fetch's handler, called until it says "no more".
struct fetch_request {
  explicit fetch_request(kv_block_store::fetch_handler f) : on_value(std::move(f)) {}
  kv_block_store::fetch_handler on_value;
  std::atomic<bool> stopped{false};

  void deliver(std::size_t i, std::vector<std::byte> bytes) noexcept {
    if (stopped.load(std::memory_order_acquire)) return;
    bool more = false;
    try {
      more = on_value(i, std::move(bytes));
    } catch (...) {
    }
    if (!more) stopped.store(true, std::memory_order_release);
  }
  /// Delivers a GET's reply to index `i`: a non-empty string is a hit,
  /// anything else (nil, an error, a failure, an oversized value) a miss.
  void answer(std::size_t i, redis_reply reply, redis_counters& counters) noexcept {
    counters.refused(reply);
    std::vector<std::byte> bytes;
    if (reply.kind == redis_reply::type::bulk && !reply.bytes.empty()) {
      counters.hit();
      bytes = std::move(reply.bytes);
    }
    deliver(i, std::move(bytes));
  }
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
