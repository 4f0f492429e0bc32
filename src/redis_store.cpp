// kv_redis_store: entries as Redis strings, over pipelined connections
// (redis_connection.hpp).
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
#include <thread>
#include <utility>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"
#include "ghostlink/redis_store.hpp"
#include "redis_connection.hpp"

// clang-format off
#include GHOSTLINK_ASIO_HEADER(io_context.hpp)
// clang-format on

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

constexpr std::string_view key_prefix = "ghostlink:v1:";

/// `SET key value [EX ttl]`, the value encoded in place.
std::string set_command(const kv_store_value& value, const std::optional<std::uint64_t>& ttl) {
  const std::string key = std::string(key_prefix) + value.hash().hex();
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

/// The counters, and the puts flush() waits for.
class redis_counters {
 public:
  explicit redis_counters(std::size_t max_pending_bytes) : max_pending_bytes_(max_pending_bytes) {}

  /// Counts a put; false if it is dropped.
  bool begin_put(std::size_t size) noexcept {
    std::lock_guard lock(mutex_);
    ++stats_.puts;
    if (pending_bytes_ + size > max_pending_bytes_) {
      ++stats_.dropped;
      return false;
    }
    pending_bytes_ += size;
    ++pending_puts_;
    return true;
  }
  void finish_put(std::size_t size, bool stored) noexcept {
    std::lock_guard lock(mutex_);
    ++(stored ? stats_.stored : stats_.write_errors);
    pending_bytes_ -= size;
    if (--pending_puts_ == 0) idle_.notify_all();
  }
  void lookups(std::size_t n) noexcept {
    std::lock_guard lock(mutex_);
    stats_.lookups += n;
  }
  void hit() noexcept {
    std::lock_guard lock(mutex_);
    ++stats_.hits;
  }
  kv_store_stats stats() const noexcept {
    std::lock_guard lock(mutex_);
    kv_store_stats s = stats_;
    s.pending_bytes = pending_bytes_;
    return s;
  }
  void flush() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return pending_puts_ == 0; });
  }

 private:
  const std::size_t max_pending_bytes_;
  mutable std::mutex mutex_;
  std::condition_variable idle_;
  kv_store_stats stats_;
  std::size_t pending_bytes_ = 0;
  std::size_t pending_puts_ = 0;
};

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
};

}  // namespace

class redis_store_state {
 public:
  redis_store_state(std::vector<kv_redis_endpoint> endpoints, kv_redis_store_options options)
      : options_(std::move(options)), counters_(std::make_shared<redis_counters>(options_.max_pending_bytes)) {
    if (endpoints.empty()) throw std::invalid_argument("kv_redis_store: no endpoint");
    if (options_.connections == 0) throw std::invalid_argument("kv_redis_store: 0 connections");
    if (endpoints.front().unix_socket.size() >= sizeof(sockaddr_un{}.sun_path))
      throw std::invalid_argument("kv_redis_store: unix socket path too long");
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
    const redis_timeouts timeouts{options_.connect_timeout, options_.request_timeout, options_.reconnect_backoff};
    for (std::size_t i = 0; i < options_.connections; ++i)
      connections_.push_back(std::make_shared<redis_connection>(io_, endpoints.front(), timeouts));
    for (const auto& c : connections_) c->start();
  }
  redis_store_state(const redis_store_state&) = delete;
  redis_store_state& operator=(const redis_store_state&) = delete;

  ~redis_store_state() {
    for (const auto& c : connections_) {
      try {
        c->close();
      } catch (...) {  // memory refused: it closes when its I/O context goes
      }
    }
    connections_.clear();
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
    if (!counters_->begin_put(size)) return;
    try {
      std::shared_ptr<redis_connection> c = pick();
      c->run([c, counters = counters_, value = std::move(value), size, ttl = options_.ttl_seconds]() mutable {
        std::string command;
        bool encoded = false;
        if (c->accepting()) {  // else down: fails at once, without encoding
          try {
            command = set_command(*value, ttl);
            encoded = true;
          } catch (...) {  // memory refused: not stored
          }
        }
        // The blocks a write-through value holds go back now, before
        // flush() may return: a caller that flushed may count on them.
        value.reset();
        if (!encoded) {
          counters->finish_put(size, false);
          return;
        }
        c->send_here(std::move(command), [counters, size](redis_reply reply) {
          const bool ok = reply.kind == redis_reply::type::status && reply.bytes.size() == 2 &&
                          reply.bytes[0] == std::byte{'O'} && reply.bytes[1] == std::byte{'K'};
          counters->finish_put(size, ok);
        });
      });
    } catch (...) {  // memory refused, or the executor's own failure: not stored
      counters_->finish_put(size, false);
    }
  }

  void fetch(std::vector<kv_block_hash> hashes, kv_block_store::fetch_handler on_value) {
    auto request = std::make_shared<fetch_request>(std::move(on_value));
    // The GETs of each connection, made before anything is sent.
    const std::size_t k = connections_.size();
    const std::size_t first = next_.fetch_add(1, std::memory_order_relaxed);
    std::vector<std::vector<std::pair<std::size_t, std::string>>> batches(k);
    for (std::size_t i = 0; i < hashes.size(); ++i)
      batches[(first + i) % k].emplace_back(i, redis_command({"GET", std::string(key_prefix) + hashes[i].hex()}));
    counters_->lookups(hashes.size());
    std::size_t sent = 0;
    try {
      for (; sent < k; ++sent) {
        if (batches[sent].empty()) continue;
        const std::shared_ptr<redis_connection>& c = connections_[sent];
        c->run([c, request, counters = counters_, batch = std::move(batches[sent])]() mutable {
          for (auto& [i, command] : batch)
            c->send_here(std::move(command), [request, counters, i = i](redis_reply reply) {
              std::vector<std::byte> bytes;
              if (reply.kind == redis_reply::type::bulk && !reply.bytes.empty()) {
                counters->hit();
                bytes = std::move(reply.bytes);
              }
              request->deliver(i, std::move(bytes));
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

 private:
  /// A connection taking requests, round robin; any if none is.
  std::shared_ptr<redis_connection> pick() noexcept {
    const std::size_t k = connections_.size();
    const std::size_t first = next_.fetch_add(1, std::memory_order_relaxed);
    for (std::size_t j = 0; j < k; ++j)
      if (connections_[(first + j) % k]->accepting()) return connections_[(first + j) % k];
    return connections_[first % k];
  }

  const kv_redis_store_options options_;
  std::unique_ptr<asio::io_context> own_io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard_;
  std::thread thread_;
  asio::any_io_executor io_;
  std::shared_ptr<redis_counters> counters_;
  std::vector<std::shared_ptr<redis_connection>> connections_;
  std::atomic<std::size_t> next_{0};
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
std::string kv_redis_store::key_of(const kv_block_hash& hash) { return std::string(detail::key_prefix) + hash.hex(); }
void kv_redis_store::flush() { state_->flush(); }

GHOSTLINK_NAMESPACE_END
