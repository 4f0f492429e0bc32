// kv_redis_store: entries as Redis strings, over pipelined connections
// (connection.hpp) to one server (node.hpp) or to the masters of
// a Redis Cluster (cluster.hpp).
//
// The state (redis_store_state) belongs to the handle alone; what the
// requests in flight need (the counters, the connections) is shared with
// them, so a request's completion never destroys the state. With an I/O
// context of its own, the state's destructor closes the connections once
// their requests are done and joins the context's thread; if the last
// handle goes on that very thread (a fetch handler holding the store), the
// thread is joined by another one instead.

#include <sys/un.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "base/throw_errc.hpp"
#include "ghostlink/detail/asio_config.hpp"
#include "ghostlink/redis_store.hpp"
#include "store/redis/cluster.hpp"
#include "store/redis/connection.hpp"
#include "store/redis/node.hpp"
#include "store/redis/requests.hpp"
#include "store/redis/session.hpp"

// clang-format off
#include GHOSTLINK_ASIO_HEADER(io_context.hpp)
#include GHOSTLINK_ASIO_HEADER(post.hpp)
// clang-format on

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

/// A put's reply, counted (an error reply recorded); its value's receipt
/// (null: none) told stored() on OK.
redis_connection::callback count_put(std::shared_ptr<redis_counters> counters, pending_puts::ticket t, std::size_t size,
                                     std::shared_ptr<kv_store_receipt> receipt) {
  return [counters = std::move(counters), t, size, receipt = std::move(receipt)](const redis_reply& reply) {
    counters->refused(reply);
    const bool stored = redis_stored(reply);
    if (stored && receipt) receipt->stored();
    counters->finish_put(t, size, stored);
  };
}

/// Throws what the header documents for bad endpoints or options.
void check(const std::vector<kv_redis_endpoint>& endpoints, const kv_redis_store_options& o) {
  if (endpoints.empty()) throw std::invalid_argument("kv_redis_store: no endpoint");
  if (o.connections == 0) throw std::invalid_argument("kv_redis_store: 0 connections");
  if (endpoints.front().unix_socket.size() >= sizeof(sockaddr_un{}.sun_path))
    throw std::invalid_argument("kv_redis_store: unix socket path too long");
  if (o.cluster)
    for (const kv_redis_endpoint& e : endpoints)
      if (!e.unix_socket.empty()) throw std::invalid_argument("kv_redis_store: a cluster's endpoints are TCP");
  for (const kv_redis_endpoint& e : o.cluster ? endpoints : std::vector<kv_redis_endpoint>{endpoints.front()}) {
    if (e.unix_socket.empty() && (e.host.empty() || e.port == 0)) throw_errc(kv_errc::invalid_config);
    if (!e.unix_socket.empty() && o.tls) throw_errc(kv_errc::invalid_config);  // TLS is for TCP
  }
  if (o.ttl_seconds && (*o.ttl_seconds == 0 || *o.ttl_seconds > kv_redis_store::max_ttl_seconds))
    throw_errc(kv_errc::invalid_config);
  if (o.database > kv_redis_store::max_database || (o.cluster && o.database != 0)) throw_errc(kv_errc::invalid_config);
  if (!o.username.empty() && o.password.empty()) throw_errc(kv_errc::invalid_config);
  if (o.connect_timeout.count() <= 0 || o.request_timeout.count() <= 0 || o.reconnect_backoff.count() < 0)
    throw_errc(kv_errc::invalid_config);
}

}  // namespace

std::string redis_set_command(const kv_store_value& value, const std::optional<std::uint64_t>& ttl) {
  const std::string key = redis_key(value.hash());
  const std::size_t size = value.size();
  std::string out = ttl ? "*5\r\n" : "*3\r\n";
  out += "$3\r\nSET\r\n$" + std::to_string(key.size()) + "\r\n" + key + "\r\n$" + std::to_string(size) + "\r\n";
  const std::size_t at = out.size();
  out.resize(at + size);
  value.encode(std::span<std::byte>(reinterpret_cast<std::byte*>(out.data() + at), size));
  out += "\r\n";
  if (ttl) {
    const std::string seconds = std::to_string(*ttl);
    out += "$2\r\nEX\r\n$" + std::to_string(seconds.size()) + "\r\n" + seconds + "\r\n";
  }
  return out;
}

