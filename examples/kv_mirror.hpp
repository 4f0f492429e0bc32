#pragma once
// A router's view of a server's prefix cache, from its KV events as
// kv_event_publisher sends them in vLLM v0.25.1's format (docs/API.md, "KV
// events on the wire"): a SUB socket for the batches, a DEALER for replays
// and dumps, and a mirror of the cache's entries from the payloads
// (decoded with nlohmann::json's from_msgpack). follower joins from a dump
// and keeps the mirror exact through gaps. Every wait is bounded (10 s).
// Shared by kv_router and tests/events.

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ghostlink/event_publisher.hpp"

namespace kv_mirror {

using ghostlink::kv_block_hash;
using ghostlink::kv_prefix_dump;
using ghostlink::kv_wire_hash;
using ghostlink::token_id;

using json = nlohmann::json;
inline constexpr std::chrono::milliseconds patience{10'000};

/// 8 bytes, big-endian.
inline std::uint64_t seq_of(const zmq::message_t& m) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < m.size(); ++i) v = v << 8 | static_cast<const std::uint8_t*>(m.data())[i];
  return v;
}
inline std::string seq_bytes(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 7; i >= 0; --i, v >>= 8) s[static_cast<std::size_t>(i)] = static_cast<char>(v & 0xff);
  return s;
}

/// One batch as it came.
struct batch {
  std::uint64_t seq = 0;
  std::string payload;
};

/// A hash as the mirror keys it: the bytes of a binary value, or the
/// decimal digits of an integer.
inline std::string key_of(const json& h) {
  if (h.is_binary()) return {h.get_binary().begin(), h.get_binary().end()};
  return std::to_string(h.get<std::uint64_t>());
}
/// A kv_block_hash as the publisher sends it in `form`.
inline std::string key_of(const kv_block_hash& h, kv_wire_hash form) {
  if (form == kv_wire_hash::bytes) return {h.bytes.begin(), h.bytes.end()};
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < 8; ++i) v = v << 8 | h.bytes[i];
  return std::to_string(v);
}

/// A cache's entries as a router keeps them: by tier (the events'
/// `medium`: "RAM", and the store's, "FILE" or "REDIS") and hash.
struct mirror {
  struct entry {
    std::optional<std::string> parent;
    std::vector<token_id> tokens;
    bool operator==(const entry&) const = default;
  };
  using key = std::pair<std::string, std::string>;  // medium, hash
  std::map<key, entry> entries;

  /// Applies one payload's events (idempotently, as after a dump).
  void apply(std::string_view payload) {
    const json b = json::from_msgpack(payload);
    for (const json& e : b.at(1)) {
      const std::string type = e.at("type");
      if (type == "AllBlocksCleared") {
        entries.clear();
        continue;
      }
      const json& hashes = e.at("block_hashes");
      const std::string medium = e.at("medium");
      if (type == "BlockRemoved") {
        for (const json& h : hashes) entries.erase({medium, key_of(h)});
        continue;
      }
      const std::size_t bs = e.at("block_size");
      const std::vector<token_id> tokens = e.at("token_ids");
      std::optional<std::string> parent;
      if (!e.at("parent_block_hash").is_null()) parent = key_of(e.at("parent_block_hash"));
      for (std::size_t i = 0; i < hashes.size(); ++i) {
        const std::string k = key_of(hashes[i]);
        std::vector<token_id> t;
        if (tokens.size() >= (i + 1) * bs)
          t.assign(tokens.begin() + static_cast<std::ptrdiff_t>(i * bs),
                   tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * bs));
        entries[{medium, k}] = {parent, std::move(t)};
        parent = k;
      }
    }
  }
  /// The mirror a dump of the cache itself gives (its store tier's medium `store`).
  static mirror of(const kv_prefix_dump& d, kv_wire_hash form, const std::string& store = "STORE") {
    mirror m;
    for (const kv_prefix_dump::entry& e : d.entries)
      m.entries[{e.tier == ghostlink::kv_prefix_tier::store ? store : "RAM", key_of(e.hash, form)}] = {
          e.parent ? std::optional(key_of(*e.parent, form)) : std::nullopt, e.token_ids};
    return m;
  }
  /// Whether `medium` holds the entry of `hash` (key_of's).
  bool holds(const std::string& medium, const std::string& hash) const { return entries.contains({medium, hash}); }
};

