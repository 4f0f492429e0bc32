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
/// - the part of RESP2 used (GET, SET, PING, AUTH, SELECT, CLUSTER SLOTS, ASKING and
///   their replies: `+`, `-`, `:`, `$` bulk and nil, `*` arrays) is small.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/block_store.hpp"
#include "ghostlink/completion_token.hpp"
#include "ghostlink/detail/completion.hpp"
#include "ghostlink/detail/io_op.hpp"
#include "ghostlink/error.hpp"

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
/// (or `server_name`), which is also sent as SNI (a host name only: an IP
/// address is matched against the certificate's IP addresses, and sent as
/// no SNI). TCP endpoints only: TLS with a unix socket is `invalid_config`
/// (the socket's file permissions guard it; TLS would add only its cost).
/// A failed handshake (a certificate not verified, a name not matched, a
/// server speaking no TLS) counts in `kv_store_stats::tls_errors`, sets
/// `last_error` to `kv_errc::store_tls_failed`, and the connection is
/// tried again after `reconnect_backoff`. On close, the TLS session is not
/// shut down (no `close_notify` awaited): the socket is closed.
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
///
/// Every connection (each of `connections`, every reconnect, every node of
/// a cluster, a redirect's and a slot map reading's included) is opened the
/// same way before any request is written on it: connected (within
/// `connect_timeout`), the TLS handshake if `tls`, then `AUTH` (if
/// `password`) and `SELECT` (if `database` is not 0) pipelined, or a
/// `PING` if neither, their replies checked (handshake and replies within
/// `request_timeout`). An error reply (`WRONGPASS`, `NOAUTH`, `NOPERM`,
/// `ERR invalid password`, `ERR DB index is out of range`, ...) counts in
/// `kv_store_stats::auth_errors`, sets `last_error` to
/// `kv_errc::store_auth_failed`, fails the connection's requests (misses,
/// write errors) and backs off. A `NOAUTH` or `NOPERM` replied to a
/// request later (an ACL that forbids a command or a key) counts so too,
/// that request failing.
///
/// The ACL a user needs: `+get +set` and the keys `~ghostlink:*`;
/// `+select` if `database` is not 0; `+cluster|slots +asking` on a
/// cluster (e.g. `ACL SETUSER ghost on >pw ~ghostlink:* +get +set`). `AUTH`
/// needs no permission; the `PING` sent without a password is the
/// `default` user's.
struct kv_redis_store_options {
  /// The ACL user to authenticate as (`AUTH username password`); empty:
  /// `AUTH password` (the `default` user) when a password is set. A user
  /// without a password is `invalid_config`.
  std::string username{};
  /// The password (`requirepass`, or the ACL user's); empty: no `AUTH`.
  /// Never logged, printed or put in an error message.
  std::string password{};
  /// The database to `SELECT` on every connection; a cluster has only
  /// database 0, so any other with `cluster` is `invalid_config`, as is
  /// one above `kv_redis_store::max_database` (a server has 16 unless
  /// configured otherwise: one it lacks is an auth failure, as above).
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
  /// 0 or more than `kv_redis_store::max_ttl_seconds` is `invalid_config`.
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
/// Read cap: once `limit_value_size()` is called (a prefix cache does, with
/// its entry size), a GET reply longer than the cap is a miss counted in
/// `kv_store_stats::oversized` (not an error: `last_error` is unchanged),
/// and its bytes are skipped as they arrive, never buffered: a value
/// planted too large in Redis costs its transfer, not its memory.
///
/// Errors recorded (`kv_store_stats::last_error` and its time): a
/// connection refused, lost or not answered in time (`store_unavailable`),
/// a TLS handshake failed (`store_tls_failed`), credentials, database or
/// an ACL refused (`store_auth_failed`), a put or a lookup refused by the
/// server with another error (`-OOM`, `-LOADING`, `-CLUSTERDOWN`:
/// `store_unavailable`).
/// The password is in no error, message or log.
///
/// Costs: a put encodes its value on the I/O executor's thread into the
/// request itself (one copy) and is written with the requests queued with
/// it; a lookup's reply is read into one buffer, copied once into the
/// value handed to the prefix cache, whose checks run on that thread.
class kv_redis_store final : public kv_block_store {
 public:
  /// The largest `ttl_seconds`: 9 * 10^15 s, so that the expiry in
  /// milliseconds plus the server's clock stays within Redis's signed
  /// 64 bits (Redis refuses `EX` beyond that with `invalid expire time`).
  static constexpr std::uint64_t max_ttl_seconds = 9'000'000'000'000'000'000 / 1000;
  /// The largest `database` (Redis takes a database index as a C `int`).
  static constexpr std::uint32_t max_database = 2'147'483'647;