class redis_store_state {
 public:
  redis_store_state(std::vector<kv_redis_endpoint> endpoints, kv_redis_store_options options)
      : options_(std::move(options)), counters_(std::make_shared<redis_counters>(options_.max_pending_bytes)) {
    check(endpoints, options_);
    // The TLS files are read before anything starts: unreadable, nothing runs.
    std::shared_ptr<redis_session> session = make_redis_session(options_, counters_);
    if (options_.io_executor) {
      io_ = *options_.io_executor;
    } else {
      own_io_ = std::make_unique<asio::io_context>(1);
      guard_.emplace(own_io_->get_executor());
      io_ = own_io_->get_executor();
      thread_ = std::thread([io = own_io_.get()] {
        for (;;) {
          try {
            io->run();
            return;
          } catch (...) {  // no handler of ours throws; a handler's own failure is not the store's end
          }
        }
      });
    }
    readiness_ = std::make_shared<redis_readiness>(
        io_, options_.connect_timeout + 2 * options_.request_timeout + options_.reconnect_backoff);
    session->readiness = readiness_;
    if (options_.cluster) {
      cluster_ = std::make_shared<redis_cluster>(io_, std::move(endpoints), session);
      cluster_->start();
    } else {
      node_ = std::make_unique<redis_node>(io_, endpoints.front(), session);
    }
  }
  redis_store_state(const redis_store_state&) = delete;
  redis_store_state& operator=(const redis_store_state&) = delete;

  ~redis_store_state() {
    readiness_->close();
    if (cluster_) cluster_->close();
    cluster_.reset();
    node_.reset();  // closes its connections
    if (!own_io_) return;
    guard_.reset();
    if (thread_.get_id() != std::this_thread::get_id()) {
      thread_.join();
      return;
    }
    // The last handle went on the context's own thread: another thread
    // joins it once the handler it is in returns.
    std::thread([io = std::move(own_io_), t = std::move(thread_)]() mutable {
      t.join();
      io.reset();
    }).detach();
  }

  void put(std::shared_ptr<const kv_store_value> value) noexcept {
    const std::size_t size = value->size();
    const pending_puts::ticket t = counters_->begin_put(size);
    if (t == 0) return;
    if (cluster_) {
      put_in_cluster(std::move(value), t, size);
      return;
    }
    try {
      std::shared_ptr<redis_connection> c = node_->pick();
      c->run([c, counters = counters_, value = std::move(value), t, size, ttl = options_.ttl_seconds]() mutable {
        std::string command;
        bool encoded = false;
        if (c->accepting()) {  // else down: fails at once, without encoding
          try {
            command = redis_set_command(*value, ttl);
            encoded = true;
          } catch (...) {  // memory refused: not stored
          }
        }
        // The blocks a write-through value holds go back now, before
        // flush() may return: a caller that flushed may count on them.
        std::shared_ptr<kv_store_receipt> receipt = value->receipt();
        value.reset();
        if (!encoded) {
          counters->finish_put(t, size, false);
          return;
        }
        c->send_here(std::move(command), count_put(counters, t, size, std::move(receipt)));
      });
    } catch (...) {  // memory refused, or the executor's own failure: not stored
      counters_->finish_put(t, size, false);
    }
  }

  void fetch(std::vector<kv_block_hash> hashes, kv_block_store::fetch_handler on_value) {
    auto request = std::make_shared<fetch_request>(std::move(on_value));
    if (cluster_) {
      fetch_in_cluster(hashes, request);
      return;
    }
    // The GETs of each connection taking requests (one down until its
    // backoff ends would fail its share at once), made before anything is sent.
    const std::vector<std::shared_ptr<redis_connection>> connections = node_->taking();
    const std::size_t k = connections.size();
    const std::size_t first = node_->next();
    std::vector<std::vector<std::pair<std::size_t, std::string>>> batches(k);
    for (std::size_t i = 0; i < hashes.size(); ++i)
      batches[(first + i) % k].emplace_back(i, redis_command({"GET", redis_key(hashes[i])}));
    counters_->lookups(hashes.size());
    std::size_t sent = 0;
    try {
      for (; sent < k; ++sent) {
        if (batches[sent].empty()) continue;
        const std::shared_ptr<redis_connection>& c = connections[sent];
        c->run([c, request, counters = counters_, batch = std::move(batches[sent])]() mutable {
          for (auto& [i, command] : batch)
            c->send_here(std::move(command), [request, counters, i = i](redis_reply reply) {
              request->answer(i, std::move(reply), *counters);
            });
        });
      }
    } catch (...) {  // memory refused part way: the GETs not sent are misses
      for (std::size_t i = 0; i < hashes.size(); ++i)
        if ((first + i) % k >= sent) request->deliver(i, {});
    }
  }

