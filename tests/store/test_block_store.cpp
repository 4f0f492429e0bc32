// The tier below a prefix cache's RAM (block_store.hpp, async_attach): the
// file store's entries, its budget and its faults; write-through and
// write-back; async_attach taking RAM hits first, then the store's blocks in
// order, each checked, and ending the match at the first block missing,
// corrupt, forged or late; its cancellation; attaches from several threads.
#include "common/files.hpp"
#include "common/prefix_support.hpp"
#include "common/store_fixture.hpp"
#include "store/store_writer.hpp"

#include <poll.h>
#include <signal.h>  // NOLINT(modernize-deprecated-headers): POSIX kill
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ghostlink/persist.hpp>

#include "store/entry.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace block_store_tests {

using namespace ghostlink;
using namespace ghostlink::test::prefix;
namespace fs = std::filesystem;
using ghostlink::test::read_file;
using ghostlink::test::temp_dir;
using ghostlink::test::write_file;

namespace {

/// 16 tokens: 4 full blocks of config().
std::vector<token_id> prompt() { return run(100, 16); }

/// A store that answers lookups only when told to: for deadlines and
/// cancellation at a chosen moment.
class held_store final : public kv_block_store {
 public:
  void put(std::shared_ptr<const kv_store_value> value) noexcept override {
    std::vector<std::byte> bytes(value->size());
    value->encode(bytes);
    std::lock_guard lock(mutex_);
    values_[value->hash()] = std::move(bytes);
  }
  void fetch(std::vector<kv_block_hash> hashes, fetch_handler on_value) override {
    std::lock_guard lock(mutex_);
    requests_.emplace_back(std::move(hashes), std::move(on_value));
  }
  kv_store_stats stats() const noexcept override { return {}; }

  /// Answers value `i` of every request so far; how many calls said "more".
  std::size_t answer(std::size_t i) {
    std::vector<std::pair<std::vector<kv_block_hash>, fetch_handler>> requests;
    std::map<kv_block_hash, std::vector<std::byte>> values;
    {
      std::lock_guard lock(mutex_);
      requests = requests_;
      values = values_;
    }
    std::size_t more = 0;
    for (auto& [hashes, on_value] : requests)
      if (i < hashes.size() && on_value(i, values[hashes[i]])) ++more;
    return more;
  }
  std::size_t requests() {
    std::lock_guard lock(mutex_);
    return requests_.size();
  }
  /// Lets go of every request (and what it holds).
  void drop() {
    std::lock_guard lock(mutex_);
    requests_.clear();
  }

