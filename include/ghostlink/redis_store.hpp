#pragma once
/// @file
/// A block store on a Redis server (`kv_redis_store`): the tier below a
/// prefix cache's RAM shared by every process that talks to the server.
///
/// Each entry is one Redis string under the key `ghostlink:v1:<hash hex>`
/// (64 lowercase hex digits, no hash tag braces), holding the entry's bytes
/// as the prefix cache encodes them (docs/FORMAT.md, "Block entries"). The
/// store keeps bytes only: the prefix cache checks every value it fetches,
/// so a value overwritten, truncated or of another entry is a miss.
///
/// Why a RESP2 client of our own on Asio sockets, rather than hiredis 0.14
/// driven through `posix::stream_descriptor`:
/// - it is native to both Asio flavours, on the store's executor, with
///   Asio's timers and cancellation for the connect and request timeouts;
/// - pipelining is under our control: a fetch writes all its GETs at once
///   and reads the replies in order, with no per-request allocation of a
///   client library's context;
/// - hiredis 0.14's asynchronous API needs an event-loop adapter to Asio
///   written anyway, and its reader copies every reply (an entry is
///   megabytes) before handing it over;
/// - the part of RESP2 used (GET, SET, PING, CLUSTER SLOTS, ASKING and
///   their replies: `+`, `-`, `:`, `$` bulk and nil, `*` arrays) is small.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/block_store.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// Where a Redis server listens: a unix socket (`unix_socket` set), or
/// else a TCP `host` and `port`.
struct kv_redis_endpoint {
  /// The path of a unix domain socket; when set, `host` and `port` are not used.
  std::string unix_socket{};
  /// A host name or address, resolved at each connect.
  std::string host = "127.0.0.1";
  /// The TCP port.
  std::uint16_t port = 6379;
};

/// TLS to a Redis server (`kv_redis_store_options::tls`), through
/// `asio::ssl` over OpenSSL: TLS 1.2 or later, the server's certificate
/// verified against the CA given and its name against the endpoint's host
/// (or `server_name`), which is also sent as SNI.
struct kv_redis_tls_options {
  /// A PEM file of the CA certificates the server's chain must lead to;
  /// empty (and `ca_directory` empty too): the system's default CA paths.
  std::string ca_file{};
  /// A directory of hashed CA certificates (`openssl rehash`), as well as
  /// or instead of `ca_file`.
  std::string ca_directory{};
  /// A PEM client certificate, for a server that asks for one
  /// (`tls-auth-clients yes`, Redis's default); empty: none sent.
  std::string certificate_file{};
  /// The PEM private key of `certificate_file`.
  std::string private_key_file{};
  /// The name the server's certificate must carry (and the SNI sent);
  /// empty: the endpoint's `host` (for a cluster, each node's as the
  /// cluster names it).
  std::string server_name{};
  /// Verify the server's certificate chain and name. On by default; off
  /// encrypts without knowing who answers (a test bench only).
  bool verify = true;
};

