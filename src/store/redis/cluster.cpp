// Key slots, redirects and the slot map of a Redis Cluster: see
// cluster.hpp.

#include "store/redis/cluster.hpp"

#include <algorithm>
#include <charconv>
#include <set>
#include <stdexcept>
#include <utility>

#include "store/redis/session.hpp"

// clang-format off
#include GHOSTLINK_ASIO_HEADER(post.hpp)
// clang-format on

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

/// `text` as a whole number in [0, most], or none.
std::optional<std::uint32_t> parse_number(std::string_view text, std::uint32_t most) {
  std::uint32_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty() || v > most) return std::nullopt;
  return v;
}

std::string node_name(const std::string& host, std::uint16_t port) { return host + ":" + std::to_string(port); }

}  // namespace

std::uint16_t redis_crc16(std::string_view bytes) noexcept {
  std::uint16_t crc = 0;
  for (const char c : bytes) {
    crc = static_cast<std::uint16_t>(crc ^ (static_cast<unsigned>(static_cast<unsigned char>(c)) << 8));
    for (int bit = 0; bit < 8; ++bit)
      crc = static_cast<std::uint16_t>((crc & 0x8000U) != 0 ? (crc << 1) ^ 0x1021U : crc << 1);
  }
  return crc;
}

std::uint16_t redis_key_slot(std::string_view key) noexcept {
  const std::size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const std::size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  return static_cast<std::uint16_t>(redis_crc16(key) % redis_slots);
}

std::optional<redis_redirect> parse_redis_redirect(std::string_view error) {
  redis_redirect out;
  if (error.starts_with("MOVED ")) {
    error.remove_prefix(6);
  } else if (error.starts_with("ASK ")) {
    out.ask = true;
    error.remove_prefix(4);
  } else {
    return std::nullopt;
  }
  const std::size_t space = error.find(' ');
  if (space == std::string_view::npos) return std::nullopt;
  const auto slot = parse_number(error.substr(0, space), redis_slots - 1);
  const std::string_view where = error.substr(space + 1);
  const std::size_t colon = where.rfind(':');
  if (!slot || colon == std::string_view::npos) return std::nullopt;
  const auto port = parse_number(where.substr(colon + 1), 65535);
  if (!port || *port == 0) return std::nullopt;
  out.slot = static_cast<std::uint16_t>(*slot);
  out.host = std::string(where.substr(0, colon));
  out.port = static_cast<std::uint16_t>(*port);
  return out;
}

std::optional<std::vector<redis_slot_range>> parse_cluster_slots(const redis_reply& reply) {
  using type = redis_reply::type;
  if (reply.kind != type::array) return std::nullopt;
  std::vector<redis_slot_range> out;
  for (const redis_reply& range : reply.elements) {
    // [first, last, [host, port, id, ...], replicas...]
    if (range.kind != type::array || range.elements.size() < 3) return std::nullopt;
    const redis_reply& first = range.elements[0];
    const redis_reply& last = range.elements[1];
    const redis_reply& master = range.elements[2];
    if (first.kind != type::integer || last.kind != type::integer || master.kind != type::array ||
        master.elements.size() < 2 || master.elements[0].kind != type::bulk || master.elements[1].kind != type::integer)
      return std::nullopt;
    const std::int64_t from = first.integer, to = last.integer, port = master.elements[1].integer;
    if (from < 0 || to < from || to >= static_cast<std::int64_t>(redis_slots)) return std::nullopt;
    const std::string_view host = master.elements[0].text();
    if (host == "?" || port <= 0 || port > 65535) continue;  // a master with no known endpoint: slots unknown
    out.push_back({static_cast<std::uint16_t>(from), static_cast<std::uint16_t>(to), std::string(host),
                   static_cast<std::uint16_t>(port)});
  }
  return out;
}

redis_cluster::redis_cluster(asio::any_io_executor io, std::vector<kv_redis_endpoint> seeds,
                             std::shared_ptr<const redis_session> session)
    : io_(std::move(io)), seeds_(std::move(seeds)), session_(std::move(session)), slots_(redis_slots) {
  if (seeds_.empty()) throw std::invalid_argument("kv_redis_store: no endpoint");
  for (const kv_redis_endpoint& e : seeds_)
    if (!e.unix_socket.empty()) throw std::invalid_argument("kv_redis_store: a cluster's endpoints are TCP");
}