 private:
  std::mutex mutex_;
  std::map<kv_block_hash, std::vector<std::byte>> values_;
  std::vector<std::pair<std::vector<kv_block_hash>, fetch_handler>> requests_;
};

/// The store_writer program (tests/store/store_writer.cpp), built beside
/// this test program.
fs::path writer_program() {
  if (const char* p = std::getenv("GHOSTLINK_STORE_WRITER")) return p;  // NOLINT(concurrency-mt-unsafe)
  return fs::read_symlink("/proc/self/exe").parent_path() / "store_writer";
}

/// Whether `dir` or `dir`/store holds a temporary file (a save or a store
/// write in progress).
bool has_temporary(const fs::path& dir) {
  std::error_code ec;
  for (const fs::path& d : {dir, dir / "store"})
    for (fs::directory_iterator it(d, ec), end; !ec && it != end; it.increment(ec))
      if (it->path().filename().string().find(".tmp.") != std::string::npos) return true;
  return false;
}

/// Runs the writer on `dir` until it has printed `saves` "saved" lines (60 s
/// at most), then kills it with SIGKILL as soon as a temporary file of its
/// is seen (a write in progress; at most 10 s of looking); whether one was
/// still there after the kill.
bool run_and_kill(const fs::path& dir, std::size_t saves) {
  int out[2];
  REQUIRE(::pipe(out) == 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  const std::string program = writer_program().string(), where = dir.string();
  std::vector<char*> argv{const_cast<char*>(program.c_str()), const_cast<char*>(where.c_str()), nullptr};
  pid_t pid = 0;
  const int spawned = ::posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  REQUIRE(spawned == 0);
  std::string text;
  std::size_t seen = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (seen < saves && std::chrono::steady_clock::now() < deadline) {
    pollfd p{out[0], POLLIN, 0};
    if (::poll(&p, 1, 1000) <= 0) continue;
    char buffer[256];
    const ssize_t n = ::read(out[0], buffer, sizeof buffer);
    if (n <= 0) break;
    text.append(buffer, static_cast<std::size_t>(n));
    seen = static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n'));
  }
  // The kill lands in the middle of a write: once a temporary file is seen.
  const auto looking = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!has_temporary(dir) && std::chrono::steady_clock::now() < looking) {
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::close(out[0]);
  REQUIRE(seen >= saves);
  REQUIRE(WIFSIGNALED(status));
  return has_temporary(dir);
}

/// "" when `seq` holds the first `n` tokens of writer run `r` exactly.
std::string writer_diff(const sequence_kv_cache& seq, std::size_t r, std::size_t n) {
  namespace w = ghostlink::test::store_writer;
  const std::vector<token_id> ids = w::tokens(r);
  const auto snap = seq.snapshot();
  if (snap.size() != n) return str("size ", snap.size(), ", expected ", n);
  const std::size_t width = w::config().token_width();
  for (std::size_t l = 0; l < w::layers; ++l) {
    kv_range range;
    if (snap.layer(l).read_range(0, n, range)) return str("layer ", l, " unreadable");
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t lane = 0; lane < width; ++lane)
        if (range.keys[i * width + lane] != w::key(l, i, ids[i], lane) ||
            range.values[i * width + lane] != -w::key(l, i, ids[i], lane))
          return str("layer ", l, " token ", i, " lane ", lane, " differs");
  }
  return {};
}

/// A held_store under a prefix cache whose prompt() entries it holds, RAM
/// cleared: every attach of prompt() waits on the store.
struct held_fixture {
  held_fixture() {
    sequence_kv_cache seq(threads, 2, config(), pool);
    REQUIRE(append(seq, prompt()) == ghostlink::error_code());
    REQUIRE(cache.insert(seq, prompt()) == 4);
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
    cache.clear();
  }
  held_fixture(const held_fixture&) = delete;
  held_fixture& operator=(const held_fixture&) = delete;
  ~held_fixture() {
    store->drop();
    threads.join();
  }

  asio::thread_pool threads{2};
  std::shared_ptr<held_store> store = std::make_shared<held_store>();
  kv_block_pool pool = kv_block_pool::for_caches<float>(config(), {.max_blocks = 100});
  kv_prefix_cache cache{2, config(), pool, {.model = "m", .store = store}};
};

}  // namespace