class wire_client {
 public:
  wire_client(const std::string& endpoint, const std::string& replay_endpoint) {
    sub_.set(zmq::sockopt::linger, 0);
    sub_.set(zmq::sockopt::subscribe, "");
    sub_.set(zmq::sockopt::rcvhwm, 0);
    sub_.connect(endpoint);
    dealer_.set(zmq::sockopt::linger, 0);
    dealer_.connect(replay_endpoint);
  }

  /// The next published batch; none if none came within `wait`.
  std::optional<batch> next(std::chrono::milliseconds wait = patience) {
    zmq::pollitem_t item{sub_.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, wait) == 0) return std::nullopt;
    std::vector<zmq::message_t> m;
    if (!zmq::recv_multipart(sub_, std::back_inserter(m)) || m.size() != 3) return std::nullopt;
    return batch{seq_of(m[1]), m[2].to_string()};
  }

  /// Sends `body` on the replay socket, as a DEALER does ([empty, body]),
  /// and collects the reply up to its end: the batches, then true if the
  /// end came (false: none came within `wait`, or a malformed one).
  bool request(std::string_view body, std::vector<batch>& out, std::chrono::milliseconds wait = patience) {
    dealer_.send(zmq::message_t(), zmq::send_flags::sndmore);
    dealer_.send(zmq::buffer(body));
    return collect(out, wait);
  }
  /// Collects a reply's messages ([empty, seq, payload]) up to the end.
  bool collect(std::vector<batch>& out, std::chrono::milliseconds wait = patience) {
    for (;;) {
      zmq::pollitem_t item{dealer_.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, wait) == 0) return false;
      std::vector<zmq::message_t> m;
      if (!zmq::recv_multipart(dealer_, std::back_inserter(m)) || m.size() != 3 || !m[0].empty()) return false;
      if (seq_of(m[1]) == ~std::uint64_t{0} && m[2].empty()) return true;
      out.push_back({seq_of(m[1]), m[2].to_string()});
    }
  }
  zmq::socket_t& dealer() { return dealer_; }

 private:
  zmq::context_t context_{1};
  zmq::socket_t sub_{context_, zmq::socket_type::sub};
  zmq::socket_t dealer_{context_, zmq::socket_type::dealer};
};

/// A router's view of one server: joins from a dump, then applies every
/// batch in order, replaying the ones it missed and joining afresh when a
/// batch is gone for good.
class follower {
 public:
  follower(const std::string& endpoint, const std::string& replay_endpoint) : client_(endpoint, replay_endpoint) {}
  explicit follower(const ghostlink::kv_event_publisher& p) : follower(p.endpoint(), p.replay_endpoint()) {}

  /// Joins from a dump; false if no reply came.
  bool join() {
    std::vector<batch> chunks;
    // The dump's chunks come once it is whole: 100k entries take a while
    // under the sanitizers.
    if (!client_.request("dump", chunks, 6 * patience)) return false;
    view = {};
    for (const batch& c : chunks) view.apply(c.payload);
    if (chunks.empty()) return false;  // a dump has one chunk at least, to carry the number
    next_ = chunks.front().seq;
    ++joins;
    return true;
  }
  /// Applies the next batch (and those it lacked before it): false if none
  /// came within `wait`.
  bool step(std::chrono::milliseconds wait = patience) {
    const std::optional<batch> b = client_.next(wait);
    if (!b) return false;
    return take(*b);
  }
  /// Applies `b` in order, replaying what lies between.
  bool take(const batch& b) {
    if (b.seq < next_) return true;  // the dump or a replay had it
    if (b.seq > next_ && !fill_to(b.seq)) return false;
    if (b.seq < next_) return true;  // a join while filling went past it
    view.apply(b.payload);
    next_ = b.seq + 1;
    return true;
  }
  /// Drops the next published batch, as a lossy link would.
  bool drop_next() { return client_.next().has_value(); }

  mirror view;
  std::size_t joins = 0;
  std::size_t replays = 0;
  std::uint64_t next_batch() const { return next_; }
  wire_client& client() { return client_; }

 private:
  bool fill_to(std::uint64_t seq) {
    ++replays;
    std::vector<batch> got;
    if (!client_.request(seq_bytes(next_), got)) return false;
    if (got.empty() || got.front().seq != next_) return join() && (next_ >= seq || fill_to(seq));
    for (const batch& g : got) {
      if (g.seq >= seq) break;
      if (g.seq != next_) return join() && (next_ >= seq || fill_to(seq));
      view.apply(g.payload);
      next_ = g.seq + 1;
    }
    return next_ == seq || fill_to(seq);
  }

  wire_client client_;
  std::uint64_t next_ = 0;
};

}  // namespace kv_mirror
