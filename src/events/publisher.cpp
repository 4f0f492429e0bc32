// kv_event_publisher: the sockets and the thread that owns them.
//
// Threads: the cache's handler (any thread, one call at a time, under the
// cache's lock) only queues into handler_state::queue and, when the queue
// was empty and the publisher's thread sleeps, writes a byte to the wake
// pipe. The publisher's thread owns
// both sockets: it waits on the pipe and the ROUTER socket, sends the
// queued batches, keeps them for replay and answers requests. A dump runs
// on a thread of its own (the cache copies its entries a chunk at a time
// meanwhile), and hands its encoded chunks back through the pipe, so that
// publishing never waits for a dump.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <deque>
#include <iterator>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "events/batch_queue.hpp"
#include "events/publisher_hooks.hpp"
#include "events/replay.hpp"
#include "events/wire.hpp"
#include "ghostlink/event_publisher.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace {

/// Dump entries in one reply message at most.
constexpr std::size_t dump_chunk_entries = 1'024;

double now_seconds() noexcept {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

[[noreturn]] void throw_zmq(const zmq::error_t& e, const std::string& what) {
  throw std::system_error(e.num(), std::generic_category(), what + ": " + e.what());
}

/// What the handler shares with the publisher: it may outlive the
/// publisher inside the cache's handler until the cache lets go of it.
struct handler_state {
  handler_state(std::size_t max_events, std::size_t max_batch, std::size_t keep_spans)
      : queue(max_events, max_batch, keep_spans) {}
  detail::batch_queue queue;
  std::atomic<int> wake_fd{-1};
  std::atomic<bool> sleeping{false};  // the publisher's thread waits for a wake

  void wake() const noexcept {
    const int fd = wake_fd.load(std::memory_order_acquire);
    const char byte = 1;
    // A full pipe is a wakeup already pending.
    if (fd >= 0 && ::write(fd, &byte, 1) < 0) return;
  }
};

/// A dump's reply, made on the dump thread.
struct dump_reply {
  std::vector<std::string> clients;  // the ROUTER identities that asked
  std::uint64_t first_batch = 0;     // the first batch to apply after it
  std::vector<std::string> chunks;   // the payloads
  bool failed = false;               // memory refused: only the end is sent
};

}  // namespace

struct kv_event_publisher::impl {
  impl(source s, kv_event_publisher_options o)
      : src(std::move(s)),
        options(std::move(o)),
        state(
            std::make_shared<handler_state>(options.max_queued_events, options.max_batch_events, options.buffer_steps)),
        replay(options.buffer_steps, options.buffer_bytes) {
    format.hashes = options.hashes;
    format.medium = options.medium;
    format.store_medium = options.store_medium.empty() ? src.store_medium : options.store_medium;
    format.block_size = src.block_tokens;
    format.data_parallel_rank = options.data_parallel_rank;
  }

