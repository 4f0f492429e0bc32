#pragma once
// The connections to one Redis server (a single server, or one master of a
// Redis Cluster): `connections` of them, each pipelined, requests spread
// round robin over those taking requests.
//
// Made and closed by its owner (the store, or the cluster's node map);
// `pick()` and `next()` may be called from any thread.

#include <atomic>
#include <cstddef>
#include <memory>
#include <vector>

#include "store/redis/connection.hpp"
#include "store/redis/session.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class redis_node {
 public:
  /// The session's number of connections to `endpoint`, started (connecting in the background).
  redis_node(const asio::any_io_executor& ex, const kv_redis_endpoint& endpoint,
             const std::shared_ptr<const redis_session>& session) {
    connections_.reserve(session->connections);
    for (std::size_t i = 0; i < session->connections; ++i)
      connections_.push_back(std::make_shared<redis_connection>(ex, endpoint, session));
    for (const auto& c : connections_) c->start();
  }
  redis_node(const redis_node&) = delete;
  redis_node& operator=(const redis_node&) = delete;
  ~redis_node() { close(); }

  const std::vector<std::shared_ptr<redis_connection>>& connections() const noexcept { return connections_; }
  /// A number to start a round robin at.
  std::size_t next() noexcept { return next_.fetch_add(1, std::memory_order_relaxed); }
  /// The connections taking requests; all of them if none is (whose
  /// requests then fail at once).
  std::vector<std::shared_ptr<redis_connection>> taking() const {
    std::vector<std::shared_ptr<redis_connection>> out;
    for (const auto& c : connections_)
      if (c->accepting()) out.push_back(c);
    return out.empty() ? connections_ : out;
  }
  /// A connection taking requests, round robin; any if none is.
  std::shared_ptr<redis_connection> pick() noexcept {
    const std::size_t k = connections_.size();
    const std::size_t first = next();
    for (std::size_t j = 0; j < k; ++j)
      if (connections_[(first + j) % k]->accepting()) return connections_[(first + j) % k];
    return connections_[first % k];
  }
  /// Closes every connection once the requests on it are answered or time
  /// out (idempotent).
  void close() noexcept {
    for (const auto& c : connections_) {
      try {
        c->close();
      } catch (...) {  // memory refused: it closes when its I/O context goes
      }
    }
  }

 private:
  std::vector<std::shared_ptr<redis_connection>> connections_;
  std::atomic<std::size_t> next_{0};
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
