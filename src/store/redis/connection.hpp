#pragma once
// A pipelined RESP2 client on one Asio socket (unix or TCP), for the Redis
// store (store.cpp) and the tests.
//
// Requests are queued on the connection's strand, written in batches, and
// their replies read in order; each request's callback runs exactly once on
// the strand: with the reply, or with a `failed` reply when the connection
// is down, is lost, or the request's deadline passes. A late reply closes
// the connection (the stream cannot be resynchronised otherwise), which is
// opened again after the backoff; while it is down, requests fail at once.
//
// Opening a connection: the socket connected (within the connect timeout),
// then the TLS handshake if the session has TLS, then the session's hello
// (AUTH, SELECT or PING) written and its replies read, both within the
// request timeout; only then is a queued request written. A failure of any
// step is recorded in the session (store_unavailable, store_tls_failed,
// store_auth_failed) and the connection backs off. An auth error replied
// to any request later (NOAUTH, NOPERM, WRONGPASS) is recorded too.
//
// A bulk reply longer than the store's value cap is not buffered: its
// request gets an `oversized` reply, and its bytes are skipped as they come.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ghostlink/error.hpp"

#include "ghostlink/detail/asio_config.hpp"
#include "ghostlink/redis_store.hpp"

// clang-format off
#include GHOSTLINK_ASIO_HEADER(generic/stream_protocol.hpp)
#include GHOSTLINK_ASIO_HEADER(ip/tcp.hpp)
#include GHOSTLINK_ASIO_HEADER(ssl/stream.hpp)
#include GHOSTLINK_ASIO_HEADER(steady_timer.hpp)
// clang-format on

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// One RESP2 reply. Arrays (CLUSTER SLOTS) keep their elements, nested at
/// most `max_redis_depth` deep and `max_redis_elements` long: the parser is
/// fed by the network.
struct redis_reply {
  /// `oversized`: a bulk longer than the parser's cap (`integer`: its length), not read.
  enum class type : std::uint8_t { failed, status, error, integer, bulk, nil, array, oversized };
  type kind = type::failed;
  std::vector<std::byte> bytes;       // status, error, bulk
  std::int64_t integer = 0;           // integer; array: its element count
  std::vector<redis_reply> elements;  // array

  /// The bytes as text (status, error, bulk).
  std::string_view text() const noexcept { return {reinterpret_cast<const char*>(bytes.data()), bytes.size()}; }
};

inline constexpr std::size_t max_redis_depth = 8;
inline constexpr std::int64_t max_redis_elements = std::int64_t{1} << 20;

/// A request encoded: `*N\r\n$len\r\narg\r\n...`.
std::string redis_command(std::initializer_list<std::string_view> args);

/// Parses one reply at the front of `in`; the bytes it took, 0 if `in`
/// holds only part of one; throws std::runtime_error on a protocol error
/// (arrays nested deeper or longer than the limits above included). A
/// bulk reply (not inside an array) longer than `max_bulk` is an
/// `oversized` reply of its header alone: its length + 2 bytes (the bulk
/// and its CRLF) follow, for the caller to skip.
std::size_t parse_redis_reply(std::string_view in, redis_reply& out,
                              std::size_t max_bulk = static_cast<std::size_t>(-1));

/// Whether an error reply is the server refusing who we are or what we may
/// do: `NOAUTH`, `WRONGPASS`, `NOPERM`.
inline bool is_redis_auth_error(std::string_view error) noexcept {
  return error.starts_with("NOAUTH") || error.starts_with("WRONGPASS") || error.starts_with("NOPERM");
}

struct redis_session;

struct redis_timeouts {
  std::chrono::milliseconds connect{1000};
  std::chrono::milliseconds request{1000};
  std::chrono::milliseconds backoff{100};
};

class redis_connection : public std::enable_shared_from_this<redis_connection> {
 public:
  using callback = std::function<void(redis_reply)>;

  /// A connection to `endpoint`, with `session`'s timeouts, credentials and TLS.
  redis_connection(const asio::any_io_executor& ex, kv_redis_endpoint endpoint,
                   std::shared_ptr<const redis_session> session);

