// The RESP2 client of the Redis store: see connection.hpp.
//
// Everything of a connection runs on its strand. `generation_` counts the
// sockets: a completion of an older socket (closed since) only releases
// what it held. The deadline timer waits for the oldest request's deadline
// only: requests are queued in order with one timeout, so no later request
// can expire first.

#include "store/redis/connection.hpp"

#include <openssl/ssl.h>

#include <algorithm>
#include <charconv>
#include <stdexcept>
#include <utility>

#include "store/redis/session.hpp"

// clang-format off
#include GHOSTLINK_ASIO_HEADER(connect.hpp)
#include GHOSTLINK_ASIO_HEADER(ip/address.hpp)
#include GHOSTLINK_ASIO_HEADER(local/stream_protocol.hpp)
#include GHOSTLINK_ASIO_HEADER(write.hpp)
// clang-format on

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

constexpr std::size_t read_chunk = std::size_t{256} << 10;
constexpr std::size_t max_batch_requests = 1024;
constexpr std::size_t max_batch_bytes = std::size_t{16} << 20;

std::int64_t parse_integer(std::string_view text) {
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size()) throw std::runtime_error("RESP: bad integer");
  return v;
}

/// What a read or write error on a connection says: OpenSSL's (an alert:
/// a client certificate refused, say) is TLS failing; any other, the server gone.
kv_errc error_of(const error_code& ec) noexcept {
  return ec.category() == asio::error::get_ssl_category() ? kv_errc::store_tls_failed : kv_errc::store_unavailable;
}

std::vector<std::byte> as_bytes(std::string_view text) {
  const auto* first = reinterpret_cast<const std::byte*>(text.data());
  return {first, first + text.size()};
}

}  // namespace

std::string redis_command(std::initializer_list<std::string_view> args) {
  std::string out = "*" + std::to_string(args.size()) + "\r\n";
  for (std::string_view a : args) {
    out += "$" + std::to_string(a.size()) + "\r\n";
    out += a;
    out += "\r\n";
  }
  return out;
}

namespace {

std::size_t parse_reply_at(std::string_view in, redis_reply& out, std::size_t depth, std::size_t max_bulk) {
  if (in.empty()) return 0;
  const std::size_t eol = in.find("\r\n");
  if (eol == std::string_view::npos) return 0;
  const std::string_view line = in.substr(1, eol - 1);
  const std::size_t after = eol + 2;
  switch (in[0]) {
    case '+':
      out.kind = redis_reply::type::status;
      out.bytes = as_bytes(line);
      return after;
    case '-':
      out.kind = redis_reply::type::error;
      out.bytes = as_bytes(line);
      return after;
    case ':':
      out.kind = redis_reply::type::integer;
      out.integer = parse_integer(line);
      return after;
    case '$': {
      const std::int64_t n = parse_integer(line);
      if (n == -1) {
        out.kind = redis_reply::type::nil;
        return after;
      }
      if (n < 0) throw std::runtime_error("RESP: bad bulk length");
      const auto length = static_cast<std::uint64_t>(n);
      if (depth == 0 && length > max_bulk) {  // not buffered: the caller skips it
        out.kind = redis_reply::type::oversized;
        out.integer = n;
        return after;
      }
      if (in.size() - after < length + 2) return 0;
      if (in.substr(after + length, 2) != "\r\n") throw std::runtime_error("RESP: bulk not terminated");
      out.kind = redis_reply::type::bulk;
      out.bytes = as_bytes(in.substr(after, length));
      return after + length + 2;
    }
    case '*': {
      const std::int64_t n = parse_integer(line);
      if (n == -1) {
        out.kind = redis_reply::type::nil;
        return after;
      }
      if (n < 0 || n > max_redis_elements) throw std::runtime_error("RESP: bad array length");
      if (depth >= max_redis_depth) throw std::runtime_error("RESP: arrays nested too deep");
      // Every element takes 3 bytes at least: a length beyond what is
      // buffered waits for more before anything is allocated for it.
      if (static_cast<std::uint64_t>(n) > (in.size() - after) / 3) return 0;
      std::vector<redis_reply> elements;
      std::size_t at = after;
      for (std::int64_t i = 0; i < n; ++i) {
        redis_reply element;
        const std::size_t took = parse_reply_at(in.substr(at), element, depth + 1, max_bulk);
        if (took == 0) return 0;
        at += took;
        elements.push_back(std::move(element));
      }
      out.kind = redis_reply::type::array;
      out.integer = n;
      out.elements = std::move(elements);
      return at;
    }
    default: throw std::runtime_error("RESP: unknown reply type");
  }
}

}  // namespace

