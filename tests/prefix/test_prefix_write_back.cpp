// Write-back that survives a shutdown: clear() hands the store the entries
// leaving RAM, async_flush() stores what RAM holds and completes only once
// the store has settled those puts, nothing is put twice (a second flush,
// an eviction after a flush, flushes from several threads while others
// insert), and a restarted process attaches from a file store what a
// flushed one computed (tests/prefix/prefix_writer.cpp).

#include "common/files.hpp"
#include "common/prefix_support.hpp"
#include "store/store_writer.hpp"

#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <functional>
#include <future>
#include <latch>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace prefix_write_back_tests {

using namespace ghostlink;
using namespace ghostlink::test::prefix;
namespace fs = std::filesystem;
using ghostlink::test::temp_dir;

namespace {

/// A store whose puts stay pending until settle() (or settle at once, when
/// `immediate`): then their bytes are stored, their values let go of, and
/// the when_flushed callbacks waiting behind them called. Fetches are
/// answered from what is stored, on `ex`. Counts the puts of each hash.
class settling_store final : public kv_block_store {
 public:
  settling_store(asio::any_io_executor ex, bool immediate) : ex_(std::move(ex)), immediate_(immediate) {}

  void put(std::shared_ptr<const kv_store_value> value) noexcept override {
    std::optional<std::promise<void>> entered;
    {
      std::lock_guard lock(mutex_);
      entered.swap(hold_);
    }
    if (entered) {  // held: as a slow put() would be, inside a write-back's eviction
      entered->set_value();
      release_.wait();
    }
    {
      std::lock_guard lock(mutex_);
      ++puts_[value->hash()];
      pending_.push_back(std::move(value));
    }
    if (immediate_) settle();
  }
  void fetch(std::vector<kv_block_hash> hashes, fetch_handler on_value) override {
    asio::post(ex_, [this, hashes = std::move(hashes), on_value = std::move(on_value)] {
      for (std::size_t i = 0; i < hashes.size(); ++i) {
        std::vector<std::byte> bytes;
        {
          std::lock_guard lock(mutex_);
          if (auto it = values_.find(hashes[i]); it != values_.end()) bytes = it->second;
        }
        if (!on_value(i, std::move(bytes))) return;
      }
    });
  }
  kv_store_stats stats() const noexcept override {
    std::lock_guard lock(mutex_);
    kv_store_stats s;
    for (const auto& [hash, n] : puts_) s.puts += n;
    s.stored = stored_;
    s.entries = values_.size();
    return s;
  }
  void when_flushed(std::function<void()> done) override {
    std::unique_lock lock(mutex_);
    if (pending_.empty()) {
      lock.unlock();
      done();
      return;
    }
    waiters_.push_back(std::move(done));  // behind every pending put: settle() settles them all
  }

  /// Stores every pending put, lets go of its value, then calls the
  /// callbacks that waited for them.
  void settle() {
    std::deque<std::shared_ptr<const kv_store_value>> pending;
    std::vector<std::function<void()>> waiters;
    {
      std::lock_guard lock(mutex_);
      pending.swap(pending_);
      waiters.swap(waiters_);
    }
    for (const auto& v : pending) {
      std::vector<std::byte> bytes(v->size());
      v->encode(bytes);
      std::lock_guard lock(mutex_);
      values_[v->hash()] = std::move(bytes);
      ++stored_;
    }
    pending.clear();  // the blocks go back to their pool before anyone is told
    for (auto& done : waiters) done();
  }
  std::size_t pending() const {
    std::lock_guard lock(mutex_);
    return pending_.size();
  }
  std::size_t waiters() const {
    std::lock_guard lock(mutex_);
    return waiters_.size();
  }
  /// Makes the next put() wait inside until release_put(); the future is
  /// ready once it is there.
  std::future<void> hold_next_put() {
    std::lock_guard lock(mutex_);
    hold_.emplace();
    return hold_->get_future();
  }
  void release_put() { released_.set_value(); }
  /// The most puts any one hash had.
  std::size_t most_puts_of_a_hash() const {
    std::lock_guard lock(mutex_);
    std::size_t most = 0;
    for (const auto& [hash, n] : puts_) most = std::max(most, n);
    return most;
  }

