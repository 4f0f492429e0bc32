// KV events on the wire (include/ghostlink/event_publisher.hpp; docs/API.md,
// "KV events on the wire"): batch numbering and overflow, the replay
// buffer and request parser, and a publisher end to end over ipc:// with a
// subscriber written to vLLM's protocol (examples/kv_mirror.hpp):
// the frames and the map layout, integer hashes, gaps recovered through
// replay, a late join from a dump of 100k entries while 2 threads insert,
// overflow, bad requests and shutdown.

#include "common/prefix_support.hpp"
#include "events/batch_queue.hpp"
#include "events/publisher_hooks.hpp"
#include "events/replay.hpp"
#include "events/wire.hpp"
#include "testing/temp_dir.hpp"

#include "../examples/kv_mirror.hpp"

#include <atomic>
#include <cstring>
#include <thread>

namespace events_tests {

using namespace ghostlink;
using namespace ghostlink::test::prefix;
using namespace kv_mirror;

namespace {

constexpr std::size_t bt = 4;  // config().block_tokens

kv_prefix_event stored(std::uint64_t n, std::span<const token_id> tokens = {}) {
  kv_prefix_event e;
  e.what = kv_prefix_event::kind::stored;
  e.sequence = n;
  e.hash.bytes[0] = static_cast<std::uint8_t>(n);
  e.token_ids = tokens;
  return e;
}

/// A publisher over ipc:// in a temporary directory, on a cache of its own.
struct server {
  explicit server(kv_event_publisher_options o = {}, std::size_t max_blocks = 4'000, std::size_t max_tokens = 64,
                  kv_prefix_options prefix = {})
      : pool(kv_block_pool::for_caches(cfg(max_tokens), {.max_blocks = max_blocks})),
        cache(1, cfg(max_tokens), pool, std::move(prefix)),
        publisher(cache, with_endpoints(std::move(o))) {}
  static kv_cache_config cfg(std::size_t max_tokens) {
    kv_cache_config c = config();
    c.max_tokens_per_seq = max_tokens;
    return c;
  }
  kv_event_publisher_options with_endpoints(kv_event_publisher_options o) {
    o.endpoint = "ipc://" + (dir.path / "pub").string();
    o.replay_endpoint = "ipc://" + (dir.path / "replay").string();
    return o;
  }
  /// `ids` inserted from a sequence let go of at once.
  std::size_t insert(std::span<const token_id> ids) {
    sequence_kv_cache seq(threads, 1, cache.config(), pool);
    if (append(seq, ids) != ghostlink::error_code()) return 0;
    const std::size_t n = cache.insert(seq, ids);
    return truncate(seq, 0) == ghostlink::error_code() ? n : 0;
  }
  ~server() { threads.join(); }

