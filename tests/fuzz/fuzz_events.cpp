// The fuzz target of what a publisher of KV events takes from outside or
// keeps for it (src/events/): the replay socket's request parser, the
// replay buffer and the batch queue, each against a model. The input's
// first byte picks one; for any input:
// - parse_replay_request: a message [empty, body] is a request (8 bytes:
//   a replay from their big-endian number; "dump": a dump; anything else:
//   invalid, answered with the end alone), anything else none;
// - replay_buffer: from(start) is exactly the last batches pushed (as
//   many as its capacity and its bytes allow, the newest always) that are
//   numbered `start` or later, in order;
// - batch_queue: the batches taken are numbered from 0 without gaps, hold
//   the events pushed in order (a lost batch where they were dropped,
//   counted), never more queued than the bound, and every event after a
//   dump's number lies in a batch from first_after()'s number on.
// A mismatch aborts, naming what differed.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "events/batch_queue.hpp"
#include "events/replay.hpp"

namespace {

using namespace ghostlink;

[[noreturn]] void mismatch(const char* what) {
  std::fprintf(stderr, "MISMATCH: %s\n", what);
  std::abort();
}

/// Reads the input a byte at a time (0 past its end).
struct reader {
  std::span<const std::uint8_t> in;
  std::size_t at = 0;
  bool more() const { return at < in.size(); }
  std::uint8_t byte() { return at < in.size() ? in[at++] : 0; }
};

void fuzz_parser(reader r) {
  // Frames: a length byte (its top bit: 8 bytes of a number follow), then that many bytes.
  std::vector<std::string> frames;
  while (r.more() && frames.size() < 5) {
    const std::uint8_t n = r.byte();
    std::string f;
    for (std::size_t i = 0; i < (n & 0x7f) && r.more(); ++i) f.push_back(static_cast<char>(r.byte()));
    frames.push_back(std::move(f));
  }
  std::vector<std::span<const std::byte>> spans;
  for (const std::string& f : frames) spans.emplace_back(reinterpret_cast<const std::byte*>(f.data()), f.size());
  const std::optional<detail::replay_request> got = detail::parse_replay_request(spans);
  if (frames.size() != 2 || !frames[0].empty()) {
    if (got) mismatch("a request from a message that is not [empty, body]");
    return;
  }
  if (!got) mismatch("no request from [empty, body]");
  const std::string& body = frames[1];
  if (body.size() == 8) {
    std::uint64_t v = 0;
    for (const char c : body) v = v << 8 | static_cast<std::uint8_t>(c);
    if (got->what != detail::replay_request::kind::replay || got->start != v) mismatch("replay start");
  } else if (body == detail::dump_request_body) {
    if (got->what != detail::replay_request::kind::dump) mismatch("dump");
  } else if (got->what != detail::replay_request::kind::invalid) {
    mismatch("a body that is neither a number nor dump");
  }
}

void fuzz_buffer(reader r) {
  const std::size_t capacity = r.byte() % 17;
  const std::uint8_t limit = r.byte();
  const std::size_t max_bytes = limit == 0 ? SIZE_MAX : limit % 32;
  detail::replay_buffer b(capacity, max_bytes);
  std::vector<std::uint64_t> pushed;
  std::uint64_t next = 0;
  // The model: the last batches pushed, as many as the capacity and the
  // bytes allow (the newest always).
  auto kept = [&] {
    std::size_t n = 0, bytes = 0;
    for (std::size_t i = pushed.size(); i-- > 0 && n < capacity;) {
      bytes += std::to_string(pushed[i]).size();
      if (n > 0 && bytes > max_bytes) break;
      ++n;
    }
    return n;
  };
  std::size_t keep = 0;  // kept() only shrinks from the front: once dropped, a batch stays dropped
  while (r.more()) {
    const std::uint8_t op = r.byte();
    if (op & 1) {
      next += op >> 5;  // a gap of 0-7
      b.push(next, std::make_shared<const std::string>(std::to_string(next)));
      pushed.push_back(next++);
      keep = std::min(keep + 1, kept());
      continue;
    }
    const std::uint64_t start = op == 0xfe ? ~std::uint64_t{0} : r.byte();
    std::vector<std::uint64_t> expect;
    for (std::size_t i = pushed.size() - keep; i < pushed.size(); ++i)
      if (pushed[i] >= start) expect.push_back(pushed[i]);
    std::vector<std::uint64_t> seen;
    for (const detail::replay_buffer::batch& x : b.from(start)) {
      if (*x.payload != std::to_string(x.seq)) mismatch("a batch's payload");
      seen.push_back(x.seq);
    }
    if (seen != expect) mismatch("replay_buffer::from");
    if (b.size() != keep) mismatch("replay_buffer::size");
  }
}

void fuzz_queue(reader r) {
  const std::size_t max_events = 1 + r.byte() % 16, max_batch = 1 + r.byte() % 8, keep = r.byte() % 8;
  detail::batch_queue q(max_events, max_batch, keep);
  std::uint64_t event = 0, dropped = 0, next_seq = 0;
  std::map<std::uint64_t, std::uint64_t> batch_of;               // event -> the batch that took or lost it
  std::vector<std::pair<std::uint64_t, std::uint64_t>> dumps;    // (event, first_after) asked
  std::size_t queued = 0;                                        // events in batches not taken
  bool any = false;                                              // a batch since the last take
  std::vector<token_id> tokens;
  auto take = [&] {
    for (const detail::queued_batch& b : q.take()) {
      if (b.seq != next_seq++) mismatch("batch numbers with a gap");
      if (b.lost != b.events.empty()) mismatch("a lost batch holds events, or a kept one none");
      std::size_t at = 0;
      for (std::uint64_t e = b.first_event; e <= b.last_event; ++e) batch_of[e] = b.seq;
      for (const detail::wire_event& w : b.events) {
        if (w.tokens_at != at) mismatch("token ids not in order");
        at += w.tokens_size;
        if (w.hash.bytes[0] != static_cast<std::uint8_t>(w.tokens_size)) mismatch("an event's token ids");
      }
      if (at != b.tokens.size()) mismatch("a batch's token ids");
      if (!b.lost && b.events.size() > max_batch) mismatch("a batch over its bound");
      if (!b.lost && b.last_event - b.first_event + 1 != b.events.size()) mismatch("a kept batch lost events");
    }
    queued = 0;
    any = false;
  };
  while (r.more()) {
    const std::uint8_t op = r.byte();
    if (op < 0xc0) {
      kv_prefix_event e;
      e.sequence = ++event;
      tokens.assign(op % 5, static_cast<token_id>(event));
      e.token_ids = tokens;
      e.hash.bytes[0] = static_cast<std::uint8_t>(tokens.size());
      const std::uint64_t before = q.dropped_events();
      if (q.push(e) == any) mismatch("woken when the queue held a batch, or not when it held none");
      any = true;
      if (q.dropped_events() == before) {
        if (++queued > max_events) mismatch("more queued than the bound");
      } else {
        ++dropped;
        if (queued < max_events) mismatch("an event dropped below the bound");
      }
    } else if (op < 0xe0) {
      take();
    } else {
      // A dump as of an event seen so far.
      const std::uint64_t as_of = event == 0 ? 0 : r.byte() % (event + 1);
      // None: the spans kept no longer reach back to it (the publisher dumps again).
      if (const std::optional<std::uint64_t> first = q.first_after(as_of)) dumps.emplace_back(as_of, *first);
    }
  }
  take();
  if (q.dropped_events() != dropped) mismatch("dropped count");
  for (const auto& [as_of, first] : dumps) {
    if (first > next_seq) mismatch("first_after past the batches numbered");
    for (auto it = batch_of.upper_bound(as_of); it != batch_of.end(); ++it)
      if (it->second < first) mismatch("an event after a dump in a batch before first_after");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  reader r{{data, size}};
  switch (r.byte() % 3) {
    case 0: fuzz_parser(r); break;
    case 1: fuzz_buffer(r); break;
    default: fuzz_queue(r); break;
  }
  return 0;
}
