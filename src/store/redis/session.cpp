// A Redis store's session and readiness: see session.hpp.

#include "store/redis/session.hpp"

#include <openssl/ssl.h>

#include <filesystem>
#include <system_error>
#include <utility>
#include <vector>

#include "base/throw_errc.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

/// The TLS context of `o`: TLS 1.2 or later, its CA (else the system's),
/// its client certificate and key if given.
std::shared_ptr<asio::ssl::context> make_tls_context(const kv_redis_tls_options& o) {
  auto ctx = std::make_shared<asio::ssl::context>(asio::ssl::context::tls_client);
  if (SSL_CTX_set_min_proto_version(ctx->native_handle(), TLS1_2_VERSION) != 1) throw_errc(kv_errc::invalid_config);
  ctx->set_options(asio::ssl::context::default_workarounds | asio::ssl::context::no_compression);
  error_code ec;
  ctx->set_verify_mode(o.verify ? asio::ssl::verify_peer : asio::ssl::verify_none, ec);
  if (!o.ca_file.empty()) ctx->load_verify_file(o.ca_file, ec);
  if (!ec && !o.ca_directory.empty()) {
    std::error_code ignored;
    if (!std::filesystem::is_directory(o.ca_directory, ignored)) throw_errc(kv_errc::invalid_config);
    ctx->add_verify_path(o.ca_directory, ec);
  }
  if (!ec && o.ca_file.empty() && o.ca_directory.empty()) ctx->set_default_verify_paths(ec);
  if (o.certificate_file.empty() != o.private_key_file.empty()) throw_errc(kv_errc::invalid_config);
  if (!ec && !o.certificate_file.empty()) ctx->use_certificate_chain_file(o.certificate_file, ec);
  if (!ec && !o.private_key_file.empty()) ctx->use_private_key_file(o.private_key_file, asio::ssl::context::pem, ec);
  if (ec) throw_errc(kv_errc::invalid_config);  // the files' names stay out of the error: a path may say too much
  return ctx;
}

}  // namespace

std::shared_ptr<redis_session> make_redis_session(const kv_redis_store_options& options,
                                                  std::shared_ptr<redis_counters> counters) {
  auto s = std::make_shared<redis_session>();
  s->timeouts = {options.connect_timeout, options.request_timeout, options.reconnect_backoff};
  s->connections = options.connections;
  if (!options.password.empty()) {
    s->hello += options.username.empty() ? redis_command({"AUTH", options.password})
                                         : redis_command({"AUTH", options.username, options.password});
    ++s->hello_replies;
  }
  if (options.database != 0) {
    s->hello += redis_command({"SELECT", std::to_string(options.database)});
    ++s->hello_replies;
  }
  if (s->hello_replies == 0) {
    s->hello = redis_command({"PING"});
    s->hello_replies = 1;
  }
  if (options.tls) {
    s->tls = make_tls_context(*options.tls);
    s->server_name = options.tls->server_name;
    s->verify = options.tls->verify;
  }
  s->ready_on_hello = !options.cluster;
  s->counters = std::move(counters);
  return s;
}

void redis_readiness::finish(waiter& w, error_code ec) noexcept {
  try {
    w.timer->cancel();
  } catch (...) {  // its wait then finds no waiter
  }
  complete(w.op, ec);
}

void redis_readiness::complete(io_op* op, error_code ec) noexcept {
  try {
    op->complete(ec, queueing::post);
  } catch (...) {  // memory refused for the completion: the handler is gone with it
  }
}

void redis_readiness::wait(io_op* op) {
  try {
    std::lock_guard lock(mutex_);
    if (ready_now_ || closed_) {
      complete(op, ready_now_ && !closed_ ? error_code() : error_code(asio::error::operation_aborted));
      return;
    }
    auto timer = std::make_shared<asio::steady_timer>(io_, patience_);
    const std::uint64_t id = next_id_++;
    waiters_.emplace(id, waiter{op, timer});
    // Under the lock: settle() cancels it only once it waits.
    timer->async_wait([self = shared_from_this(), id](const error_code&) {
      io_op* late = nullptr;
      {
        std::lock_guard relock(self->mutex_);
        const auto it = self->waiters_.find(id);
        if (it == self->waiters_.end()) return;
        late = it->second.op;
        self->waiters_.erase(it);
      }
      complete(late, kv_errc::store_unavailable);
    });
  } catch (...) {  // memory refused: whatever holds `op` completes it, else it is discarded here
    std::lock_guard lock(mutex_);
    for (const auto& [id, w] : waiters_)
      if (w.op == op) return;
    op->discard();
    throw;
  }
}

void redis_readiness::settle(error_code ec) noexcept {
  std::map<std::uint64_t, waiter> done;
  {
    std::lock_guard lock(mutex_);
    ready_now_ = !ec;
    if (closed_) return;
    done.swap(waiters_);
  }
  for (auto& [id, w] : done) finish(w, ec);
}

void redis_readiness::close() noexcept {
  std::map<std::uint64_t, waiter> done;
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
    done.swap(waiters_);
  }
  for (auto& [id, w] : done) finish(w, asio::error::operation_aborted);
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