 private:
  const asio::any_io_executor ex_;
  const bool immediate_;
  mutable std::mutex mutex_;
  std::map<kv_block_hash, std::size_t> puts_;
  std::deque<std::shared_ptr<const kv_store_value>> pending_;
  std::vector<std::function<void()>> waiters_;
  std::map<kv_block_hash, std::vector<std::byte>> values_;
  std::size_t stored_ = 0;
  std::optional<std::promise<void>> hold_;
  std::promise<void> released_;
  std::shared_future<void> release_ = released_.get_future().share();
};

/// A settling store and, above it, a write-back prefix cache of 2 layers on
/// a pool of `max_blocks`; the store's fetches answered on its own threads,
/// joined last.
struct write_back_fixture {
  explicit write_back_fixture(bool immediate = false, std::size_t max_blocks = 1000)
      : store(std::make_shared<settling_store>(io.get_executor(), immediate)),
        f(max_blocks, 2, {.model = "model-a", .store = store, .store_policy = kv_store_policy::write_back}) {}
  write_back_fixture(const write_back_fixture&) = delete;
  write_back_fixture& operator=(const write_back_fixture&) = delete;
  ~write_back_fixture() { io.join(); }

  std::uint64_t puts() const { return store->stats().puts; }

  asio::thread_pool io{1};
  std::shared_ptr<settling_store> store;
  fixture<> f;
};

ghostlink::error_code flush(kv_prefix_cache& cache) {
  return wait_ec([&](auto token) { return cache.async_flush(token); });
}

/// 16 tokens: 4 full blocks of config().
std::vector<token_id> prompt() { return run(100, 16); }

/// "" when `a` and `b` hold the same tokens: size, ids, every layer's keys
/// and values.
std::string same_kv(const sequence_kv_cache& a, const sequence_kv_cache& b) {
  const auto sa = a.snapshot(), sb = b.snapshot();
  if (sa.size() != sb.size()) return str("size ", sa.size(), " against ", sb.size());
  if (sa.token_ids() != sb.token_ids()) return "token ids differ";
  for (std::size_t l = 0; l < sa.num_layers(); ++l) {
    kv_range ra, rb;
    if (sa.layer(l).read_range(0, sa.size(), ra) || sb.layer(l).read_range(0, sb.size(), rb))
      return str("layer ", l, " unreadable");
    if (ra.keys != rb.keys || ra.values != rb.values) return str("layer ", l, " differs");
  }
  return {};
}

/// The prefix_writer program (tests/prefix/prefix_writer.cpp), built beside
/// this test program.
fs::path writer_program() {
  if (const char* p = std::getenv("GHOSTLINK_PREFIX_WRITER")) return p;  // NOLINT(concurrency-mt-unsafe)
  return fs::read_symlink("/proc/self/exe").parent_path() / "prefix_writer";
}

/// Runs `program` with `arg` to its end; its exit status, -1 if it did not
/// exit normally.
int run_to_end(const fs::path& program, const std::string& arg) {
  const std::string name = program.string();
  std::vector<char*> argv{const_cast<char*>(name.c_str()), const_cast<char*>(arg.c_str()), nullptr};
  pid_t pid = 0;
  if (::posix_spawn(&pid, name.c_str(), nullptr, nullptr, argv.data(), environ) != 0) return -1;
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

}  // namespace

TEST_CASE("clear() on a write-back cache hands the store every entry not in it, and an attach finds them there") {
  write_back_fixture w;
  auto& [io, store, f] = w;
  const std::vector<token_id> ids = prompt(), other = run(500, 8);
  REQUIRE(f.insert_idle(ids) == 4);
  sequence_kv_cache held = f.prefill(other);  // two entries in use
  REQUIRE(f.cache.insert(held, other) == 2);
  CHECK(w.puts() == 0);
  f.cache.clear();
  CHECK(f.cache.stats().cached_entries == 0);
  CHECK(w.puts() == 6);  // idle and in use alike
  CHECK(f.cache.stats().store_puts == 6);
  CHECK(store->pending() == 6);  // clear() does not wait for the store
  store->settle();
  CHECK(store->stats().entries == 6);
  auto [ec, seq] = attach_waited(f.cache, f.threads, ids);
  CHECK(ec == ghostlink::error_code());
  CHECK(diff(seq, ids) == "");
  CHECK(f.cache.stats().store_hit_tokens == 16);
  // What came from the store is not put again, neither by clear() nor by a flush.
  seq = {};
  CHECK(flush(f.cache) == ghostlink::error_code());
  f.cache.clear();
  CHECK(w.puts() == 6);
  CHECK(store->most_puts_of_a_hash() == 1);
}

TEST_CASE("clear() on a write-through cache puts nothing again") {
  write_back_fixture w(true);
  auto& [io, store, f] = w;
  fixture<> through(1000, 2, {.model = "model-a", .store = store});
  REQUIRE(through.insert_idle(prompt()) == 4);
  CHECK(w.puts() == 4);
  through.cache.clear();
  CHECK(flush(through.cache) == ghostlink::error_code());
  CHECK(w.puts() == 4);
}

TEST_CASE("async_flush completes only once the store has settled its puts, the entries held until then") {
  write_back_fixture w;
  auto& [io, store, f] = w;
  const std::vector<token_id> ids = prompt();
  REQUIRE(f.insert_idle(ids) == 4);
  std::promise<std::pair<ghostlink::error_code, std::uint64_t>> done;
  f.cache.async_flush([&](ghostlink::error_code ec) { done.set_value({ec, store->stats().stored}); });
  CHECK(w.puts() == 4);
  CHECK(store->pending() == 4);
  CHECK(store->waiters() == 1);
  CHECK(f.cache.stats().idle_blocks == 0);  // held by the store's values, as an attach holds them
  CHECK(f.cache.stats().cached_entries == 4);
  store->settle();
  auto [ec, stored_then] = done.get_future().get();
  CHECK(ec == ghostlink::error_code());
  CHECK(stored_then == 4);  // the handler ran after the store had every entry
  CHECK(f.cache.stats().idle_blocks == 4);
  CHECK(f.cache.stats().store_puts == 4);
}

TEST_CASE("a second async_flush puts nothing, nor does evicting an entry a flush stored") {
  // 2 layers x 4 blocks of budget: one 16-token prompt fills it.
  write_back_fixture w(true, 8);
  auto& [io, store, f] = w;
  const std::vector<token_id> a = prompt(), b = run(900, 16);
  REQUIRE(f.insert_idle(a) == 4);
  CHECK(flush(f.cache) == ghostlink::error_code());
  CHECK(w.puts() == 4);
  CHECK(flush(f.cache) == ghostlink::error_code());
  CHECK(w.puts() == 4);
  REQUIRE(f.insert_idle(b) == 4);  // evicts a's four entries
  CHECK(f.cache.stats().evicted_blocks == 4);
  CHECK(w.puts() == 4);
  CHECK(flush(f.cache) == ghostlink::error_code());
  CHECK(w.puts() == 8);
  CHECK(store->most_puts_of_a_hash() == 1);
}

TEST_CASE("async_flush stores the entries a sequence still uses, and another cache attaches them") {
  write_back_fixture w(true);
  auto& [io, store, f] = w;
  const std::vector<token_id> ids = prompt();
  sequence_kv_cache held = f.prefill(ids);
  REQUIRE(f.cache.insert(held, ids) == 4);
  CHECK(flush(f.cache) == ghostlink::error_code());
  CHECK(w.puts() == 4);
  CHECK(diff(held, ids) == "");  // the sequence is untouched
  fixture<> restarted(1000, 2, {.model = "model-a", .store = store, .store_policy = kv_store_policy::write_back});
  auto [ec, seq] = attach_waited(restarted.cache, restarted.threads, ids);
  CHECK(ec == ghostlink::error_code());
  CHECK(diff(seq, ids) == "");
  CHECK(restarted.cache.stats().store_hit_tokens == 16);
}

TEST_CASE("async_flush without a store, or with nothing to put, completes with success") {
  fixture<> f;
  REQUIRE(f.insert_idle(prompt()) == 4);
  CHECK(flush(f.cache) == ghostlink::error_code());
  write_back_fixture w(true);
  CHECK(flush(w.f.cache) == ghostlink::error_code());
  CHECK(w.puts() == 0);
  // As a server's shutdown awaits it, in a coroutine on the cache's threads.
  REQUIRE(w.f.insert_idle(prompt()) == 4);
  asio::co_spawn(
      w.f.threads, [&]() -> asio::awaitable<void> { co_await w.f.cache.async_flush(asio::use_awaitable); },
      asio::use_future)
      .get();
  CHECK(w.puts() == 4);
}

TEST_CASE("async_flush from two threads while two others insert completes every time and puts no entry twice") {
  constexpr std::size_t threads = 2, prompts = 20;
  write_back_fixture w(true, 4000);
  auto& [io, store, f] = w;
  std::latch start(2 * threads);
  std::atomic<std::size_t> failures{0}, flushes{0};
  std::vector<std::thread> workers;
  for (std::size_t t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {  // inserts prompts of its own, let go of at once
      start.arrive_and_wait();
      for (std::size_t i = 0; i < prompts; ++i) {
        const std::vector<token_id> ids = run(static_cast<token_id>(10000 * (t + 1) + 100 * i), 16);
        sequence_kv_cache seq(f.threads, 2, config(), f.pool);
        if (append(seq, ids) != ghostlink::error_code() || f.cache.insert(seq, ids) != 4) ++failures;
      }
    });
    workers.emplace_back([&] {
      start.arrive_and_wait();
      for (std::size_t i = 0; i < prompts; ++i)
        if (flush(f.cache) == ghostlink::error_code()) ++flushes;
    });
  }
  for (std::thread& t : workers) t.join();
  CHECK(failures == 0);
  CHECK(flushes == threads * prompts);
  CHECK(flush(f.cache) == ghostlink::error_code());
  CHECK(f.cache.stats().cached_entries == threads * prompts * 4);
  CHECK(w.puts() == threads * prompts * 4);
  CHECK(f.cache.stats().store_puts == threads * prompts * 4);
  CHECK(store->most_puts_of_a_hash() == 1);
}