  void open() {
    int fds[2];
    if (::pipe2(fds, O_NONBLOCK | O_CLOEXEC) != 0) throw std::system_error(errno, std::generic_category(), "pipe2");
    wake_read = fds[0];
    state->wake_fd.store(fds[1], std::memory_order_release);
    try {
      pub = zmq::socket_t(context, zmq::socket_type::pub);
      pub.set(zmq::sockopt::linger, 0);
      pub.set(zmq::sockopt::sndhwm, options.send_hwm);
      pub.bind(options.endpoint);
      endpoint = pub.get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      throw_zmq(e, "kv_event_publisher: " + options.endpoint);
    }
    if (options.replay_endpoint.empty()) return;
    try {
      router = zmq::socket_t(context, zmq::socket_type::router);
      router.set(zmq::sockopt::linger, 0);
      // A request is a few bytes: a client sending more is dropped by libzmq.
      router.set(zmq::sockopt::maxmsgsize, std::int64_t{256});
      // A reply is the buffer and a dump at most; a client that does not
      // read is cut short (router_mandatory: EAGAIN instead of a silent drop).
      router.set(zmq::sockopt::sndhwm, static_cast<int>(std::min<std::size_t>(options.buffer_steps + 4'096, 1 << 30)));
      router.set(zmq::sockopt::router_mandatory, true);
      router.bind(options.replay_endpoint);
      replay_endpoint = router.get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      throw_zmq(e, "kv_event_publisher: " + options.replay_endpoint);
    }
  }

  ~impl() {
    if (wake_read >= 0) ::close(wake_read);
    if (const int fd = state->wake_fd.exchange(-1); fd >= 0) ::close(fd);
  }

  void run() noexcept {
    std::vector<zmq::pollitem_t> items{{nullptr, wake_read, ZMQ_POLLIN, 0}};
    if (router) items.push_back({router.handle(), 0, ZMQ_POLLIN, 0});
    auto next_take = std::chrono::steady_clock::now();
    for (;;) {
      wait_for_work(items);
      // A batch gathers until `batch_interval` after the last was taken:
      // under load, fewer and fuller batches; requests answered meanwhile.
      for (auto now = std::chrono::steady_clock::now(); now < next_take && !stop.load(std::memory_order_acquire);
           now = std::chrono::steady_clock::now()) {
        poll(items, std::chrono::ceil<std::chrono::milliseconds>(next_take - now));
        if (router) serve_requests();
      }
      const bool stopping = stop.load(std::memory_order_acquire);
      if (!held.load(std::memory_order_acquire) || stopping) {
        publish_queued();
        next_take = std::chrono::steady_clock::now() + options.batch_interval;
      }
      send_dumps();
      if (router) serve_requests();
      if (stopping) return;
    }
  }

  /// Waits on the pipe and the ROUTER socket, then empties the pipe.
  void poll(std::vector<zmq::pollitem_t>& items, std::chrono::milliseconds timeout) noexcept {
    try {
      zmq::poll(items, timeout);
    } catch (const zmq::error_t&) {  // EINTR: the caller looks again
    }
    char buf[256];
    while (::read(wake_read, buf, sizeof buf) > 0) {
    }
  }

  /// Returns at once if events are queued (and not held), else sleeps
  /// until woken: the handler writes to the pipe only while this sleeps
  /// (`sleeping`), so that a busy publisher costs an insert no system call.
  void wait_for_work(std::vector<zmq::pollitem_t>& items) noexcept {
    state->sleeping.store(true);
    // After the store: an event queued from here on finds `sleeping` set.
    const bool work =
        stop.load(std::memory_order_acquire) || (!held.load(std::memory_order_acquire) && !state->queue.empty());
    if (!work) poll(items, std::chrono::milliseconds(-1));
    state->sleeping.store(false);
  }

  void publish_queued() noexcept {
    std::deque<detail::queued_batch> batches = state->queue.take();
    for (const detail::queued_batch& b : batches) {
      if (b.lost) {
        batches_lost.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      try {
        auto payload = std::make_shared<const std::string>(detail::encode_batch(b, format, now_seconds()));
        const std::array<std::byte, 8> seq = detail::wire_seq(b.seq);
        pub.send(zmq::buffer(options.topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
        pub.send(zmq::buffer(seq), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
        pub.send(zmq::buffer(*payload), zmq::send_flags::dontwait);
        batches_published.fetch_add(1, std::memory_order_relaxed);
        events_published.fetch_add(b.events.size(), std::memory_order_relaxed);
        replay.push(b.seq, std::move(payload));
      } catch (...) {  // memory refused, or the socket failed: the number is a gap
        batches_lost.fetch_add(1, std::memory_order_relaxed);
        events_lost.fetch_add(b.events.size(), std::memory_order_relaxed);
      }
    }
  }

  /// Sends [identity, "", seq, payload] to `client`; false if it is gone
  /// or not reading (the reply is then cut short).
  bool reply(const std::string& client, std::uint64_t seq, std::string_view payload) noexcept {
    try {
      const std::array<std::byte, 8> s = detail::wire_seq(seq);
      if (!router.send(zmq::buffer(client), zmq::send_flags::sndmore | zmq::send_flags::dontwait)) return false;
      router.send(zmq::buffer(std::string_view()), zmq::send_flags::sndmore);
      router.send(zmq::buffer(s), zmq::send_flags::sndmore);
      router.send(zmq::buffer(payload), zmq::send_flags::none);
      return true;
    } catch (...) {  // EHOSTUNREACH: the client has gone
      return false;
    }
  }

  /// Sends `n` messages, `message(i)` giving each one's number and
  /// payload, then the end; counts the reply in `served`, or in
  /// replies_dropped when it was cut short (no end then).
  template <class Message>
  void reply_all(const std::string& client, std::size_t n, Message message,
                 std::atomic<std::uint64_t>& served) noexcept {
    for (std::size_t i = 0; i < n; ++i) {
      const auto [seq, payload] = message(i);
      if (!reply(client, seq, payload)) {
        replies_dropped.fetch_add(1, std::memory_order_relaxed);
        return;
      }
    }
    if (reply(client, detail::end_of_replay, {})) {
      served.fetch_add(1, std::memory_order_relaxed);
    } else {
      replies_dropped.fetch_add(1, std::memory_order_relaxed);
    }
  }

  void serve_requests() noexcept {
    for (int served = 0; served < 1'024; ++served) {  // then publish again
      std::vector<zmq::message_t> frames;
      try {
        if (!zmq::recv_multipart(router, std::back_inserter(frames), zmq::recv_flags::dontwait)) return;
      } catch (...) {
        return;
      }
      if (frames.empty()) continue;
      std::vector<std::span<const std::byte>> body;
      for (std::size_t i = 1; i < frames.size() && i < 4; ++i)
        body.emplace_back(static_cast<const std::byte*>(frames[i].data()), frames[i].size());
      const std::optional<detail::replay_request> r =
          frames.size() < 4 ? detail::parse_replay_request(body) : std::nullopt;
      if (!r) {
        bad_requests.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      std::string client = frames[0].to_string();
      switch (r->what) {
        case detail::replay_request::kind::replay: {
          const std::span<const detail::replay_buffer::batch> batches = replay.from(r->start);
          reply_all(
              client, batches.size(),
              [&](std::size_t i) {
                return std::pair<std::uint64_t, std::string_view>(batches[i].seq, *batches[i].payload);
              },
              replays_served);
          break;
        }
        case detail::replay_request::kind::dump: start_dump(std::move(client)); break;
        case detail::replay_request::kind::invalid:
          bad_requests.fetch_add(1, std::memory_order_relaxed);
          reply(client, detail::end_of_replay, {});
          break;
      }
    }
  }

  void start_dump(std::string client) noexcept {
    std::lock_guard lock(dump_mutex);
    try {
      dump_waiting.push_back(std::move(client));
    } catch (const std::bad_alloc&) {
      replies_dropped.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    if (!dumping) launch_dump();
  }

  /// Under dump_mutex: a dump for every client waiting, on its own thread.
  void launch_dump() noexcept {
    if (dumper.joinable()) dumper.join();  // finished: it handed its reply back
    try {
      dumper = std::thread([this, clients = std::move(dump_waiting)]() mutable { dump_for(std::move(clients)); });
      dumping = true;
    } catch (...) {
      replies_dropped.fetch_add(dump_waiting.size(), std::memory_order_relaxed);
    }
    dump_waiting.clear();
  }

  void dump_for(std::vector<std::string> clients) noexcept {
    dump_reply r;
    r.clients = std::move(clients);
    try {
      // A dump that took longer than the spans kept cannot say where the
      // batches after it start: another is taken (a few tries).
      kv_prefix_dump d;
      std::optional<std::uint64_t> first;
      for (int attempt = 0; attempt < 3 && !first; ++attempt) {
        d = src.dump();
        first = state->queue.first_after(d.sequence);
      }
      if (!first) throw std::runtime_error("dump older than the batches recorded");
      r.first_batch = *first;
      const double ts = now_seconds();
      const std::span<const kv_prefix_dump::entry> all(d.entries);
      // One chunk at least, empty for an empty cache: it carries the number.
      if (all.empty()) r.chunks.push_back(detail::encode_dump({}, format, ts));
      for (std::size_t at = 0; at < all.size(); at += dump_chunk_entries)
        r.chunks.push_back(
            detail::encode_dump(all.subspan(at, std::min(dump_chunk_entries, all.size() - at)), format, ts));
    } catch (...) {
      r.failed = true;
      r.chunks.clear();
    }
    {
      std::lock_guard lock(dump_mutex);
      try {
        dumps_done.push_back(std::move(r));
      } catch (const std::bad_alloc&) {  // the clients get no reply: they time out and ask again
        replies_dropped.fetch_add(r.clients.size(), std::memory_order_relaxed);
      }
      dumping = false;
    }
    state->wake();
  }

  void send_dumps() noexcept {
    std::vector<dump_reply> done;
    {
      std::lock_guard lock(dump_mutex);
      done.swap(dumps_done);
      if (!dumping && !dump_waiting.empty() && !stop.load(std::memory_order_acquire)) launch_dump();
    }
    for (const dump_reply& r : done) {
      for (const std::string& client : r.clients) {
        if (r.failed) {  // the end alone: the client asks again
          reply(client, detail::end_of_replay, {});
          replies_dropped.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        reply_all(
            client, r.chunks.size(),
            [&](std::size_t i) { return std::pair<std::uint64_t, std::string_view>(r.first_batch, r.chunks[i]); },
            dumps_served);
      }
    }
  }

  source src;
  const kv_event_publisher_options options;
  detail::wire_format format;
  std::shared_ptr<handler_state> state;
  detail::replay_buffer replay;  // the publisher thread's
  zmq::context_t context{1};
  zmq::socket_t pub;
  zmq::socket_t router;
  std::string endpoint, replay_endpoint;
  int wake_read = -1;
  std::thread thread;
  std::atomic<bool> stop{false};
  std::atomic<bool> held{false};  // a test's: queued batches stay queued

  std::mutex dump_mutex;
  std::vector<std::string> dump_waiting;  // clients asking while a dump runs
  std::vector<dump_reply> dumps_done;
  bool dumping = false;
  std::thread dumper;

  std::atomic<std::uint64_t> events_published{0}, batches_published{0}, events_lost{0}, batches_lost{0},
      replays_served{0}, dumps_served{0}, bad_requests{0}, replies_dropped{0};
};

kv_event_publisher::kv_event_publisher(source cache, kv_event_publisher_options options) {
  if (options.buffer_steps == 0 || options.max_queued_events == 0 || options.max_batch_events == 0)
    throw std::invalid_argument("kv_event_publisher: buffer_steps, max_queued_events and max_batch_events must be > 0");
  impl_ = std::make_unique<impl>(std::move(cache), std::move(options));
  impl_->open();
  impl_->thread = std::thread([p = impl_.get()] { p->run(); });
  try {
    impl_->src.set_handler([state = impl_->state](const kv_prefix_event& e) {
      if (state->queue.push(e) && state->sleeping.exchange(false)) state->wake();
    });
  } catch (...) {
    impl_->stop.store(true, std::memory_order_release);
    impl_->state->wake();
    impl_->thread.join();
    throw;
  }
}

kv_event_publisher::~kv_event_publisher() {
  // No handler call runs once this returns (the cache sets it under its lock).
  impl_->src.set_handler({});
  impl_->stop.store(true, std::memory_order_release);
  impl_->state->wake();
  impl_->thread.join();
  // Only the publisher's thread starts a dump: none starts now.
  if (impl_->dumper.joinable()) impl_->dumper.join();
}

const std::string& kv_event_publisher::endpoint() const noexcept { return impl_->endpoint; }
const std::string& kv_event_publisher::replay_endpoint() const noexcept { return impl_->replay_endpoint; }

kv_event_publisher_stats kv_event_publisher::stats() const noexcept {
  const impl& p = *impl_;
  kv_event_publisher_stats s;
  s.events_published = p.events_published.load(std::memory_order_relaxed);
  s.batches_published = p.batches_published.load(std::memory_order_relaxed);
  s.events_dropped = p.state->queue.dropped_events() + p.events_lost.load(std::memory_order_relaxed);
  s.batches_lost = p.batches_lost.load(std::memory_order_relaxed);
  s.replays_served = p.replays_served.load(std::memory_order_relaxed);
  s.dumps_served = p.dumps_served.load(std::memory_order_relaxed);
  s.bad_requests = p.bad_requests.load(std::memory_order_relaxed);
  s.replies_dropped = p.replies_dropped.load(std::memory_order_relaxed);
  return s;
}

namespace detail {
void publisher_access::hold(kv_event_publisher& p, bool on) noexcept {
  p.impl_->held.store(on, std::memory_order_release);
  p.impl_->state->wake();
}
}  // namespace detail

GHOSTLINK_NAMESPACE_END
