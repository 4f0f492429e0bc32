#pragma once
// The Redis store on a Redis Cluster (store.cpp): key slots, the
// slot -> master map read with CLUSTER SLOTS, one redis_node per master
// (made when first needed, keyed by host:port), and the redirects.
//
// A request goes to its slot's master as the map says (a seed, while the
// slot is unknown). `-MOVED slot host:port`: that slot is set to the node
// named, the whole map read again (one reading at a time), and the request
// sent there. `-ASK slot host:port`: `ASKING` and the request are sent back
// to back on one connection of the node named; the map is kept. At most
// `max_redis_redirects` redirects a request; beyond, and on any other
// error or failure, the request's callback gets that reply (a miss, a write
// error). A failure also reads the map again (a failover moves masters), at
// most once a reconnect backoff.
//
// State: the map and the nodes are guarded by `mutex_`, taken from any
// thread (the store's callers, the connections' strands); no request is
// sent while holding it.
//
// Every node's connections authenticate as the store's session says
// (session.hpp), those of a redirect's node and of a map reading too; the
// store is ready once a map is read. Callbacks hold the cluster; once closed, it makes
// no node and reads no map, so they end as their requests do.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "store/redis/connection.hpp"
#include "store/redis/node.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

inline constexpr std::size_t redis_slots = 16384;
inline constexpr unsigned max_redis_redirects = 5;
/// Nodes beyond this many are not made (a redirect to one fails): Redis
/// Cluster's own advice is 1000 masters at most.
inline constexpr std::size_t max_redis_nodes = 1000;

/// CRC16-CCITT in its XMODEM form (polynomial 0x1021, initial value 0, no
/// reflection), the one the Redis Cluster specification defines key slots
/// with ("Key distribution model"; crc16("123456789") = 0x31C3).
std::uint16_t redis_crc16(std::string_view bytes) noexcept;

/// The hash slot of `key`: crc16 mod 16384 of its hash tag (the bytes
/// between its first `{` and the first `}` after it, when there are any),
/// else of the whole key.
std::uint16_t redis_key_slot(std::string_view key) noexcept;

/// A `-MOVED` or `-ASK` error, parsed.
struct redis_redirect {
  bool ask = false;
  std::uint16_t slot = 0;
  std::string host{};  ///< empty: the host of the node that answered
  std::uint16_t port = 0;
};
/// The redirect an error reply's text names, if it names one.
std::optional<redis_redirect> parse_redis_redirect(std::string_view error);

/// One range of slots of a CLUSTER SLOTS reply, and its master.
struct redis_slot_range {
  std::uint16_t first = 0;
  std::uint16_t last = 0;
  std::string host{};  ///< empty: the host of the node that answered
  std::uint16_t port = 0;
};
/// The ranges of a CLUSTER SLOTS reply whose master is known; none if it is
/// not such a reply.
std::optional<std::vector<redis_slot_range>> parse_cluster_slots(const redis_reply& reply);

class redis_cluster : public std::enable_shared_from_this<redis_cluster> {
 public:
  /// A request for a slot: `command` (kept for a resend), and what receives
  /// its final reply, exactly once.
  struct routed {
    std::uint16_t slot = 0;
    redis_connection::shared_command command;
    redis_connection::callback done;
  };

  /// @throws std::invalid_argument if `seeds` is empty or names a unix socket.
  redis_cluster(asio::any_io_executor io, std::vector<kv_redis_endpoint> seeds,
                std::shared_ptr<const redis_session> session);
  redis_cluster(const redis_cluster&) = delete;
  redis_cluster& operator=(const redis_cluster&) = delete;
  ~redis_cluster();

  /// Reads the map from the seeds, in the background.
  void start() noexcept { refresh(); }
  /// Sends `requests`, pipelined: one post per connection used. A request
  /// that cannot be sent gets a failed reply on the I/O executor, never
  /// inside this call.
  /// @throws std::bad_alloc, having sent nothing.
  void send(std::vector<routed> requests);
  /// Closes every node once the requests on it are answered; makes no new one.
  void close() noexcept;

 private:
  using node_ptr = std::shared_ptr<redis_node>;

  node_ptr node_at(const std::string& host, std::uint16_t port);  // under mutex_; null when closed or too many
  node_ptr route(std::uint16_t slot, bool& unknown);                 // under mutex_
  /// What receives `r`'s reply from a node at `host`: follows a redirect, else calls `r.done`.
  redis_connection::callback follow(routed r, unsigned hops, const std::string& host);
  /// Sends `r` on `c` (on its strand), after `ASKING` if `asking`.
  void send_on(redis_connection& c, routed r, unsigned hops, bool asking) noexcept;
  void redirect(routed r, const redis_redirect& to, unsigned hops, const std::string& from_host) noexcept;
  /// Reads the map again unless a reading is in flight, or (not `urgent`:
  /// after a failure) one started less than a reconnect backoff ago.
  void refresh(bool urgent = true) noexcept;
  void refresh_from(const std::shared_ptr<const std::vector<kv_redis_endpoint>>& candidates, std::size_t i) noexcept;
  void install(const std::vector<redis_slot_range>& ranges, const std::string& asked_host);

  const asio::any_io_executor io_;
  const std::vector<kv_redis_endpoint> seeds_;
  const std::shared_ptr<const redis_session> session_;  // every node's connections', and the readiness
  std::mutex mutex_;
  std::map<std::string, node_ptr> nodes_;          // by host:port
  std::vector<node_ptr> slots_;                    // redis_slots of them; null: unknown
  bool refreshing_ = false;                        // a CLUSTER SLOTS in flight
  std::chrono::steady_clock::time_point last_refresh_{};
  bool closed_ = false;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