redis_cluster::~redis_cluster() { close(); }

void redis_cluster::close() noexcept {
  std::map<std::string, node_ptr> nodes;
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
    nodes.swap(nodes_);
    for (node_ptr& n : slots_) n.reset();
  }
  for (auto& [name, node] : nodes) node->close();
}

redis_cluster::node_ptr redis_cluster::node_at(const std::string& host, std::uint16_t port) {
  if (closed_) return nullptr;
  const std::string name = node_name(host, port);
  if (auto found = nodes_.find(name); found != nodes_.end()) return found->second;
  if (nodes_.size() >= max_redis_nodes) return nullptr;
  auto node = std::make_shared<redis_node>(io_, kv_redis_endpoint{.host = host, .port = port}, session_);
  nodes_.emplace(name, node);
  return node;
}

redis_cluster::node_ptr redis_cluster::route(std::uint16_t slot, bool& unknown) {
  if (node_ptr n = slots_[slot]) return n;
  unknown = true;
  return node_at(seeds_.front().host, seeds_.front().port);
}

void redis_cluster::send(std::vector<routed> requests) {
  // The requests of each connection, in the order given; those that cannot
  // be sent fail on the I/O executor, never inside the caller's fetch().
  // `unsent` has room for all: moving one there cannot fail.
  using batch = std::vector<routed>;
  std::vector<std::pair<std::shared_ptr<redis_connection>, std::shared_ptr<batch>>> groups;
  auto unsent = std::make_shared<batch>();
  unsent->reserve(requests.size());
  std::size_t grouped = 0;
  bool unknown = false;
  try {
    std::lock_guard lock(mutex_);
    for (; grouped < requests.size(); ++grouped) {
      routed& r = requests[grouped];
      const node_ptr node = route(r.slot, unknown);
      if (!node) {
        unsent->push_back(std::move(r));
        continue;
      }
      std::shared_ptr<redis_connection> c = node->pick();
      auto group = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == c; });
      if (group == groups.end()) group = groups.insert(groups.end(), {std::move(c), std::make_shared<batch>()});
      group->second->push_back(std::move(r));
    }
  } catch (...) {  // memory refused while routing: what was not grouped fails
    for (; grouped < requests.size(); ++grouped) unsent->push_back(std::move(requests[grouped]));
  }
  if (unknown) refresh();
  for (auto& [connection, requests_of] : groups) {
    try {
      connection->run([self = shared_from_this(), c = connection, b = requests_of] {
        for (routed& r : *b) self->send_on(*c, std::move(r), 0, false);
      });
    } catch (...) {  // memory refused: this group fails
      for (routed& r : *requests_of) unsent->push_back(std::move(r));
    }
  }
  if (unsent->empty()) return;
  try {
    asio::post(io_, [unsent] {
      for (routed& r : *unsent) redis_connection::fail(r.done);
    });
  } catch (...) {  // the executor's own failure: they fail here
    for (routed& r : *unsent) redis_connection::fail(r.done);
  }
}

void redis_cluster::send_on(redis_connection& c, routed r, unsigned hops, bool asking) noexcept {
  try {
    redis_connection::callback done = follow(r, hops, c.endpoint().host);
    if (asking) c.send_here(redis_command({"ASKING"}), [](const redis_reply&) {});
    c.send_here(r.command, std::move(done));
  } catch (...) {  // memory refused: the request fails
    redis_connection::fail(r.done);
  }
}

redis_connection::callback redis_cluster::follow(routed r, unsigned hops, const std::string& host) {
  return [self = shared_from_this(), r = std::move(r), hops, host](redis_reply reply) mutable {
    if (reply.kind == redis_reply::type::error) {
      if (const std::optional<redis_redirect> to = parse_redis_redirect(reply.text())) {
        self->redirect(std::move(r), *to, hops + 1, host);
        return;
      }
    }
    if (reply.kind == redis_reply::type::failed) self->refresh(false);
    r.done(std::move(reply));
  };
}