TEST_CASE("a process killed in the middle of its saves and store writes leaves whole files or none, never torn") {
  namespace w = ghostlink::test::store_writer;
  // Up to 10 runs, until a kill lands while a temporary file exists (a save
  // or a store write in progress); every run's files are checked.
  bool landed_mid_write = false;
  for (std::size_t attempt = 0; attempt < 10 && !landed_mid_write; ++attempt) {
    temp_dir dir;
    landed_mid_write = run_and_kill(dir.path, 3 + attempt % 3);
    asio::thread_pool threads(2), io(2);
    {
      kv_block_pool pool = kv_block_pool::for_caches<float>(w::config(), {.max_blocks = 4096});
      // The saved file is one of the two sequences, whole.
      auto [loaded, ids] =
          async_load<float>(threads.get_executor(), dir.path / "saved.kv", pool,
                            {.num_layers = w::layers, .config = w::config(), .model = "writer"}, asio::use_future)
              .get();
      REQUIRE(ids.size() == w::length);
      const std::size_t r = ids[0] == 0 ? 0 : 1;
      CHECK(writer_diff(loaded, r, w::length) == "");
      // Every entry file is whole, and attaching from the store gives the
      // runs' data exactly, as far as their entries reach.
      const detail::entry_geometry g(kv_model_layout::full(w::layers), w::config(), detail::codec_of<float>);
      auto store =
          std::make_shared<kv_file_store>(dir.path / "store", kv_file_store_limits{.io_executor = io.get_executor()});
      std::size_t files = 0;
      for (const auto& e : fs::directory_iterator(dir.path / "store")) {
        const std::string name = e.path().filename().string();
        CHECK(name.find(".tmp.") == std::string::npos);  // the killed writer's are removed
        ++files;
        bool whole = false;
        kv_prefix_cache probe(w::layers, w::config(), pool, {.model = "writer"});
        for (std::size_t run_index = 0; run_index < 2 && !whole; ++run_index)
          for (const kv_block_hash& h : probe.block_hashes(w::tokens(run_index)))
            if (store->path_of(h).filename() == name) whole = detail::check_entry(g, h, read_file(e.path()));
        CHECK(whole);
      }
      CHECK(files > 0);
      CHECK(store->stats().entries == files);
      kv_prefix_cache cache(w::layers, w::config(), pool, {.model = "writer", .store = store});
      std::size_t attached = 0;
      for (std::size_t run_index = 0; run_index < 2; ++run_index) {
        attach_waiter done;
        cache.async_attach(threads.get_executor(), w::tokens(run_index), {}, done.handler());
        auto [ec, seq] = done.get();
        CHECK(ec == ghostlink::error_code());
        CHECK(writer_diff(seq, run_index, seq.size()) == "");
        attached += seq.size();
      }
      CHECK(attached > 0);
    }
    io.join();
    threads.join();
  }
  CHECK(landed_mid_write);
}

TEST_CASE("write-through stores every inserted entry in its own file, and a cleared cache attaches them back exactly") {
  store_fixture f;
  const std::vector<token_id> ids = prompt();
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();
  const kv_store_stats s = f.store->stats();
  CHECK(s.puts == 4);
  CHECK(s.stored == 4);
  CHECK(s.entries == 4);
  CHECK(f.cache.stats().store_puts == 4);
  for (std::size_t b = 0; b < 4; ++b) CHECK(fs::exists(f.file_of(ids, b)));

  f.cache.clear();
  REQUIRE(f.cache.match(ids) == 0);
  auto [ec, seq] = f.attach(ids);
  REQUIRE(ec == ghostlink::error_code());
  CHECK(diff(seq, ids) == "");
  CHECK(f.cache.stats().store_hit_tokens == 16);
  CHECK(f.store->stats().hits == 4);
  // Fetched entries are in RAM again: the next attach reads no file.
  CHECK(f.cache.match(ids) == 16);
  auto [ec2, again] = f.attach(ids);
  CHECK(ec2 == ghostlink::error_code());
  CHECK(diff(again, ids) == "");
  CHECK(f.store->stats().lookups == 4);
}

TEST_CASE("async_attach takes the RAM hits first and asks the store only for the blocks after them") {
  store_fixture f;
  const std::vector<token_id> ids = prompt();
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();
  f.cache.clear();
  // The first two blocks back in RAM, from the store.
  const std::vector<token_id> half(ids.begin(), ids.begin() + 8);
  REQUIRE(diff(f.attach(half).second, half) == "");
  REQUIRE(f.store->stats().lookups == 2);
  REQUIRE(f.cache.match(ids) == 8);

  auto [ec, seq] = f.attach(ids);
  REQUIRE(ec == ghostlink::error_code());
  CHECK(diff(seq, ids) == "");
  CHECK(f.store->stats().lookups == 4);  // blocks 2 and 3 only
  CHECK(f.cache.stats().store_hit_tokens == 16);
}