  ghostlink::testing::temp_dir dir;
  asio::thread_pool threads{2};
  kv_block_pool pool;
  kv_prefix_cache cache;
  kv_event_publisher publisher;
};

/// Batches until `pred(view)` holds, applying each; false past the patience.
template <class Pred>
bool follow_until(follower& f, Pred pred) {
  for (int i = 0; i < 100'000 && !pred(f.view); ++i)
    if (!f.step()) return false;
  return pred(f.view);
}

}  // namespace

TEST_CASE("events: batches are numbered as they are queued, and an overflow loses numbers", "[events]") {
  detail::batch_queue q(5, 2, 100);
  const std::vector<token_id> t{1, 2, 3, 4};
  CHECK(q.push(stored(1, t)));  // the queue was empty: wake the thread
  CHECK_FALSE(q.push(stored(2, t)));
  CHECK_FALSE(q.push(stored(3)));  // a third event opens batch 1
  auto taken = q.take();
  REQUIRE(taken.size() == 2);
  CHECK(taken[0].seq == 0);
  CHECK(taken[0].events.size() == 2);
  CHECK(taken[0].tokens == std::vector<token_id>{1, 2, 3, 4, 1, 2, 3, 4});
  CHECK(taken[1].seq == 1);
  CHECK(taken[1].events.size() == 1);
  CHECK(taken[1].events[0].tokens_size == 0);

  // Five queued, then three dropped into one lost batch, then room again.
  for (std::uint64_t n = 4; n <= 8; ++n) q.push(stored(n));
  for (std::uint64_t n = 9; n <= 11; ++n) q.push(stored(n));
  CHECK(q.dropped_events() == 3);
  CHECK(q.first_after(8) == std::optional<std::uint64_t>(5));  // batch 5 is the lost one: events 9-11
  taken = q.take();
  REQUIRE(taken.size() == 4);
  CHECK(taken[3].seq == 5);
  CHECK(taken[3].lost);
  CHECK(taken[3].events.empty());
  q.push(stored(12));
  taken = q.take();
  REQUIRE(taken.size() == 1);
  CHECK(taken[0].seq == 6);
  CHECK_FALSE(taken[0].lost);

  // A dump as of event 4 (inside batch 2: events 4-5): apply from batch 2.
  CHECK(q.first_after(4) == std::optional<std::uint64_t>(2));
  CHECK(q.first_after(5) == std::optional<std::uint64_t>(3));
  CHECK(q.first_after(12) == std::optional<std::uint64_t>(7));  // nothing after it yet: the next number
  CHECK(q.first_after(0) == std::optional<std::uint64_t>(0));
}

TEST_CASE("events: first_after closes the open batch, so no later event joins a batch before it", "[events]") {
  detail::batch_queue q(100, 10, 100);
  q.push(stored(1));
  CHECK(q.first_after(1) == std::optional<std::uint64_t>(1));
  q.push(stored(2));  // batch 1, not batch 0
  const auto taken = q.take();
  REQUIRE(taken.size() == 2);
  CHECK(taken[0].events.size() == 1);
  CHECK(taken[1].seq == 1);
}

TEST_CASE("events: a dump older than the batches recorded maps to none (the publisher dumps again)", "[events]") {
  detail::batch_queue q(100, 1, 2);  // spans of 2 batches kept past those queued
  for (std::uint64_t n = 1; n <= 5; ++n) q.push(stored(n));
  CHECK(q.take().size() == 5);
  q.push(stored(6));
  CHECK_FALSE(q.first_after(1));  // events 2 and 3 are in batches no longer recorded
  CHECK(q.first_after(4) == std::optional<std::uint64_t>(4));
  CHECK(q.first_after(6) == std::optional<std::uint64_t>(6));
}

TEST_CASE("events: the replay request parser", "[events]") {
  auto parse = [](const std::vector<std::string>& frames) {
    std::vector<std::span<const std::byte>> spans;
    for (const std::string& f : frames) spans.emplace_back(reinterpret_cast<const std::byte*>(f.data()), f.size());
    return detail::parse_replay_request(spans);
  };
  const auto r = parse({"", seq_bytes(0x0102030405060708)});
  REQUIRE(r);
  CHECK(r->what == detail::replay_request::kind::replay);
  CHECK(r->start == 0x0102030405060708);
  CHECK(parse({"", "dump"})->what == detail::replay_request::kind::dump);
  CHECK(parse({"", ""})->what == detail::replay_request::kind::invalid);
  CHECK(parse({"", "1234567"})->what == detail::replay_request::kind::invalid);
  CHECK(parse({"", "123456789"})->what == detail::replay_request::kind::invalid);
  CHECK_FALSE(parse({"x", seq_bytes(1)}));  // no empty delimiter
  CHECK_FALSE(parse({seq_bytes(1)}));
  CHECK_FALSE(parse({"", seq_bytes(1), ""}));
  CHECK_FALSE(parse({}));
}

TEST_CASE("events: the replay buffer keeps the last batches, with gaps, in order", "[events]") {
  detail::replay_buffer b(3);
  for (std::uint64_t s : {0, 1, 3, 4, 6}) b.push(s, std::make_shared<const std::string>(std::to_string(s)));
  CHECK(b.size() == 3);
  auto seqs = [&](std::uint64_t start) {
    std::vector<std::uint64_t> out;
    for (const auto& x : b.from(start)) out.push_back(x.seq);
    return out;
  };
  CHECK(seqs(0) == std::vector<std::uint64_t>{3, 4, 6});  // older than the buffer: a later first batch
  CHECK(seqs(5) == std::vector<std::uint64_t>{6});
  CHECK(seqs(7).empty());
  CHECK(seqs(~std::uint64_t{0}).empty());
  for (std::uint64_t s = 7; s < 20; ++s) b.push(s, std::make_shared<const std::string>());
  CHECK(seqs(0) == std::vector<std::uint64_t>{17, 18, 19});

  // Bounded in bytes too, the newest always kept.
  detail::replay_buffer small(100, 10);
  small.push(0, std::make_shared<const std::string>(4, 'a'));
  small.push(1, std::make_shared<const std::string>(4, 'b'));
  CHECK(small.size() == 2);
  small.push(2, std::make_shared<const std::string>(4, 'c'));  // 12 bytes: the oldest goes
  CHECK(small.size() == 2);
  CHECK(small.bytes() == 8);
  small.push(3, std::make_shared<const std::string>(50, 'd'));  // alone over the bound: kept alone
  CHECK(small.size() == 1);
  CHECK(small.from(0).front().seq == 3);
}

/// The events of every batch a replay from 0 gives, asked until `n` came
/// (the thread may send one insert's events in one batch or several).
std::vector<json> replayed_events(wire_client& c, std::size_t n, std::vector<batch>& got) {
  std::vector<json> events;
  for (int i = 0; i < 1'000 && events.size() < n; ++i) {
    got.clear();
    events.clear();
    if (!c.request(seq_bytes(0), got)) break;
    for (const batch& b : got) {
      const json decoded = json::from_msgpack(b.payload);
      for (const json& e : decoded[1]) events.push_back(e);
    }
  }
  return events;
}

TEST_CASE("events: the wire format: frames, map events with type first, float64 time, bytes hashes", "[events]") {
  server s;
  wire_client c(s.publisher.endpoint(), s.publisher.replay_endpoint());
  const auto ids = run(10, bt);
  REQUIRE(s.insert(ids) == 1);
  // The batch may have gone before the subscription arrived: a replay from 0 has it.
  std::vector<batch> got;
  REQUIRE(replayed_events(c, 1, got).size() == 1);
  REQUIRE(got.size() == 1);
  CHECK(got[0].seq == 0);
  const std::string& p = got[0].payload;
  REQUIRE(p.size() > 10);
  CHECK(static_cast<std::uint8_t>(p[0]) == 0x93);  // [ts, events, rank]
  CHECK(static_cast<std::uint8_t>(p[1]) == 0xcb);  // float64
  const json b = json::from_msgpack(p);
  CHECK(b[0].is_number_float());
  CHECK(b[2] == 0);
  REQUIRE(b[1].size() == 1);
  const json& e = b[1][0];
  CHECK(e.size() == 8);
  // nlohmann's json sorts keys: the order is checked in the bytes.
  CHECK(p.find("\xa4type") < p.find("\xac"
                                    "block_hashes"));
  CHECK(p.find("\xac"
               "block_hashes") < p.find("\xb1parent_block_hash"));
  CHECK(p.find("\xb1parent_block_hash") < p.find("\xa9token_ids"));
  CHECK(p.find("\xa9token_ids") < p.find("\xaa"
                                         "block_size"));
  CHECK(p.find("\xaa"
               "block_size") < p.find("\xa7lora_id"));
  CHECK(p.find("\xa7lora_id") < p.find("\xa6medium"));
  CHECK(p.find("\xa6medium") < p.find("\xa9lora_name"));
  CHECK(e["type"] == "BlockStored");
  CHECK(e["block_size"] == bt);
  CHECK(e["medium"] == "RAM");
  CHECK(e["lora_id"].is_null());
  CHECK(e["lora_name"].is_null());
  CHECK(e["parent_block_hash"].is_null());
  CHECK(e["token_ids"] == json(ids));
  REQUIRE(e["block_hashes"].size() == 1);
  CHECK(e["block_hashes"][0].get_binary().size() == 32);
  CHECK(key_of(e["block_hashes"][0]) == key_of(s.cache.block_hashes(ids)[0], kv_wire_hash::bytes));
}

TEST_CASE("events: a batch's runs: chained stored events as one BlockStored, removed ones as one BlockRemoved",
          "[events]") {
  detail::batch_queue q(100, 100, 100);
  const std::vector<token_id> t1{1, 2}, t2{3, 4}, t3{5, 6};
  kv_prefix_event a = stored(1, t1), b = stored(2, t2), c = stored(3, t3);
  b.parent = a.hash;  // a, b one prefix; c another
  q.push(a);
  q.push(b);
  q.push(c);
  kv_prefix_event r1 = a, r2 = b, cl;
  r1.what = r2.what = kv_prefix_event::kind::removed;
  r1.token_ids = r2.token_ids = {};
  r1.sequence = 4;
  r2.sequence = 5;
  cl.what = kv_prefix_event::kind::cleared;
  cl.sequence = 6;
  q.push(r1);
  q.push(r2);
  q.push(cl);
  const auto taken = q.take();
  REQUIRE(taken.size() == 1);
  const json events = json::from_msgpack(detail::encode_batch(taken[0], {.block_size = 2}, 1.5))[1];
  REQUIRE(events.size() == 4);
  CHECK(events[0]["block_hashes"].size() == 2);
  CHECK(events[0]["token_ids"] == json({1, 2, 3, 4}));
  CHECK(events[0]["parent_block_hash"].is_null());
  CHECK(events[1]["block_hashes"].size() == 1);
  CHECK(events[1]["token_ids"] == json({5, 6}));
  CHECK(events[2]["type"] == "BlockRemoved");
  CHECK(events[2]["block_hashes"].size() == 2);
  CHECK(events[2].size() == 3);
  CHECK(events[3] == json({{"type", "AllBlocksCleared"}}));
}

TEST_CASE("events: integer hashes are the hash's first 8 bytes, big-endian", "[events]") {
  server s({.hashes = kv_wire_hash::uint64});
  wire_client c(s.publisher.endpoint(), s.publisher.replay_endpoint());
  const auto ids = run(10, 2 * bt);
  REQUIRE(s.insert(ids) == 2);
  std::vector<batch> got;
  std::vector<kv_block_hash> h = s.cache.block_hashes(ids);
  std::vector<std::uint64_t> sent;
  for (const json& e : replayed_events(c, 2, got))
    for (const json& x : e["block_hashes"]) {
      CHECK(x.is_number_unsigned());
      sent.push_back(x.get<std::uint64_t>());
    }
  std::vector<std::uint64_t> first8;
  for (const kv_block_hash& x : h) {
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < 8; ++i) v = v << 8 | x.bytes[i];
    first8.push_back(v);
  }
  CHECK(sent == first8);
}

TEST_CASE("events: removed and cleared on the wire; a mirror of the stream equals the cache", "[events]") {
  server s({}, 8);  // 8 blocks: inserts evict
  follower f(s.publisher);
  REQUIRE(f.join());
  for (token_id p = 0; p < 6; ++p) REQUIRE(s.insert(run(100 * p, 3 * bt)) == 3);
  const std::vector<kv_block_hash> last = s.cache.block_hashes(run(500, 3 * bt));
  const std::string tail = key_of(last[2], kv_wire_hash::bytes);
  REQUIRE(follow_until(f, [&](const mirror& m) { return m.holds("RAM", tail); }));
  CHECK(s.cache.stats().evicted_blocks > 0);
  CHECK(f.view.entries == mirror::of(s.cache.dump(), kv_wire_hash::bytes).entries);
  s.cache.clear();
  REQUIRE(s.insert(run(900, bt)) == 1);
  const std::string after = key_of(s.cache.block_hashes(run(900, bt))[0], kv_wire_hash::bytes);
  REQUIRE(follow_until(f, [&](const mirror& m) { return m.holds("RAM", after); }));
  CHECK(f.view.entries.size() == 1);
}

TEST_CASE("events: the store tier on the wire, as its store names it; a late joiner mirrors both tiers", "[events]") {
  ghostlink::testing::temp_dir dir;
  asio::thread_pool io(2);
  kv_event_publisher_options o;
  std::string medium = "FILE";  // the file store's own
  SECTION("the store's medium") {}
  SECTION("the medium the options give") {
    o.store_medium = "DISK";
    medium = "DISK";
  }
  const auto store = std::make_shared<kv_file_store>(dir.path, kv_file_store_limits{.io_executor = io.get_executor()});
  {
    server s(o, 4'000, 64, {.store = store});
    follower early(s.publisher);
    REQUIRE(early.join());
    const std::vector<token_id> ids = run(100, 3 * bt);
    REQUIRE(s.insert(ids) == 3);
    store->flush();  // every store-tier event given to the publisher (their order: the store's I/O threads')
    const mirror truth = mirror::of(s.cache.dump(), kv_wire_hash::bytes, medium);
    CHECK(truth.entries.size() == 6);
    const std::string tail = key_of(s.cache.block_hashes(ids)[2], kv_wire_hash::bytes);
    CHECK(truth.holds(medium, tail));
    CHECK(follow_until(early, [&](const mirror& m) { return m.entries == truth.entries; }));
    follower late(s.publisher);  // from a dump that lists both tiers
    REQUIRE(late.join());
    CHECK(late.view.entries == truth.entries);
  }
  io.join();
}

TEST_CASE("events: a subscriber that drops batches recovers through replay to an exact mirror", "[events]") {
  server s({}, 64);
  follower f(s.publisher);
  REQUIRE(f.join());
  std::string tail;
  for (token_id p = 0; p < 30; ++p) {
    const auto ids = run(1000 + 100 * p, 3 * bt);
    REQUIRE(s.insert(ids) > 0);
    tail = key_of(s.cache.block_hashes(ids)[2], kv_wire_hash::bytes);
    if (p % 3 == 1) {
      REQUIRE(f.drop_next());  // lost on the way: the next one shows the gap
    } else {
      REQUIRE(f.step());
    }
  }
  REQUIRE(follow_until(f, [&](const mirror& m) { return m.holds("RAM", tail); }));
  CHECK(f.replays > 0);
  CHECK(f.view.entries == mirror::of(s.cache.dump(), kv_wire_hash::bytes).entries);
}

TEST_CASE("events: a late join from a dump of 100k entries mirrors the cache while 2 threads insert",
          "[events][concurrency]") {
  // One layer, 100k entries from 100 prompts of 1,000 blocks, then 2
  // threads inserting (and evicting) while the router joins.
  server s({}, 103'000, 1'000 * bt);
  for (token_id p = 0; p < 100; ++p) REQUIRE(s.insert(run(p * 10'000, 1'000 * bt)) == 1'000);
  REQUIRE(s.cache.stats().cached_entries == 100'000);
  std::atomic<bool> go_on{true};
  std::atomic<std::size_t> failures{0};
  auto writer = [&](token_id base) {  // no Catch2 assertion off the main thread
    for (token_id i = 0; i < 3'000 && go_on.load(); ++i)
      if (s.insert(run(base + i * 8, 2 * bt)) == 0) failures.fetch_add(1);
  };
  std::thread t1(writer, 2'000'000), t2(writer, 3'000'000);
  follower f(s.publisher);
  const bool joined = f.join();
  for (int i = 0; i < 50 && joined; ++i) f.step();
  go_on = false;
  t1.join();
  t2.join();
  REQUIRE(joined);
  CHECK(failures == 0);
  // A last insert: once the mirror has it, it has every batch before it.
  const auto sentinel = run(9'000'000, bt);
  REQUIRE(s.insert(sentinel) == 1);
  const std::string tail = key_of(s.cache.block_hashes(sentinel)[0], kv_wire_hash::bytes);
  REQUIRE(follow_until(f, [&](const mirror& m) { return m.holds("RAM", tail); }));
  const mirror truth = mirror::of(s.cache.dump(), kv_wire_hash::bytes);
  CHECK(truth.entries.size() >= 100'000);
  CHECK(f.view.entries == truth.entries);
  CHECK(s.publisher.stats().dumps_served >= 1);
}

TEST_CASE("events: an overflow drops events, counted, and leaves a gap; the inserts never wait", "[events]") {
  server s({.max_queued_events = 10}, 4'000);
  wire_client c(s.publisher.endpoint(), s.publisher.replay_endpoint());
  detail::publisher_access::hold(s.publisher, true);  // a publisher that cannot keep up
  for (token_id p = 0; p < 10; ++p) REQUIRE(s.insert(run(100 * p, 3 * bt)) == 3);  // 30 events
  detail::publisher_access::hold(s.publisher, false);
  // Once the thread has taken the queue (batch 0 sent, batch 1 lost), a
  // later event goes in a later batch.
  for (int i = 0; i < 10'000'000; ++i) {
    const kv_event_publisher_stats st = s.publisher.stats();
    if (st.batches_published + st.batches_lost == 2) break;
    std::this_thread::yield();
  }
  REQUIRE(s.insert(run(5'000, bt)) == 1);
  std::vector<batch> got;
  for (int i = 0; i < 100; ++i) {
    got.clear();
    REQUIRE(c.request(seq_bytes(0), got));
    if (!got.empty() && json::from_msgpack(got.back().payload)[1][0]["token_ids"] == json(run(5'000, bt))) break;
  }
  const kv_event_publisher_stats st = s.publisher.stats();
  CHECK(st.events_dropped == 20);
  CHECK(st.batches_lost == 1);
  REQUIRE(got.size() == 2);
  CHECK(got[0].seq == 0);
  CHECK(got[1].seq == 2);  // batch 1 was lost: the gap every subscriber sees
}

TEST_CASE("events: bad requests get the end or nothing, and the socket keeps answering", "[events]") {
  server s;
  wire_client c(s.publisher.endpoint(), s.publisher.replay_endpoint());
  REQUIRE(s.insert(run(10, bt)) == 1);
  std::vector<batch> got;
  CHECK(c.request("garbage!!", got));  // not a request: the end alone
  CHECK(got.empty());
  CHECK(c.request("", got));  // an empty body
  CHECK(got.empty());
  CHECK(c.request(seq_bytes(~std::uint64_t{0} - 1), got));  // past everything
  CHECK(got.empty());
  // Three frames after the delimiter: no reply at all; then a good request.
  c.dealer().send(zmq::message_t(), zmq::send_flags::sndmore);
  c.dealer().send(zmq::buffer(std::string("a")), zmq::send_flags::sndmore);
  c.dealer().send(zmq::buffer(std::string("b")));
  // A frame over the size limit: libzmq drops that client's connection (a
  // new one is made by the DEALER).
  c.dealer().send(zmq::message_t(), zmq::send_flags::sndmore);
  c.dealer().send(zmq::buffer(std::string(100'000, 'x')));
  wire_client fresh(s.publisher.endpoint(), s.publisher.replay_endpoint());
  REQUIRE(fresh.request(seq_bytes(0), got));
  CHECK(got.size() == 1);
  CHECK(s.publisher.stats().bad_requests >= 3);
}

TEST_CASE("events: shutdown with subscribers connected and batches pending neither hangs nor leaks", "[events]") {
  for (int round = 0; round < 3; ++round) {
    server s({.max_queued_events = 1'000});
    wire_client a(s.publisher.endpoint(), s.publisher.replay_endpoint());
    wire_client b(s.publisher.endpoint(), s.publisher.replay_endpoint());
    detail::publisher_access::hold(s.publisher, true);
    for (token_id p = 0; p < 20; ++p) REQUIRE(s.insert(run(100 * p, 2 * bt)) == 2);
    // A dump asked for and never read, batches queued: the server goes now.
    a.dealer().send(zmq::message_t(), zmq::send_flags::sndmore);
    a.dealer().send(zmq::buffer(std::string("dump")));
    CHECK(s.cache.stats().cached_entries == 40);
  }
  SUCCEED("three servers went with batches pending");
}

TEST_CASE("events: options out of range are refused, and a taken endpoint is a system_error", "[events]") {
  ghostlink::testing::temp_dir dir;
  asio::thread_pool threads{1};
  kv_block_pool pool = kv_block_pool::for_caches(config(), {.max_blocks = 16});
  kv_prefix_cache cache(1, config(), pool);
  const std::string ep = "ipc://" + (dir.path / "pub").string();
  CHECK_THROWS_AS(kv_event_publisher(cache, {.endpoint = ep, .buffer_steps = 0}), std::invalid_argument);
  CHECK_THROWS_AS(kv_event_publisher(cache, {.endpoint = "nonsense://x"}), std::system_error);
  {
    kv_event_publisher first(cache, {.endpoint = "tcp://127.0.0.1:*"});
    CHECK(first.endpoint().starts_with("tcp://127.0.0.1:"));
    CHECK_THROWS_AS(kv_event_publisher(cache, {.endpoint = first.endpoint()}), std::system_error);
  }
  threads.join();
}

}  // namespace events_tests