  kv_store_stats stats() const noexcept { return counters_->stats(); }
  void flush() { counters_->flush(); }
  void when_flushed(std::function<void()> done) { counters_->when_flushed(std::move(done)); }
  void limit_value_size(std::size_t bytes) noexcept { counters_->limit_value_size(bytes); }
  void wait_ready(io_op* op) { readiness_->wait(op); }
  const asio::any_io_executor& executor() const noexcept { return io_; }

 private:
  /// Encodes `value` on the I/O executor, then sends it to its slot's master.
  void put_in_cluster(std::shared_ptr<const kv_store_value> value, pending_puts::ticket t, std::size_t size) noexcept {
    try {
      const std::uint16_t slot = redis_key_slot(redis_key(value->hash()));
      asio::post(io_, [cluster = cluster_, counters = counters_, value = std::move(value), t, size, slot,
                       ttl = options_.ttl_seconds]() mutable {
        redis_connection::shared_command command;
        try {
          command = std::make_shared<const std::string>(redis_set_command(*value, ttl));
        } catch (...) {  // memory refused: not stored
        }
        std::shared_ptr<kv_store_receipt> receipt = value->receipt();
        value.reset();  // as above: before flush() may return
        if (!command) {
          counters->finish_put(t, size, false);
          return;
        }
        try {
          std::vector<redis_cluster::routed> one;
          one.push_back({slot, std::move(command), count_put(counters, t, size, std::move(receipt))});
          cluster->send(std::move(one));
        } catch (...) {  // memory refused: not sent
          counters->finish_put(t, size, false);
        }
      });
    } catch (...) {  // memory refused, or the executor's own failure: not stored
      counters_->finish_put(t, size, false);
    }
  }

  /// The GETs, each to its slot's master, pipelined on each node.
  void fetch_in_cluster(const std::vector<kv_block_hash>& hashes, const std::shared_ptr<fetch_request>& request) {
    std::vector<redis_cluster::routed> gets;
    gets.reserve(hashes.size());
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      const std::string key = redis_key(hashes[i]);
      gets.push_back(
          {redis_key_slot(key), std::make_shared<const std::string>(redis_command({"GET", key})),
           [request, counters = counters_, i](redis_reply reply) { request->answer(i, std::move(reply), *counters); }});
    }
    counters_->lookups(hashes.size());
    cluster_->send(std::move(gets));
  }

  const kv_redis_store_options options_;
  std::unique_ptr<asio::io_context> own_io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard_;
  std::thread thread_;
  asio::any_io_executor io_;
  std::shared_ptr<redis_counters> counters_;
  std::shared_ptr<redis_readiness> readiness_;
  std::unique_ptr<redis_node> node_;           // one server
  std::shared_ptr<redis_cluster> cluster_;   // or a Redis Cluster
};

}  // namespace detail

kv_redis_store::kv_redis_store(std::vector<kv_redis_endpoint> endpoints, kv_redis_store_options options)
    : state_(std::make_unique<detail::redis_store_state>(std::move(endpoints), std::move(options))) {}

kv_redis_store::~kv_redis_store() = default;

void kv_redis_store::put(std::shared_ptr<const kv_store_value> value) noexcept {
  if (value) state_->put(std::move(value));
}
void kv_redis_store::fetch(std::vector<kv_block_hash> hashes, fetch_handler on_value) {
  state_->fetch(std::move(hashes), std::move(on_value));
}
kv_store_stats kv_redis_store::stats() const noexcept { return state_->stats(); }
std::string kv_redis_store::key_of(const kv_block_hash& hash) { return detail::redis_key(hash); }
void kv_redis_store::flush() { state_->flush(); }
void kv_redis_store::when_flushed(std::function<void()> done) { state_->when_flushed(std::move(done)); }
void kv_redis_store::limit_value_size(std::size_t bytes) noexcept { state_->limit_value_size(bytes); }
asio::any_io_executor kv_redis_store::executor() const noexcept { return state_->executor(); }
void kv_redis_store::start_wait_ready(detail::io_op* op) { state_->wait_ready(op); }

GHOSTLINK_NAMESPACE_END