TEST_CASE("a block missing from the store ends the match there: the blocks before it attach, none after") {
  store_fixture f;
  const std::vector<token_id> ids = prompt();
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();
  f.cache.clear();
  REQUIRE(fs::remove(f.file_of(ids, 2)));
  auto [ec, seq] = f.attach(ids);
  REQUIRE(ec == ghostlink::error_code());
  const std::vector<token_id> first(ids.begin(), ids.begin() + 8);
  CHECK(diff(seq, first) == "");
  CHECK(f.cache.match(ids) == 8);
}

TEST_CASE("a corrupted or truncated entry file is a miss, counted as a reject, never data") {
  store_fixture f;
  const std::vector<token_id> ids = prompt();
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();
  const fs::path victim = f.file_of(ids, 1);
  const std::vector<std::byte> good = read_file(victim);
  const std::vector<token_id> first(ids.begin(), ids.begin() + 4);

  std::size_t rejects = 1;
  std::uint64_t oversized = 0;
  SECTION("truncated") { write_file(victim, std::vector<std::byte>(good.begin(), good.end() - 9)); }
  SECTION("one byte longer: over the cap the prefix cache set, not read") {
    std::vector<std::byte> longer = good;
    longer.push_back(std::byte{0});
    write_file(victim, longer);
    rejects = 0;
    oversized = 1;
  }
  SECTION("empty: no bytes, a plain miss") {
    write_file(victim, {});
    rejects = 0;
  }
  f.cache.clear();
  auto [ec, seq] = f.attach(ids);
  REQUIRE(ec == ghostlink::error_code());
  CHECK(diff(seq, first) == "");
  CHECK(f.cache.stats().store_rejects == rejects);
  CHECK(f.store->stats().oversized == oversized);
  CHECK(f.cache.match(ids) == 4);
}

TEST_CASE("every single flipped byte of an entry file makes it a miss") {
  store_fixture f;
  const std::vector<token_id> ids = run(7, 4);  // one block
  REQUIRE(f.insert(ids) == 1);
  f.store->flush();
  const fs::path file = f.file_of(ids, 0);
  const std::vector<std::byte> good = read_file(file);
  REQUIRE(good.size() ==
          detail::entry_geometry(kv_model_layout::full(2), config(), detail::codec_of<float>).entry_bytes(2));
  std::size_t attached = 0;
  for (std::size_t i = 0; i < good.size(); ++i) {
    std::vector<std::byte> bad = good;
    bad[i] ^= std::byte{0x01};
    write_file(file, bad);
    f.cache.clear();
    const attach_result r = f.attach(ids);
    REQUIRE(r.first == ghostlink::error_code());
    attached += r.second.size();
  }
  CHECK(attached == 0);
  CHECK(f.cache.stats().store_rejects == good.size());
  // The good bytes again: a hit.
  write_file(file, good);
  f.cache.clear();
  CHECK(diff(f.attach(ids).second, ids) == "");
}

TEST_CASE("an entry of another model or geometry put under an entry's name is refused") {
  store_fixture f;
  const std::vector<token_id> ids = prompt();
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();

  SECTION("another model") {
    store_fixture other({}, kv_store_policy::write_through, 1000, "model-b");
    REQUIRE(other.insert(ids) == 4);
    other.store->flush();
    for (std::size_t b = 0; b < 4; ++b)
      fs::copy_file(other.file_of(ids, b), f.file_of(ids, b), fs::copy_options::overwrite_existing);
  }
  std::size_t rejects = 1;
  std::uint64_t oversized = 0;
  SECTION("another geometry (3 layers): larger than the cap, not read") {
    store_fixture other({}, kv_store_policy::write_through, 1000, "model-a", 3);
    REQUIRE(other.insert(ids) == 4);
    other.store->flush();
    for (std::size_t b = 0; b < 4; ++b)
      fs::copy_file(other.file_of(ids, b), f.file_of(ids, b), fs::copy_options::overwrite_existing);
    rejects = 0;
    oversized = 1;
  }
  SECTION("another block of the same model") {
    for (std::size_t b = 0; b < 4; ++b) fs::copy_file(f.file_of(ids, 3 - b), f.file_of(ids, b).string() + ".x");
    for (std::size_t b = 0; b < 4; ++b) fs::rename(f.file_of(ids, b).string() + ".x", f.file_of(ids, b));
  }
  f.cache.clear();
  auto [ec, seq] = f.attach(ids);
  REQUIRE(ec == ghostlink::error_code());
  CHECK(seq.size() == 0);
  CHECK(f.cache.stats().store_rejects == rejects);
  // The lookups after the first miss may be skipped: each that ran counts.
  if (oversized == 0)
    CHECK(f.store->stats().oversized == 0);
  else
    CHECK(f.store->stats().oversized >= 1);
  CHECK(f.cache.match(ids) == 0);
}

