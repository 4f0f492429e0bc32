#pragma once
/// @file
/// `kv_event_publisher`: a prefix cache's events on the wire, in the KV-event
/// format of vLLM v0.25.1 over ZeroMQ, with a replay socket that also serves
/// a dump to join from. Part of the optional `ghostlink-events` library
/// (Meson feature `events`; pkg-config `ghostlink-events`; CMake
/// `ghostlink::events`), which needs libzmq. docs/API.md, "KV events on the
/// wire", gives every frame and field.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/element.hpp"
#include "ghostlink/events.hpp"
#include "ghostlink/prefix_cache.hpp"
#include "ghostlink/stats.hpp"

GHOSTLINK_NAMESPACE_BEGIN

namespace detail {
struct publisher_access;
}  // namespace detail

/// How block hashes go on the wire.
enum class kv_wire_hash : std::uint8_t {
  /// The 32-byte SHA-256 (msgpack bin), as vLLM with
  /// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`.
  bytes,
  /// An unsigned 64-bit integer (msgpack uint): the hash's first 8 bytes
  /// read big-endian, for routers that take only integers (vLLM's default
  /// form; vLLM itself takes its digest's last 8 bytes, so a fleet uses
  /// one form throughout).
  uint64,
};

/// Where a publisher sends and what it keeps (vLLM's `KVEventsConfig`, with
/// its defaults).
struct kv_event_publisher_options {
  /// The PUB socket's endpoint, bound (`tcp://*:5557`, `tcp://127.0.0.1:*`
  /// for a free port, `ipc://path`).
  std::string endpoint = "tcp://*:5557";
  /// The ROUTER socket's endpoint for replays and dumps, bound; empty: none.
  std::string replay_endpoint{};
  /// The first frame of every published message (vLLM's `topic`).
  std::string topic{};
  /// The batches kept for replay (vLLM's `buffer_steps`)...
  std::size_t buffer_steps = 10'000;
  /// ... and their payload bytes at most (the newest batch always kept).
  std::size_t buffer_bytes = std::size_t{256} << 20;
  /// Events queued for the publishing thread at most; an event past it is
  /// dropped, and its batch's number with it: a gap every subscriber sees.
  std::size_t max_queued_events = 100'000;
  /// Events in one batch at most.
  std::size_t max_batch_events = 1'024;
  /// A batch is sent at most this often: the events of an interval go in
  /// one batch (or several of `max_batch_events`), so a busy cache sends
  /// fewer, fuller batches. 0: each batch as soon as the thread is free.
  std::chrono::milliseconds batch_interval{1};
  /// The PUB socket's send high-water mark per subscriber, in messages
  /// (vLLM's `hwm`): a subscriber further behind misses batches (ZeroMQ
  /// drops them), which it sees as a gap.
  int send_hwm = 100'000;
  /// How block hashes go on the wire.
  kv_wire_hash hashes = kv_wire_hash::bytes;
  /// The batch's `data_parallel_rank` (vLLM's third field).
  std::int64_t data_parallel_rank = 0;
  /// The `medium` of the prefix cache's entries in RAM.
  std::string medium = "RAM";
  /// The `medium` of its store tier's entries (`kv_prefix_tier::store`);
  /// empty: its store's own (`kv_block_store::medium()`: "FILE", "REDIS").
  std::string store_medium{};
};

/// Publishes a prefix cache's events on a ZeroMQ PUB socket, batch by
/// batch, and answers replay and dump requests on a ROUTER socket, from a
/// thread of its own.
///
/// It takes the cache's event handler (`set_event_handler`), which only
/// queues each event (never blocking: a full queue drops it, counted), so
/// an insert or a drain never waits for the network. Batches are numbered
/// from 0 when they are queued, so a dropped batch is a gap in the numbers.
/// A subscriber that sees a gap asks the ROUTER socket for a replay from
/// the first number it lacks (8 bytes, big-endian); a number no longer in
/// the buffer shows as a later first batch, and then it joins afresh from
/// a dump (the request `dump`). Its destruction gives the cache an empty
/// handler, stops the thread and closes the sockets without waiting for
/// slow subscribers. It holds a handle to the cache until then.
class kv_event_publisher {
 public:
  /// Binds the sockets and starts publishing `cache`'s events.
  /// @throws std::system_error with the ZeroMQ error (as `std::generic_category`)
  ///         if a socket cannot be made or bound; std::invalid_argument for
  ///         `buffer_steps`, `max_queued_events` or `max_batch_events` of 0.
  template <storage_element T>
  explicit kv_event_publisher(basic_kv_prefix_cache<T> cache, kv_event_publisher_options options = {})
      : kv_event_publisher(source{cache.config().block_tokens,
                                  cache.store() ? std::string(cache.store()->medium()) : std::string("STORE"),
                                  [cache](kv_prefix_event_handler h) mutable { cache.set_event_handler(std::move(h)); },
                                  [cache] { return cache.dump(); }},
                           std::move(options)) {}
  ~kv_event_publisher();
  kv_event_publisher(const kv_event_publisher&) = delete;
  kv_event_publisher& operator=(const kv_event_publisher&) = delete;

  /// The PUB socket's endpoint as bound (a wildcard port resolved).
  const std::string& endpoint() const noexcept;
  /// The ROUTER socket's, as bound; empty without one.
  const std::string& replay_endpoint() const noexcept;
  /// The counters now.
  kv_event_publisher_stats stats() const noexcept;

 private:
  friend struct detail::publisher_access;
  /// The cache, type-erased: its block size, its handler's setter, its dump.
  struct source {
    std::size_t block_tokens = 0;
    std::string store_medium;
    std::function<void(kv_prefix_event_handler)> set_handler;
    std::function<kv_prefix_dump()> dump;
  };
  struct impl;
  kv_event_publisher(source cache, kv_event_publisher_options options);

  std::unique_ptr<impl> impl_;
};

GHOSTLINK_NAMESPACE_END