/// The connections, timeouts and limits of a `kv_redis_store`.
struct kv_redis_store_options {
  /// The ACL user to authenticate as (`AUTH username password`); empty:
  /// `AUTH password` (the `default` user) when a password is set.
  std::string username{};
  /// The password (`requirepass`, or the ACL user's); empty: no `AUTH`.
  /// Never logged, printed or put in an error message.
  std::string password{};
  /// The database to `SELECT` on every connection; a cluster has only
  /// database 0, so any other with `cluster` is `invalid_config`.
  std::uint32_t database = 0;
  /// TLS on every connection (cluster nodes and reconnects included);
  /// none: plain TCP or the unix socket.
  std::optional<kv_redis_tls_options> tls{};
  /// Whether the endpoints are seed nodes of a Redis Cluster (TCP
  /// endpoints) rather than one server: the store reads the cluster's slot
  /// map from the first seed that answers `CLUSTER SLOTS`, sends each
  /// request to its key's master, and follows `-MOVED` and `-ASK`
  /// redirects (5 at most a request).
  bool cluster = false;
  /// Connections to the server (to each master of a cluster); requests
  /// are spread over them, each connection pipelined (many requests
  /// written, replies read in order).
  std::size_t connections = 2;
  /// How long a connect may take before it fails (then retried after
  /// `reconnect_backoff`).
  std::chrono::milliseconds connect_timeout{1000};
  /// How long a request may wait for its reply: a lookup not answered in
  /// time is a miss, a put a write error, and the connection is closed
  /// (every request in flight on it failing so) and opened again after
  /// `reconnect_backoff`.
  std::chrono::milliseconds request_timeout{1000};
  /// The wait before a connection lost (or never made) is tried again.
  /// Meanwhile every request on it fails at once (a miss, a write error).
  std::chrono::milliseconds reconnect_backoff{100};
  /// The bytes of puts not yet answered, beyond which a put is dropped.
  std::size_t max_pending_bytes = std::size_t{256} << 20;
  /// An expiry set on every value stored (`SET ... EX`); none: no expiry.
  std::optional<std::uint64_t> ttl_seconds{};
  /// Where the sockets and timers run; none: an I/O context of the store's
  /// own, with one thread. A given executor must keep running until the
  /// store's connections are closed: destroy the store first, then join
  /// the pool (its connections close once their requests are done).
  std::optional<asio::any_io_executor> io_executor{};
};

namespace detail {
class redis_store_state;
}

/// A block store on one Redis server (the first of the endpoints given),
/// or on a Redis Cluster (`kv_redis_store_options::cluster`: the endpoints
/// are its seeds).
///
/// On a cluster, an entry's key has no hash tag, so entries spread over
/// every master by their hash. The slot map is read at start and again
/// after a `-MOVED` or a failed request (a failover moves masters); until
/// it is known, requests go to the first seed and follow its redirects. A
/// redirect costs a round trip to the node named; `-ASK` sends `ASKING`
/// and the request back to back. `-CLUSTERDOWN`, `-TRYAGAIN`, more than 5
/// redirects, or a master that does not answer: a miss, a write error.
///
/// Redis owns eviction and memory: run the server with a `maxmemory` and
/// `maxmemory-policy allkeys-lru` (or set `ttl_seconds`). So
/// `stats().entries`, `bytes` and `evictions` stay 0: the server's `INFO`
/// tells them.
///
/// Failures are misses, never errors: a server absent, killed, stopped or
/// slow makes lookups misses and puts write errors (counted), while the
/// connections are opened again in the background every
/// `reconnect_backoff`. No request waits longer than `request_timeout`
/// (counted from when its connection takes it), connecting or not.
///
/// Costs: a put encodes its value on the I/O executor's thread into the
/// request itself (one copy) and is written with the requests queued with
/// it; a lookup's reply is read into one buffer, copied once into the
/// value handed to the prefix cache, whose checks run on that thread.
class kv_redis_store final : public kv_block_store {
 public:
  /// A store on `endpoints.front()`, or on the cluster whose seeds
  /// `endpoints` are; starts connecting in the background (never blocks on
  /// the server).
  /// @throws std::invalid_argument if `endpoints` is empty, its unix
  /// socket path is longer than a socket address holds, a cluster's
  /// endpoint is a unix socket, or `options.connections` is 0.
  explicit kv_redis_store(std::vector<kv_redis_endpoint> endpoints, kv_redis_store_options options = {});
  /// Closes the connections once the requests on them are answered or
  /// time out. With the store's own I/O context, waits for that (at most
  /// `connect_timeout + request_timeout`, each redirect of a request
  /// in flight adding as much) and joins its thread.
  ~kv_redis_store() override;

  void put(std::shared_ptr<const kv_store_value> value) noexcept override;
  void fetch(std::vector<kv_block_hash> hashes, fetch_handler on_value) override;
  kv_store_stats stats() const noexcept override;

  /// The Redis key an entry is stored under: `ghostlink:v1:<hash hex>`.
  static std::string key_of(const kv_block_hash& hash);
  /// Blocks the calling thread until every put queued before the call is
  /// stored, dropped or failed. Never call it from the I/O executor's threads.
  void flush();

 private:
  std::unique_ptr<detail::redis_store_state> state_;
};

GHOSTLINK_NAMESPACE_END