TEST_CASE("a fetched block the pool has no room for ends the match there, without an error") {
  // 2 layers x 4 blocks of budget.
  store_fixture f({}, kv_store_policy::write_through, 8);
  const std::vector<token_id> ids = prompt();
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();
  f.cache.clear();
  // A sequence in use holds 3 blocks a layer: room for one fetched block.
  sequence_kv_cache busy(f.threads, 2, config(), f.pool);
  REQUIRE(append(busy, run(5000, 12)) == ghostlink::error_code());
  auto [ec, seq] = f.attach(ids);
  CHECK(ec == ghostlink::error_code());
  const std::vector<token_id> first(ids.begin(), ids.begin() + 4);
  CHECK(diff(seq, first) == "");
  CHECK(f.cache.match(ids) == 4);
  CHECK(diff(busy, run(5000, 12)) == "");
}

TEST_CASE("an unwritable directory loses the writes, counted; RAM keeps serving every entry") {
  store_fixture f;
  // The directory becomes a file: every write fails (ENOTDIR), also as root.
  fs::remove_all(f.dir.path);
  write_file(f.dir.path, {});
  const std::vector<token_id> ids = prompt();
  REQUIRE(f.insert(ids) == 4);
  f.store->flush();
  const kv_store_stats s = f.store->stats();
  CHECK(s.puts == 4);
  CHECK(s.stored == 0);
  CHECK(s.write_errors == 4);
  CHECK(s.entries == 0);
  CHECK(s.bytes == 0);
  CHECK(f.cache.match(ids) == 16);
  auto [ec, seq] = f.attach(ids);
  CHECK(ec == ghostlink::error_code());
  CHECK(diff(seq, ids) == "");
  // After a clear the store has nothing to give: a miss, not an error.
  f.cache.clear();
  auto [ec2, none] = f.attach(ids);
  CHECK(ec2 == ghostlink::error_code());
  CHECK(none.size() == 0);
  fs::remove(f.dir.path);
}

TEST_CASE("a directory that cannot be made throws from the store's constructor") {
  temp_dir dir;
  write_file(dir.path / "file", {});
  CHECK_THROWS_AS(kv_file_store(dir.path / "file" / "store"), std::system_error);
}