std::size_t parse_redis_reply(std::string_view in, redis_reply& out, std::size_t max_bulk) {
  return parse_reply_at(in, out, 0, max_bulk);
}

redis_connection::redis_connection(const asio::any_io_executor& ex, kv_redis_endpoint endpoint,
                                   std::shared_ptr<const redis_session> session)
    : strand_(asio::make_strand(ex)),
      endpoint_(std::move(endpoint)),
      session_(std::move(session)),
      socket_(strand_),
      resolver_(strand_),
      connect_timer_(strand_),
      deadline_timer_(strand_) {}

void redis_connection::start() {
  run([self = shared_from_this()] {
    if (self->state_ == state::idle && !self->closing_) self->connect();
  });
}

void redis_connection::send(std::string command, callback done) {
  run([self = shared_from_this(), command = std::move(command), done = std::move(done)]() mutable {
    self->send_here(std::move(command), std::move(done));
  });
}

void redis_connection::send_here(std::string command, callback done) noexcept {
  queue({std::move(command), {}, std::move(done), {}});
}

void redis_connection::send_here(shared_command command, callback done) noexcept {
  queue({{}, std::move(command), std::move(done), {}});
}

void redis_connection::queue(request r) noexcept {
  if (!accepting()) {
    finish_callback(r.done);
    return;
  }
  r.deadline = std::chrono::steady_clock::now() + session_->timeouts.request;
  try {
    queued_.push_back(std::move(r));
  } catch (...) {  // memory refused: a failure
    finish_callback(r.done);
    return;
  }
  try {
    write_more();
    arm_deadline();
  } catch (...) {  // memory refused for an operation: the connection starts again
    try {
      lost(std::nullopt);
    } catch (...) {  // not even that (no memory for the backoff timer): it stays down
    }
  }
}

void redis_connection::fail(callback& done) noexcept {
  try {
    done(redis_reply{});
  } catch (...) {
  }
}

void redis_connection::close() {
  run([self = shared_from_this()] {
    self->closing_ = true;
    self->close_if_drained();
  });
}

void redis_connection::arm_connect_timer(std::chrono::milliseconds after) {
  connect_timer_.expires_after(after);
  connect_timer_.async_wait([self = shared_from_this(), g = generation_](const error_code& ec) {
    if (ec || g != self->generation_ || self->state_ != state::connecting) return;
    // A handshake not answered: no TLS spoken there (or no one answering at all).
    self->lost(self->phase_ == phase::handshake ? kv_errc::store_tls_failed : kv_errc::store_unavailable);
  });
}

void redis_connection::connect() {
  state_ = state::connecting;
  phase_ = phase::connect;
  const std::uint64_t g = ++generation_;
  if (session_->tls) {
    try {
      tls_ = std::make_shared<tls_stream>(strand_, *session_->tls);
    } catch (...) {  // memory refused, or OpenSSL's: not this time
      lost(kv_errc::store_tls_failed);
      return;
    }
  }
  arm_connect_timer(session_->timeouts.connect);
  if (!endpoint_.unix_socket.empty()) {
    connect_to(asio::local::stream_protocol::endpoint(endpoint_.unix_socket), g);
    return;
  }
  resolver_.async_resolve(
      endpoint_.host, std::to_string(endpoint_.port),
      [self = shared_from_this(), g](const error_code& ec, const asio::ip::tcp::resolver::results_type& results) {
        if (g != self->generation_) return;
        if (ec || results.empty()) {
          self->lost();
          return;
        }
        self->connect_to(results.begin()->endpoint(), g);
      });
}

void redis_connection::connect_to(const asio::generic::stream_protocol::endpoint& where, std::uint64_t g) {
  lowest_socket().async_connect(where, [self = shared_from_this(), tls = tls_, g](const error_code& ec) {
    if (g != self->generation_) return;
    if (ec) {
      self->lost(error_of(ec));
      return;
    }
    self->connected();
  });
}

void redis_connection::connected() {
  if (endpoint_.unix_socket.empty()) {
    error_code ignored;
    lowest_socket().set_option(asio::ip::tcp::no_delay(true), ignored);
  }
  in_.clear();
  in_start_ = 0;
  skipping_ = 0;
  arm_connect_timer(session_->timeouts.request);  // the handshake and the hello, as a request
  if (tls_)
    handshake();
  else
    send_hello();
}