  /// A store on `endpoints.front()`, or on the cluster whose seeds
  /// `endpoints` are; starts connecting in the background (never blocks on
  /// the server). Nothing is started when it throws.
  /// @throws std::invalid_argument if `endpoints` is empty, its unix
  /// socket path is longer than a socket address holds, a cluster's
  /// endpoint is a unix socket, or `options.connections` is 0.
  /// @throws std::system_error with `kv_errc::invalid_config` if an
  /// endpoint used (the first; a cluster's every seed) is TCP with an empty
  /// `host` or port 0, or is a unix socket with `tls`; `ttl_seconds` is 0
  /// or above `max_ttl_seconds`; `database` is not 0 on a cluster or is
  /// above `max_database`; `username` is set without `password`;
  /// `connect_timeout` or `request_timeout` is not positive or
  /// `reconnect_backoff` negative; or a TLS file (`ca_file`,
  /// `ca_directory`, `certificate_file`, `private_key_file`) cannot be read
  /// or used, or a certificate comes without its key or the reverse.
  explicit kv_redis_store(std::vector<kv_redis_endpoint> endpoints, kv_redis_store_options options = {});
  /// Closes the connections once the requests on them are answered or
  /// time out. With the store's own I/O context, waits for that (at most
  /// `connect_timeout + request_timeout`, each redirect of a request
  /// in flight adding as much) and joins its thread.
  ~kv_redis_store() override;

  void put(std::shared_ptr<const kv_store_value> value) noexcept override;
  void fetch(std::vector<kv_block_hash> hashes, fetch_handler on_value) override;
  kv_store_stats stats() const noexcept override;
  /// "REDIS". A value's receipt (`kv_store_receipt`) is told `stored()`
  /// when the server has replied OK to its `SET`, and never `removed()`:
  /// the server evicts (`maxmemory`), expires (`ttl_seconds`) and takes
  /// other clients' writes on its own, so a prefix cache learns of a loss
  /// when a fetch misses.
  std::string_view medium() const noexcept override { return "REDIS"; }

  /// The Redis key an entry is stored under: `ghostlink:v1:<hash hex>`.
  static std::string key_of(const kv_block_hash& hash);
  /// Blocks the calling thread until every put queued before the call is
  /// stored, dropped or failed. Never call it from the I/O executor's threads.
  void flush();
  /// Caps the values read (see "Read cap" above); the largest call holds.
  void limit_value_size(std::size_t bytes) noexcept override;
  /// Calls `done` once every put queued before the call is stored, dropped
  /// or failed (on the thread that settles the last of them, or inside
  /// this call if none is pending); puts made later never delay it.
  void when_flushed(std::function<void()> done) override;

  /// Waits until the store can serve: a connection to the server opened
  /// (TLS handshaken, authenticated, database selected), or for a cluster
  /// the slot map read from a seed. Completes at once (queued, never inside
  /// this call) if that holds now; else at the next outcome of a connection
  /// attempt: success, `kv_errc::store_auth_failed`,
  /// `kv_errc::store_tls_failed` or `kv_errc::store_unavailable` (a refused
  /// or timed-out connect, or nothing at all within `connect_timeout +
  /// 2 * request_timeout + reconnect_backoff`). `asio::error::operation_aborted`
  /// if the store is destroyed first. Not cancellable (it is bounded).
  ///
  /// Completion signature: `void(error_code)`. Handler: queued on its
  /// associated executor; without one, on the store's I/O executor (its
  /// own thread, or `io_executor`): it must not block there.
  /// @param token the completion token; none is needed to `co_await`.
  /// @return what `asio::async_initiate` makes of `token`.
  template <class CompletionToken = default_completion_token>
  auto async_wait_ready(CompletionToken&& token = default_completion_token()) {
    return asio::async_initiate<CompletionToken, void(error_code)>(
        [this](auto handler) {
          using op = detail::handler_op<detail::io_op, std::decay_t<decltype(handler)>, asio::any_io_executor>;
          start_wait_ready(op::make(std::move(handler), executor()));
        },
        token);
  }

 private:
  /// The I/O executor the connections run on.
  asio::any_io_executor executor() const noexcept;
  /// Hands `op` to the readiness (which completes it, or discards it if this throws).
  void start_wait_ready(detail::io_op* op);

  std::unique_ptr<detail::redis_store_state> state_;
};

GHOSTLINK_NAMESPACE_END