TEST_CASE("the disk budget evicts the least recently used entries, and never exceeds the budget") {
  const std::size_t entry =
      detail::entry_geometry(kv_model_layout::full(2), config(), detail::codec_of<float>).entry_bytes(2);
  store_fixture f({.max_bytes = 3 * entry});
  const std::vector<token_id> a = run(0, 8), b = run(1000, 8);
  REQUIRE(f.insert(a) == 2);
  f.store->flush();
  // a's block 0 read last: the least recently used is a's block 1.
  f.cache.clear();
  const std::vector<token_id> a0(a.begin(), a.begin() + 4);
  REQUIRE(diff(f.attach(a0).second, a0) == "");
  REQUIRE(f.insert(b) == 2);
  f.store->flush();
  const kv_store_stats s = f.store->stats();
  CHECK(s.bytes <= 3 * entry);
  CHECK(s.entries == 3);
  CHECK(s.evictions == 1);
  CHECK(fs::exists(f.file_of(a, 0)));
  CHECK_FALSE(fs::exists(f.file_of(a, 1)));
  CHECK(fs::exists(f.file_of(b, 0)));
  CHECK(fs::exists(f.file_of(b, 1)));

  SECTION("a value larger than the whole budget is dropped") {
    store_fixture tiny({.max_bytes = entry - 1});
    REQUIRE(tiny.insert(a) == 2);
    tiny.store->flush();
    CHECK(tiny.store->stats().dropped == 2);
    CHECK(tiny.store->stats().entries == 0);
  }
  SECTION("puts beyond the pending limit are dropped, not queued") {
    store_fixture slow({.max_pending_bytes = 0});
    REQUIRE(slow.insert(a) == 2);
    slow.store->flush();
    CHECK(slow.store->stats().dropped == 2);
    CHECK(slow.cache.match(a) == 8);
  }
}

TEST_CASE("a store made on an existing directory finds its entries: a restarted server attaches them") {
  temp_dir shared;
  const std::vector<token_id> ids = prompt();
  {
    store_fixture first;
    first.store = first.make_store(shared.path, {});
    // A cache on the new store (the fixture's own keeps the first).
    kv_block_pool pool = kv_block_pool::for_caches<float>(config(), {.max_blocks = 100});
    kv_prefix_cache cache(2, config(), pool, {.model = "model-a", .store = first.store});
    sequence_kv_cache seq(first.threads, 2, config(), pool);
    REQUIRE(append(seq, ids) == ghostlink::error_code());
    REQUIRE(cache.insert(seq, ids) == 4);
    first.store->flush();
  }
  // A leftover temporary file of a process that is gone is removed.
  write_file(shared.path / ".0000.kvb.tmp.2147483646.0", {});
  store_fixture second;
  second.store = second.make_store(shared.path, {});
  CHECK(second.store->stats().entries == 4);
  CHECK_FALSE(fs::exists(shared.path / ".0000.kvb.tmp.2147483646.0"));
  kv_block_pool pool = kv_block_pool::for_caches<float>(config(), {.max_blocks = 100});
  kv_prefix_cache cache(2, config(), pool, {.model = "model-a", .store = second.store});
  attach_waiter done;
  cache.async_attach(second.threads.get_executor(), ids, {}, done.handler());
  auto [ec, seq] = done.get();
  CHECK(ec == ghostlink::error_code());
  CHECK(diff(seq, ids) == "");
}

TEST_CASE("write-back stores an entry when it is evicted, not before, and attaches it back") {
  // 2 layers x 4 blocks of budget: one 16-token prompt fills it.
  store_fixture f({}, kv_store_policy::write_back, 8);
  const std::vector<token_id> a = run(0, 16), b = run(500, 8);
  REQUIRE(f.insert(a) == 4);
  f.store->flush();
  CHECK(f.store->stats().puts == 0);
  // A new prompt needs 4 blocks: a's two deepest entries are evicted.
  REQUIRE(f.insert(b) == 2);
  f.store->flush();
  CHECK(f.cache.stats().evicted_blocks == 2);
  CHECK(f.store->stats().stored == 2);
  CHECK(fs::exists(f.file_of(a, 3)));
  CHECK(fs::exists(f.file_of(a, 2)));
  CHECK_FALSE(fs::exists(f.file_of(a, 0)));
  // b is let go of; attaching a evicts b (written back too) and reads a's tail.
  {
    auto [ec, seq] = f.attach(a);
    REQUIRE(ec == ghostlink::error_code());
    CHECK(diff(seq, a) == "");
    f.store->flush();
    CHECK(f.store->stats().stored == 4);
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  }
  // A prompt that needs the whole pool evicts a's four entries: the two that
  // came from the store are not written again, the two others are.
  REQUIRE(f.insert(run(900, 16)) == 4);
  f.store->flush();
  CHECK(f.store->stats().puts == 6);
  CHECK(f.cache.stats().store_puts == 6);
}