TEST_CASE("async_flush waits for the write-back another thread is putting when it looks") {
  // 2 layers x 5 blocks: a's 4 entries and 2 blocks free; b's 2 entries
  // need 2 more, so a's deepest entry is evicted, and its put is held.
  write_back_fixture w(true, 10);
  auto& [io, store, f] = w;
  const std::vector<token_id> a = prompt(), b = run(900, 8);
  REQUIRE(f.insert_idle(a) == 4);
  std::future<void> in_put = store->hold_next_put();
  auto evicting = std::async(std::launch::async, [&] {
    sequence_kv_cache seq(f.threads, 2, config(), f.pool);
    return append(seq, b);
  });
  in_put.wait();  // the eviction is inside its put
  std::promise<std::size_t> done;
  auto flushing = std::async(std::launch::async, [&] {
    f.cache.async_flush([&](ghostlink::error_code ec) { done.set_value(ec ? 0 : store->stats().entries); });
  });
  store->release_put();
  // a's four entries: three the flush put, and the evicted one, whose put
  // returned before the flush completed.
  CHECK(done.get_future().get() == 4);
  CHECK(evicting.get() == ghostlink::error_code());
  flushing.get();
  CHECK(f.cache.stats().evicted_blocks == 1);
  CHECK(w.puts() == 4);
  CHECK(store->most_puts_of_a_hash() == 1);
}