  /// Starts connecting (once).
  void start();
  /// A command kept by its sender beyond the write (to send it again
  /// elsewhere: a Redis Cluster redirect), rather than moved in.
  using shared_command = std::shared_ptr<const std::string>;

  /// Queues `command` (from any thread); `done` runs on the strand.
  /// @throws std::bad_alloc, having queued nothing.
  void send(std::string command, callback done);
  /// Runs `f` on the strand; `f` may call `send_here`.
  template <class F>
  void run(F&& f) {
    asio::post(strand_, std::forward<F>(f));
  }
  /// `send` on the strand.
  void send_here(std::string command, callback done) noexcept;
  /// `send_here` of a command the caller keeps too.
  void send_here(shared_command command, callback done) noexcept;
  /// Whether requests would be written now or soon (connected or
  /// connecting), not failed at once.
  bool accepting() const noexcept { return state_ != state::backoff && state_ != state::closed; }
  /// Stops reconnecting; closes the socket once nothing is in flight.
  void close();
  /// Where it connects.
  const kv_redis_endpoint& endpoint() const noexcept { return endpoint_; }
  /// Calls `done` with a failed reply, swallowing what it throws.
  static void fail(callback& done) noexcept;

 private:
  enum class state : std::uint8_t { idle, connecting, connected, backoff, closed };
  enum class phase : std::uint8_t { connect, handshake, hello };  // while connecting
  using tls_stream = asio::ssl::stream<asio::generic::stream_protocol::socket>;
  struct request {
    std::string command;
    shared_command shared;  // instead of `command` when set
    callback done;
    std::chrono::steady_clock::time_point deadline;
  };

  void connect();
  void connect_to(const asio::generic::stream_protocol::endpoint& where, std::uint64_t generation);
  void arm_connect_timer(std::chrono::milliseconds after);
  void connected();  // the socket: TLS next, or the hello
  void handshake();
  void send_hello();
  void opened();  // the hello answered: requests are written
  /// Fails everything, closes, backs off; records `why` (none: closing, or memory refused).
  void lost(std::optional<kv_errc> why = kv_errc::store_unavailable);
  /// Takes one reply: the hello's, else the oldest request's. False if the connection was lost.
  bool take(redis_reply reply);
  /// Takes every whole reply buffered. False if the connection was lost.
  bool parse_replies();
  /// Calls `f` with the stream requests are written to and read from (the TLS stream or the socket).
  template <class F>
  void with_stream(F&& f) {
    if (tls_)
      f(*tls_);
    else
      f(socket_);
  }
  asio::generic::stream_protocol::socket& lowest_socket() noexcept { return tls_ ? tls_->next_layer() : socket_; }
  void write_more();
  /// A write of socket `g` (the hello, or a batch) done: the next batch, or the connection lost.
  void written(const error_code& ec, std::uint64_t g);
  void read_more();
  void arm_deadline();
  void check_deadlines();
  static void finish_callback(callback& done) noexcept { fail(done); }
  void queue(request r) noexcept;
  void close_if_drained();

  asio::strand<asio::any_io_executor> strand_;
  const kv_redis_endpoint endpoint_;
  const std::shared_ptr<const redis_session> session_;
  asio::generic::stream_protocol::socket socket_;  // without TLS
  // With TLS, one a socket (a stream cannot be reused); each operation
  // holds the stream it runs on, so one of a closed socket can end safely.
  std::shared_ptr<tls_stream> tls_;
  asio::ip::tcp::resolver resolver_;
  asio::steady_timer connect_timer_;   // connect timeout, backoff
  asio::steady_timer deadline_timer_;  // the oldest request's deadline
  bool deadline_armed_ = false;
  bool writing_ = false;
  bool closing_ = false;
  std::atomic<state> state_{state::idle};
  phase phase_ = phase::connect;
  std::size_t hello_left_ = 0;   // hello replies still to read
  std::uint64_t skipping_ = 0;  // bytes of an oversized reply still to skip
  std::uint64_t generation_ = 0;  // one a socket: completions of an older one are ignored
  std::deque<request> queued_;     // not yet written
  std::deque<request> in_flight_;  // written, replies awaited in this order
  std::vector<asio::const_buffer> writing_buffers_;
  std::string in_;  // bytes read, from in_start_
  std::size_t in_start_ = 0;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