void redis_connection::handshake() {
  phase_ = phase::handshake;
  const std::string& name = session_->server_name.empty() ? endpoint_.host : session_->server_name;
  error_code not_address;
  (void)asio::ip::make_address(name, not_address);
  // SNI for a host name (never an address, RFC 6066); the name checked.
  if (not_address && SSL_set_tlsext_host_name(tls_->native_handle(), name.c_str()) != 1) {
    lost(kv_errc::store_tls_failed);
    return;
  }
  if (session_->verify) {
    error_code ec;
    tls_->set_verify_callback(asio::ssl::host_name_verification(name), ec);
    if (ec) {
      lost(kv_errc::store_tls_failed);
      return;
    }
  }
  tls_->async_handshake(asio::ssl::stream_base::client,
                        [self = shared_from_this(), tls = tls_, g = generation_](const error_code& ec) {
                          if (g != self->generation_) return;
                          if (ec) {
                            self->lost(kv_errc::store_tls_failed);
                            return;
                          }
                          self->send_hello();
                        });
}

void redis_connection::send_hello() {
  phase_ = phase::hello;
  hello_left_ = session_->hello_replies;
  const std::uint64_t g = generation_;
  read_more();
  if (g != generation_) return;
  writing_ = true;
  with_stream([&](auto& stream) {
    asio::async_write(
        stream, asio::buffer(session_->hello),
        [self = shared_from_this(), tls = tls_, g](const error_code& ec, std::size_t) { self->written(ec, g); });
  });
}

void redis_connection::opened() {
  state_ = state::connected;
  connect_timer_.cancel();
  session_->opened();
  write_more();
  arm_deadline();
  close_if_drained();
}

bool redis_connection::take(redis_reply reply) {
  const bool refused = reply.kind == redis_reply::type::error && is_redis_auth_error(reply.text());
  if (refused) session_->failed(kv_errc::store_auth_failed);
  if (reply.kind == redis_reply::type::oversized) session_->counters->oversized();
  if (hello_left_ > 0) {
    // Any error to AUTH, SELECT or PING: credentials or database refused.
    if (reply.kind != redis_reply::type::status) {
      if (!refused) session_->failed(kv_errc::store_auth_failed);
      lost(std::nullopt);  // recorded above
      return false;
    }
    if (--hello_left_ == 0) opened();
    return true;
  }
  if (in_flight_.empty()) throw std::runtime_error("RESP: a reply to no request");
  request r = std::move(in_flight_.front());
  in_flight_.pop_front();
  try {
    r.done(std::move(reply));
  } catch (...) {
  }
  return true;
}

void redis_connection::lost(std::optional<kv_errc> why) {
  if (why && !closing_) session_->failed(*why);
  ++generation_;
  hello_left_ = 0;
  error_code ignored;
  lowest_socket().close(ignored);  // a TLS stream is not shut down: nothing waits for its peer
  resolver_.cancel();
  state_ = closing_ ? state::closed : state::backoff;
  std::deque<request> failed = std::move(in_flight_);
  in_flight_.clear();
  for (request& r : queued_) failed.push_back(std::move(r));
  queued_.clear();
  for (request& r : failed) finish_callback(r.done);
  if (closing_) {
    close_if_drained();
    return;
  }
  const std::uint64_t g = generation_;
  connect_timer_.expires_after(session_->timeouts.backoff);
  connect_timer_.async_wait([self = shared_from_this(), g](const error_code& ec) {
    if (!ec && g == self->generation_ && self->state_ == state::backoff && !self->closing_) self->connect();
  });
}