TEST_CASE("a restarted process attaches from a file store every block that a flushed one computed") {
  namespace sw = ghostlink::test::store_writer;
  temp_dir dir;
  REQUIRE(run_to_end(writer_program(), dir.path.string()) == 0);
  asio::thread_pool io(2), threads(2);
  auto store = std::make_shared<kv_file_store>(dir.path, kv_file_store_limits{.io_executor = io.get_executor()});
  const std::size_t entries = sw::length / sw::config().block_tokens;
  CHECK(store->stats().entries == entries);
  {
    kv_block_pool pool = kv_block_pool::for_caches<float>(sw::config(), {.max_blocks = 4096});
    kv_prefix_cache cache(sw::layers, sw::config(), pool,
                          {.model = "restart", .store = store, .store_policy = kv_store_policy::write_back});
    const std::vector<token_id> ids = sw::tokens(0);
    attach_waiter done;
    cache.async_attach(threads.get_executor(), ids, {}, done.handler());
    auto [ec, seq] = done.get();
    CHECK(ec == ghostlink::error_code());
    CHECK(cache.stats().store_hit_tokens == sw::length);
    sequence_kv_cache expected(threads, sw::layers, sw::config(), pool);
    sw::fill(expected, ids);
    CHECK(same_kv(seq, expected) == "");
    // What came from the store is not written back by this process's shutdown.
    CHECK(flush(cache) == ghostlink::error_code());
    CHECK(cache.stats().store_puts == 0);
  }
  store->flush();
  io.join();
  threads.join();
}

}  // namespace prefix_write_back_tests