TEST_CASE("a store that does not answer in time is a miss after the deadline, with the RAM hits attached") {
  held_fixture f;
  auto& [threads, store, pool, cache] = f;
  const std::vector<token_id> ids = prompt();
  const std::vector<token_id> first(ids.begin(), ids.begin() + 4);
  attach_waiter one;
  cache.async_attach(threads.get_executor(), first, {}, one.handler());
  REQUIRE(store->answer(0) == 0);  // the one block asked: done
  REQUIRE(diff(one.get().second, first) == "");

  attach_waiter done;
  cache.async_attach(threads.get_executor(), ids, {}, {.timeout = std::chrono::milliseconds(50)}, done.handler());
  auto [ec, seq] = done.get();  // nothing answers: the deadline ends it
  CHECK(ec == ghostlink::error_code());
  CHECK(diff(seq, first) == "");
  CHECK(store->requests() == 2);
  CHECK(store->answer(0) == 0);  // a late answer is not wanted
  CHECK(cache.match(ids) == 4);
  seq = {};
}

TEST_CASE("cancelling an attach that waits on the store completes it with operation_aborted and the blocks so far") {
  held_fixture f;
  auto& [threads, store, pool, cache] = f;
  const std::vector<token_id> ids = prompt();
  asio::cancellation_signal signal;
  attach_waiter done;
  cache.async_attach(threads.get_executor(), ids, {}, asio::bind_cancellation_slot(signal.slot(), done.handler()));
  REQUIRE(store->answer(0) == 1);  // block 0 attached, more wanted
  signal.emit(asio::cancellation_type::terminal);
  CHECK(store->answer(1) == 0);  // seen at the next value
  auto [ec, seq] = done.get();
  CHECK(ec == asio::error::operation_aborted);
  const std::vector<token_id> first(ids.begin(), ids.begin() + 4);
  CHECK(diff(seq, first) == "");
  seq = {};
}

TEST_CASE("values the store delivers out of order attach in block order") {
  held_fixture f;
  auto& [threads, store, pool, cache] = f;
  const std::vector<token_id> ids = prompt();
  attach_waiter done;
  cache.async_attach(threads.get_executor(), ids, {}, done.handler());
  CHECK(store->answer(3) == 1);
  CHECK(store->answer(1) == 1);
  CHECK(store->answer(2) == 1);
  CHECK(store->answer(0) == 0);  // block 0 lets all four attach: done
  auto [ec, seq] = done.get();
  CHECK(ec == ghostlink::error_code());
  CHECK(diff(seq, ids) == "");
  seq = {};
}

TEST_CASE("cancelling an attach whose store never answers completes it with operation_aborted and the RAM hits") {
  held_fixture f;
  auto& [threads, store, pool, cache] = f;
  const std::vector<token_id> ids = prompt();
  asio::cancellation_signal signal;
  attach_waiter done;
  cache.async_attach(threads.get_executor(), ids, {}, asio::bind_cancellation_slot(signal.slot(), done.handler()));
  REQUIRE(store->requests() == 1);
  signal.emit(asio::cancellation_type::terminal);  // no value comes after it
  auto [ec, seq] = done.get();
  CHECK(ec == asio::error::operation_aborted);
  CHECK(seq.size() == 0);
  CHECK(store->answer(0) == 0);  // a late value is refused
  seq = {};
}