void redis_cluster::redirect(routed r, const redis_redirect& to, unsigned hops, const std::string& from_host) noexcept {
  if (hops > max_redis_redirects) {
    redis_connection::fail(r.done);
    return;
  }
  try {
    node_ptr node;
    {
      std::lock_guard lock(mutex_);
      node = node_at(to.host.empty() ? from_host : to.host, to.port);
      if (node && !to.ask) slots_[to.slot] = node;
    }
    if (!to.ask) refresh();
    if (!node) {
      redis_connection::fail(r.done);
      return;
    }
    std::shared_ptr<redis_connection> c = node->pick();
    c->run([self = shared_from_this(), c, r, ask = to.ask, hops]() mutable {
      self->send_on(*c, std::move(r), hops, ask);  // ASKING and the request back to back
    });
  } catch (...) {  // memory refused: the request fails
    redis_connection::fail(r.done);
  }
}

void redis_cluster::refresh(bool urgent) noexcept {
  std::shared_ptr<std::vector<kv_redis_endpoint>> candidates;
  try {
    std::lock_guard lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    if (refreshing_ || closed_ || (!urgent && now - last_refresh_ < session_->timeouts.backoff)) return;
    last_refresh_ = now;
    // The seeds, then the other nodes known: the first to answer is taken.
    candidates = std::make_shared<std::vector<kv_redis_endpoint>>(seeds_);
    std::set<std::string> named;
    for (const kv_redis_endpoint& e : seeds_) named.insert(node_name(e.host, e.port));
    for (const auto& [name, node] : nodes_)
      if (!named.contains(name)) candidates->push_back(node->connections().front()->endpoint());
    refreshing_ = true;
  } catch (...) {  // memory refused: read another time
    return;
  }
  refresh_from(candidates, 0);
}

void redis_cluster::refresh_from(const std::shared_ptr<const std::vector<kv_redis_endpoint>>& candidates,
                                 std::size_t i) noexcept {
  try {
    node_ptr node;
    {
      std::lock_guard lock(mutex_);
      if (i < candidates->size()) node = node_at((*candidates)[i].host, (*candidates)[i].port);
      if (!node) {  // none answered (or closed): read another time
        refreshing_ = false;
        return;
      }
    }
    node->pick()->send(redis_command({"CLUSTER", "SLOTS"}),
                       [self = shared_from_this(), candidates, i](const redis_reply& reply) {
                         const std::string& host = (*candidates)[i].host;
                         std::optional<std::vector<redis_slot_range>> ranges = parse_cluster_slots(reply);
                         if (!ranges || ranges->empty()) {
                           self->refresh_from(candidates, i + 1);
                           return;
                         }
                         try {
                           self->install(*ranges, host);
                           self->session_->mapped();
                         } catch (...) {  // memory refused: the map stays as it was
                         }
                         std::lock_guard lock(self->mutex_);
                         self->refreshing_ = false;
                       });
  } catch (...) {  // memory refused: read another time
    std::lock_guard lock(mutex_);
    refreshing_ = false;
  }
}

void redis_cluster::install(const std::vector<redis_slot_range>& ranges, const std::string& asked_host) {
  std::lock_guard lock(mutex_);
  if (closed_) return;
  std::vector<node_ptr> slots(redis_slots);
  for (const redis_slot_range& range : ranges) {
    const node_ptr node = node_at(range.host.empty() ? asked_host : range.host, range.port);
    for (std::size_t s = range.first; s <= range.last; ++s) slots[s] = node;
  }
  slots_.swap(slots);
  // Nodes no longer masters and not seeds close (once their requests are
  // answered): they would otherwise reconnect for ever.
  std::set<const redis_node*> masters;
  for (const node_ptr& n : slots_) masters.insert(n.get());
  std::set<std::string> seeds;
  for (const kv_redis_endpoint& e : seeds_) seeds.insert(node_name(e.host, e.port));
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    if (masters.contains(it->second.get()) || seeds.contains(it->first)) {
      ++it;
      continue;
    }
    it->second->close();
    it = nodes_.erase(it);
  }
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