void redis_connection::write_more() {
  if (state_ != state::connected || writing_ || queued_.empty()) return;
  // The commands of one write, owned or shared; reserved up front, so the
  // buffers taken on them as they come stay valid.
  struct batch_commands {
    std::vector<std::string> owned;
    std::vector<shared_command> shared;
  };
  auto batch = std::make_shared<batch_commands>();
  std::vector<asio::const_buffer> buffers;
  try {
    const std::size_t most = std::min(queued_.size(), max_batch_requests);
    batch->owned.reserve(most);
    batch->shared.reserve(most);
    buffers.reserve(most);
    std::size_t bytes = 0;
    while (!queued_.empty() && buffers.size() < max_batch_requests && bytes < max_batch_bytes) {
      request& r = queued_.front();
      in_flight_.push_back({{}, {}, std::move(r.done), r.deadline});
      if (r.shared) {
        batch->shared.push_back(std::move(r.shared));
        buffers.emplace_back(asio::buffer(*batch->shared.back()));
      } else {
        batch->owned.push_back(std::move(r.command));
        buffers.emplace_back(asio::buffer(batch->owned.back()));
      }
      bytes += buffers.back().size();
      queued_.pop_front();
    }
  } catch (...) {  // memory refused: the connection's requests fail, it starts again
    lost(std::nullopt);
    return;
  }
  writing_ = true;
  with_stream([&](auto& stream) {
    asio::async_write(stream, buffers,
                      [self = shared_from_this(), batch, tls = tls_, g = generation_](
                          const error_code& ec, std::size_t) { self->written(ec, g); });
  });
}

void redis_connection::written(const error_code& ec, std::uint64_t g) {
  writing_ = false;
  if (g != generation_) {  // a socket closed since: what is queued goes on the new one
    write_more();
    close_if_drained();
    return;
  }
  if (ec) {
    lost(error_of(ec));
    return;
  }
  write_more();
}

void redis_connection::read_more() {
  try {
    if (in_start_ > 0) {
      in_.erase(0, in_start_);
      in_start_ = 0;
    }
    in_.resize(in_.size() + read_chunk);
  } catch (...) {
    lost(std::nullopt);
    return;
  }
  const std::size_t old = in_.size() - read_chunk;
  with_stream([&](auto& stream) {
    stream.async_read_some(
        asio::buffer(in_.data() + old, read_chunk),
        [self = shared_from_this(), tls = tls_, g = generation_, old](const error_code& ec, std::size_t n) {
          if (g != self->generation_) return;
          if (ec) {
            self->lost(error_of(ec));
            return;
          }
          self->in_.resize(old + n);
          try {
            if (!self->parse_replies()) return;
          } catch (...) {  // a protocol error, or memory refused: start again
            self->lost();
            return;
          }
          self->close_if_drained();
          if (g == self->generation_) self->read_more();
        });
  });
}

bool redis_connection::parse_replies() {
  const std::uint64_t g = generation_;
  const std::size_t cap = session_->counters->value_cap();
  for (;;) {
    if (skipping_ > 0) {  // an oversized value's bytes, dropped as they come
      const std::size_t skip = std::min<std::uint64_t>(skipping_, in_.size() - in_start_);
      in_start_ += skip;
      skipping_ -= skip;
      if (skipping_ > 0) return true;
    }
    redis_reply reply;
    const std::size_t took = parse_redis_reply(std::string_view(in_).substr(in_start_), reply, cap);
    if (took == 0) return true;
    in_start_ += took;
    if (reply.kind == redis_reply::type::oversized) skipping_ = static_cast<std::uint64_t>(reply.integer) + 2;
    if (!take(std::move(reply)) || g != generation_) return false;
  }
}

void redis_connection::arm_deadline() {
  if (deadline_armed_) return;
  const request* oldest = !in_flight_.empty() ? &in_flight_.front() : !queued_.empty() ? &queued_.front() : nullptr;
  if (oldest == nullptr) return;
  deadline_armed_ = true;
  deadline_timer_.expires_at(oldest->deadline);
  deadline_timer_.async_wait([self = shared_from_this()](const error_code&) {
    self->deadline_armed_ = false;
    self->check_deadlines();
    self->arm_deadline();
  });
}

void redis_connection::check_deadlines() {
  const auto now = std::chrono::steady_clock::now();
  if (!in_flight_.empty() && in_flight_.front().deadline <= now) {
    lost();  // the server does not answer: its replies can no longer be matched
    return;
  }
  if (in_flight_.empty()) {  // still connecting: the requests that waited too long fail
    while (!queued_.empty() && queued_.front().deadline <= now) {
      request r = std::move(queued_.front());
      queued_.pop_front();
      finish_callback(r.done);
    }
  }
  close_if_drained();
}

void redis_connection::close_if_drained() {
  if (!closing_ || !queued_.empty() || !in_flight_.empty() || writing_) return;
  if (state_ == state::closed && !lowest_socket().is_open() && !deadline_armed_) return;
  state_ = state::closed;
  ++generation_;
  error_code ignored;
  lowest_socket().close(ignored);
  resolver_.cancel();
  connect_timer_.cancel();
  deadline_timer_.cancel();
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
