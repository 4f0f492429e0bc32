#pragma once
// What every connection of one Redis store shares (store.cpp makes it once,
// connection.cpp reads it): the TLS context, the commands that open each
// connection (AUTH, SELECT, or a PING), the counters its failures are
// recorded in, and the readiness async_wait_ready() waits for.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "ghostlink/detail/asio_config.hpp"
#include "ghostlink/detail/io_op.hpp"
#include "ghostlink/error.hpp"
#include "ghostlink/redis_store.hpp"
#include "store/redis/requests.hpp"

// clang-format off
#include GHOSTLINK_ASIO_HEADER(ssl.hpp)
#include GHOSTLINK_ASIO_HEADER(steady_timer.hpp)
// clang-format on

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// The outcome of a store's connection attempts, and the async_wait_ready()
/// operations waiting for the next one.
///
/// A wait completes (queued on its handler's executor, never inside
/// wait()) with success at once if the store is ready now, else at the
/// next outcome: ready(), failed(), or, past `patience` with neither,
/// `store_unavailable`. close() ends the waits left with operation_aborted.
class redis_readiness : public std::enable_shared_from_this<redis_readiness> {
 public:
  redis_readiness(asio::any_io_executor io, std::chrono::milliseconds patience)
      : io_(std::move(io)), patience_(patience) {}

  /// A connection (for a cluster: a slot map) is ready.
  void ready() noexcept { settle({}); }
  /// A connection attempt failed with `e`.
  void failed(kv_errc e) noexcept { settle(e); }
  /// Completes `op` as above. @throws std::bad_alloc, having discarded `op`.
  void wait(io_op* op);
  /// Ends every wait left with operation_aborted; later waits too.
  void close() noexcept;

 private:
  struct waiter {
    io_op* op = nullptr;
    std::shared_ptr<asio::steady_timer> timer;
  };
  void settle(error_code ec) noexcept;
  static void complete(io_op* op, error_code ec) noexcept;
  /// Cancels `w`'s timer and completes its operation with `ec`.
  static void finish(waiter& w, error_code ec) noexcept;

  const asio::any_io_executor io_;
  const std::chrono::milliseconds patience_;
  std::mutex mutex_;
  bool ready_now_ = false;
  bool closed_ = false;
  std::uint64_t next_id_ = 0;
  std::map<std::uint64_t, waiter> waiters_;
};

/// What the connections of one store share. Immutable once made, but for
/// what its pointers point to (each safe from any thread).
struct redis_session {
  /// The connect and request timeouts and the reconnect backoff of every connection.
  redis_timeouts timeouts{};
  /// Connections to each server (to each master of a cluster).
  std::size_t connections = 1;
  /// `AUTH [username] password` and `SELECT db` as the options ask, or
  /// `PING` when neither (a server that wants a password says so then,
  /// before any request is written): pipelined on each new connection.
  std::string hello;
  /// The replies `hello` has.
  std::size_t hello_replies = 0;
  /// The TLS context; null: no TLS.
  std::shared_ptr<asio::ssl::context> tls;
  /// The name a server's certificate must carry (and the SNI); empty: the endpoint's host.
  std::string server_name;
  /// Whether the server's certificate is verified.
  bool verify = true;
  /// One server: a connection opened is the store ready. A cluster: its
  /// slot map read (`map_read`), and then any connection opened again.
  bool ready_on_hello = true;
  mutable std::atomic<bool> map_read{false};
  /// Where failures, auth and TLS errors, oversized replies are counted; the value cap.
  std::shared_ptr<redis_counters> counters;
  /// What async_wait_ready() waits on.
  std::shared_ptr<redis_readiness> readiness;

  /// A connection of this store opened (TLS and AUTH done).
  void opened() const noexcept {
    if (ready_on_hello || map_read.load(std::memory_order_acquire)) readiness->ready();
  }
  /// A cluster's slot map read: the store is ready.
  void mapped() const noexcept {
    map_read.store(true, std::memory_order_release);
    readiness->ready();
  }
  /// A connection of this store failed with `e` (recorded, counted).
  void failed(kv_errc e) const noexcept {
    counters->error(e);
    readiness->failed(e);
  }
};

/// The session of a store with `options`; its readiness is the caller's to set.
/// @throws std::system_error(kv_errc::invalid_config) if a TLS file cannot
/// be read (or a certificate comes without its key, or the reverse).
std::shared_ptr<redis_session> make_redis_session(const kv_redis_store_options& options,
                                                  std::shared_ptr<redis_counters> counters);

}  // namespace detail
GHOSTLINK_NAMESPACE_END