TEST_CASE("a store that lets go of a lookup without answering ends the attach with what came") {
  held_fixture f;
  auto& [threads, store, pool, cache] = f;
  const std::vector<token_id> ids = prompt();
  attach_waiter done;
  cache.async_attach(threads.get_executor(), ids, {}, done.handler());
  REQUIRE(store->answer(0) == 1);
  store->drop();  // the store's context went away with the request
  auto [ec, seq] = done.get();
  CHECK(ec == ghostlink::error_code());
  const std::vector<token_id> first(ids.begin(), ids.begin() + 4);
  CHECK(diff(seq, first) == "");
  seq = {};
}

TEST_CASE("a well-formed entry of another geometry under the right hash is refused by its header") {
  store_fixture f;
  const std::vector<token_id> ids = run(7, 4);  // one block
  REQUIRE(f.insert(ids) == 1);
  f.store->flush();
  const kv_block_hash h = f.cache.block_hashes(ids)[0];
  // 4 heads of 2 lanes for 2 heads of 4: the same size, valid checksums and
  // hash; only the header's geometry tells it apart. Likewise element code 1
  // (half) with 4-byte elements.
  kv_cache_config other = config();
  other.num_heads = 4;
  other.head_dim = 2;
  const detail::entry_geometry swapped(kv_model_layout::full(2), other, detail::codec_of<float>);
  detail::element_codec half_code = detail::codec_of<float>;  // float's bytes, labelled half
  half_code.code = detail::element_code<half>;
  const detail::entry_geometry relabelled(kv_model_layout::full(2), config(), half_code);
  for (const detail::entry_geometry& g : {swapped, relabelled}) {
    std::vector<std::byte> payload(g.block_bytes(), std::byte{0x3f});
    const std::vector<const std::byte*> layers{payload.data(), payload.data() + g.block_bytes() / 2, payload.data(),
                                               payload.data() + g.block_bytes() / 2};
    std::vector<std::byte> forged(g.entry_bytes(2));
    detail::encode_entry(g, h, layers, forged);
    REQUIRE(forged.size() == read_file(f.file_of(ids, 0)).size());
    write_file(f.file_of(ids, 0), forged);
    f.cache.clear();
    const attach_result r = f.attach(ids);
    CHECK(r.first == ghostlink::error_code());
    CHECK(r.second.size() == 0);
  }
  CHECK(f.cache.stats().store_rejects == 2);
}

TEST_CASE("without a store async_attach is attach, completing through the handler's executor") {
  asio::thread_pool threads(2);
  kv_block_pool pool = kv_block_pool::for_caches<float>(config(), {.max_blocks = 100});
  kv_prefix_cache cache(2, config(), pool, {.model = "m"});
  const std::vector<token_id> ids = prompt();
  sequence_kv_cache seq(threads, 2, config(), pool);
  REQUIRE(append(seq, ids) == ghostlink::error_code());
  REQUIRE(cache.insert(seq, ids) == 4);
  CHECK(cache.stats().store_puts == 0);
  auto attached = cache.async_attach(threads.get_executor(), ids, {}, asio::use_future).get();
  CHECK(diff(attached, ids) == "");
  attached = {};
  seq = {};
  threads.join();
}

TEST_CASE("attaches from several threads at once each get the prefix exactly, from the store or from RAM") {
  store_fixture f;
  std::vector<std::vector<token_id>> prompts;
  for (token_id p = 0; p < 4; ++p) prompts.push_back(run(p * 1000, 16));
  for (const auto& p : prompts) REQUIRE(f.insert(p) == 4);
  f.store->flush();
  f.cache.clear();
  std::atomic<std::size_t> wrong{0};
  std::vector<std::thread> workers;
  for (std::size_t t = 0; t < 4; ++t)
    workers.emplace_back([&, t] {
      for (std::size_t round = 0; round < 8; ++round) {
        const auto& p = prompts[(t + round) % prompts.size()];
        const attach_result r = f.attach(p);
        if (r.first || diff(r.second, p) != "") ++wrong;
        if (round % 3 == 2) f.cache.clear();
      }
    });
  for (std::thread& w : workers) w.join();
  CHECK(wrong.load() == 0);
}

}  // namespace block_store_tests
