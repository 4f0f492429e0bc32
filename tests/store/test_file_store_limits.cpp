// The file store's limits (block_store.hpp, kv_file_store): its byte budget
// under bursts of puts from several threads on several I/O threads, the cap
// on the values it reads (a file larger is a miss, never read), the
// permission bits of what it creates (and of async_save's files, in
// test_persist), a directory others can write, and the last error.
#include "common/asio_compat.hpp"
#include "common/files.hpp"
#include "common/store_values.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ghostlink/block_store.hpp>

#include "testing/hooks.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <future>
#include <latch>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace file_store_limits_tests {

using namespace ghostlink;
namespace fs = std::filesystem;
using ghostlink::test::temp_dir;
using ghostlink::test::write_file;

namespace {

kv_block_hash hash_of(std::size_t i) {
  kv_block_hash h;
  for (std::size_t b = 0; b < 8; ++b) h.bytes[b] = static_cast<std::uint8_t>((i + 1) >> (8 * b));
  h.bytes[31] = 0xa5;
  return h;
}

std::shared_ptr<test::bytes_value> value_of(std::size_t i, std::size_t bytes) {
  return std::make_shared<test::bytes_value>(hash_of(i), std::vector<std::byte>(bytes, std::byte{7}));
}

/// The entry files (*.kvb) in `dir`: their count and bytes together.
std::pair<std::size_t, std::uint64_t> entry_files(const fs::path& dir) {
  std::size_t files = 0;
  std::uint64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".kvb") {
      ++files;
      bytes += e.file_size();
    }
  return {files, bytes};
}

/// What the reservation hook saw.
std::atomic<std::uint64_t> reservations{0}, over_budget{0};
void check_reservation(std::uint64_t used, std::uint64_t budget) {
  reservations.fetch_add(1, std::memory_order_relaxed);
  if (used > budget) over_budget.fetch_add(1, std::memory_order_relaxed);
}

/// check_reservation() as the file stores' reservation hook while it lives.
struct reservation_watch {
  reservation_watch() { detail::set_file_store_reserved_hook(&check_reservation); }
  reservation_watch(const reservation_watch&) = delete;
  reservation_watch& operator=(const reservation_watch&) = delete;
  ~reservation_watch() { detail::set_file_store_reserved_hook(nullptr); }
};

/// The permission bits of `p`.
unsigned mode_of(const fs::path& p) {
  struct stat st {};
  REQUIRE(::stat(p.c_str(), &st) == 0);
  return static_cast<unsigned>(st.st_mode) & 07777u;
}

/// umask(0) for its lifetime, the old mask back after. The umask is the
/// process's: held only around the few calls that create files.
struct permissive_umask {
  permissive_umask() : old(::umask(0)) {}
  permissive_umask(const permissive_umask&) = delete;
  permissive_umask& operator=(const permissive_umask&) = delete;
  ~permissive_umask() { ::umask(old); }
  ::mode_t old;
};

/// The process's peak resident set (VmHWM), in KiB.
std::uint64_t peak_rss_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  for (int i = 0; i < 100 && std::getline(status, line); ++i)
    if (line.starts_with("VmHWM:")) return std::stoull(line.substr(6));
  return 0;
}

/// Makes `p` a sparse file of `bytes` bytes (no disk used).
void make_sparse(const fs::path& p, std::uint64_t bytes) {
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);  // NOLINT(*-vararg)
  REQUIRE(fd >= 0);
  CHECK(::ftruncate(fd, static_cast<off_t>(bytes)) == 0);
  ::close(fd);
}

/// Fetches `hashes` from `store`, waiting for every answer: their sizes
/// (0 for a miss).
std::vector<std::size_t> fetch_sizes(kv_file_store& store, std::vector<kv_block_hash> hashes) {
  std::mutex mutex;
  std::vector<std::size_t> sizes(hashes.size());
  std::latch answered(static_cast<std::ptrdiff_t>(hashes.size()));
  store.fetch(std::move(hashes), [&](std::size_t i, const std::vector<std::byte>& bytes) {
    {
      std::lock_guard lock(mutex);
      sizes[i] = bytes.size();
    }
    answered.count_down();
    return true;
  });
  answered.wait();
  std::lock_guard lock(mutex);
  return sizes;
}

constexpr std::size_t entry = 1000;  // every value's bytes

}  // namespace

TEST_CASE("a burst of puts on 2 threads never takes the store past its budget") {
  const reservation_watch watch;
  for (const std::size_t budget_entries : {0u, 1u, 2u, 7u}) {
    CAPTURE(budget_entries);
    const std::uint64_t budget = budget_entries * entry;
    reservations = 0;
    over_budget = 0;
    temp_dir dir;
    asio::thread_pool io(4);
    {
      kv_file_store store(dir.path / "store", {.max_bytes = budget, .io_executor = io.get_executor()});
      // 2 threads put 40 values each at once, of 24 hashes (some rewritten).
      constexpr std::size_t per_thread = 40;
      std::latch start(2);
      std::vector<std::thread> putters;
      for (std::size_t t = 0; t < 2; ++t)
        putters.emplace_back([&, t] {
          start.arrive_and_wait();
          for (std::size_t i = 0; i < per_thread; ++i) store.put(value_of((t * 7 + i) % 24, entry));
        });
      for (std::thread& p : putters) p.join();
      store.flush();
      const kv_store_stats s = store.stats();
      const auto [files, file_bytes] = entry_files(store.directory());
      CHECK(s.bytes <= budget);
      CHECK(file_bytes <= budget);
      CHECK(s.entries == files);
      CHECK(s.bytes == file_bytes);
      CHECK(s.puts == 2 * per_thread);
      CHECK(s.stored + s.dropped + s.write_errors == s.puts);
      CHECK(s.write_errors == 0);
      CHECK(s.pending_bytes == 0);
      CHECK(s.last_error == std::error_code());
      if (budget_entries == 0) {
        CHECK(s.stored == 0);
        CHECK(reservations == 0);
      } else {
        CHECK(s.stored >= 1);  // the first write to start always fits
        CHECK(s.entries >= 1);
        CHECK(reservations >= s.stored);
      }
      CHECK(over_budget == 0);  // at every reservation during the burst
    }
    io.join();
  }
}

TEST_CASE("a value file larger than the cap is a miss, never read, and not counted as an entry") {
  temp_dir dir;
  asio::thread_pool io(2);
  {
    const fs::path where = dir.path / "store";
    fs::create_directory(where);
    const auto file_of = [&](std::size_t i) { return where / (hash_of(i).hex() + ".kvb"); };
    write_file(file_of(0), std::vector<std::byte>(entry, std::byte{1}));
    constexpr std::uint64_t gib = std::uint64_t{1} << 30;
    make_sparse(file_of(1), gib);  // within max_bytes (1 GiB): only the cap keeps it out
    const std::uint64_t peak_before = peak_rss_kib();
    kv_file_store store(where, {.max_value_bytes = entry, .io_executor = io.get_executor()});
    CHECK(store.path_of(hash_of(1)) == file_of(1));
    kv_store_stats s = store.stats();
    CHECK(s.entries == 1);
    CHECK(s.bytes == entry);
    CHECK(s.oversized == 1);
    make_sparse(file_of(2), gib);  // one found after the store was made
    const auto before = std::chrono::system_clock::now();
    CHECK(fetch_sizes(store, {hash_of(0), hash_of(1), hash_of(2)}) == std::vector<std::size_t>{entry, 0, 0});
    s = store.stats();
    CHECK(s.hits == 1);
    CHECK(s.oversized == 3);
    CHECK(s.entries == 1);
    CHECK(s.bytes == entry);
    CHECK(s.last_error == std::make_error_code(std::errc::file_too_large));
    CHECK(s.last_error_time >= before);
    CHECK(fs::file_size(file_of(1)) == gib);  // not deleted: not the store's
    CHECK(fs::file_size(file_of(2)) == gib);
    CHECK(peak_rss_kib() < peak_before + (std::uint64_t{256} << 10));  // nothing near 1 GiB was read
    // A put larger than the cap is dropped: it could never be read.
    store.put(value_of(3, entry + 1));
    store.flush();
    CHECK(store.stats().dropped == 1);
    CHECK_FALSE(fs::exists(file_of(3)));
  }
  io.join();
}

TEST_CASE("limit_value_size takes larger entries out of the index, keeping their files; the largest cap holds") {
  temp_dir dir;
  asio::thread_pool io(2);
  {
    kv_file_store store(dir.path, {.io_executor = io.get_executor()});
    store.put(value_of(0, entry));
    store.put(value_of(1, 2 * entry));
    store.flush();
    CHECK(store.stats().entries == 2);
    store.limit_value_size(entry);
    kv_store_stats s = store.stats();
    CHECK(s.entries == 1);
    CHECK(s.bytes == entry);
    CHECK(s.oversized == 1);
    CHECK(fs::file_size(store.path_of(hash_of(1))) == 2 * entry);  // kept for whoever shares the directory
    CHECK(fetch_sizes(store, {hash_of(0), hash_of(1)}) == std::vector<std::size_t>{entry, 0});
    store.limit_value_size(entry / 2);  // a smaller cap: the larger one holds
    CHECK(fetch_sizes(store, {hash_of(0)}) == std::vector<std::size_t>{entry});
    CHECK(store.stats().entries == 1);
    store.limit_value_size(2 * entry);  // a larger one: the file reads again, and counts again
    CHECK(fetch_sizes(store, {hash_of(1)}) == std::vector<std::size_t>{2 * entry});
    s = store.stats();
    CHECK(s.entries == 2);
    CHECK(s.bytes == 3 * entry);
    CHECK(s.oversized == 2);
  }
  io.join();
}

TEST_CASE("the store's files and directories are private whatever the umask; file_mode shares them") {
  temp_dir dir;
  asio::thread_pool io(2);
  const auto store_in = [&](const fs::path& where, kv_file_store_limits limits) {
    limits.io_executor = io.get_executor();
    const permissive_umask wide_open;
    kv_file_store store(where, std::move(limits));
    store.put(value_of(0, entry));
    store.flush();
    CHECK(store.stats().stored == 1);
    return std::pair{store.stats().directory_writable_by_others, mode_of(store.path_of(hash_of(0)))};
  };
  SECTION("by default: 0600 files, 0700 directories (the missing parents too)") {
    const auto [warned, file_mode] = store_in(dir.path / "a" / "b", {});
    CHECK(file_mode == 0600u);
    CHECK(mode_of(dir.path / "a") == 0700u);
    CHECK(mode_of(dir.path / "a" / "b") == 0700u);
    CHECK_FALSE(warned);
  }
  SECTION("file_mode 0640: 0640 files, a 0750 directory") {
    const fs::perms shared = fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read;
    const auto [warned, file_mode] = store_in(dir.path / "s", {.file_mode = shared});
    CHECK(file_mode == 0640u);
    CHECK(mode_of(dir.path / "s") == 0750u);
    CHECK_FALSE(warned);
  }
  SECTION("an existing 0777 directory is warned of, and left as it is; a 0700 one is not") {
    fs::create_directory(dir.path / "open");
    fs::permissions(dir.path / "open", fs::perms::all);
    fs::create_directory(dir.path / "closed");
    fs::permissions(dir.path / "closed", fs::perms::owner_all);
    CHECK(store_in(dir.path / "open", {}).first);
    CHECK(mode_of(dir.path / "open") == 0777u);
    CHECK_FALSE(store_in(dir.path / "closed", {}).first);
    CHECK(mode_of(dir.path / "closed") == 0700u);
  }
  io.join();
}

TEST_CASE("a write error and a read error are the store's last error, with their time") {
  temp_dir dir;
  asio::thread_pool io(2);
  {
    kv_file_store store(dir.path, {.io_executor = io.get_executor()});
    CHECK(store.stats().last_error == std::error_code());
    CHECK(store.stats().last_error_time == std::chrono::system_clock::time_point());
    // A directory where the entry's file goes: its rename fails.
    fs::create_directory(store.path_of(hash_of(0)));
    const auto before = std::chrono::system_clock::now();
    store.put(value_of(0, entry));
    store.flush();
    kv_store_stats s = store.stats();
    CHECK(s.write_errors == 1);
    CHECK(s.last_error == std::make_error_code(std::errc::is_a_directory));
    CHECK(s.last_error_time >= before);
    CHECK(s.last_error_time <= std::chrono::system_clock::now());
    // A FIFO where an entry's file goes: the lookup refuses it (EINVAL).
    REQUIRE(::mkfifo(store.path_of(hash_of(1)).c_str(), 0600) == 0);
    CHECK(fetch_sizes(store, {hash_of(1), hash_of(2)}) == std::vector<std::size_t>{0, 0});
    s = store.stats();
    CHECK(s.last_error == std::make_error_code(std::errc::invalid_argument));  // a missing file is no error
    CHECK(s.hits == 0);
  }
  io.join();
}

}  // namespace file_store_limits_tests

namespace file_store_limits_tests {

TEST_CASE("when_flushed calls back once the puts queued before it settle; an idle store calls back at once") {
  temp_dir dir;
  asio::thread_pool io(2);
  kv_file_store store(dir.path, {.max_bytes = 1 << 20, .io_executor = io.get_executor()});

  // Idle: inside the call.
  bool called = false;
  store.when_flushed([&] { called = true; });
  CHECK(called);

  // Puts from 2 threads, then a wait for them; the puts made after it do
  // not count towards it (they may or may not have settled when it runs).
  constexpr std::size_t per_thread = 32;
  {
    std::vector<std::thread> putters;
    for (std::size_t t = 0; t < 2; ++t)
      putters.emplace_back([&, t] {
        for (std::size_t i = 0; i < per_thread; ++i) store.put(value_of(t * per_thread + i, 512));
      });
    for (std::thread& p : putters) p.join();
  }
  std::promise<kv_store_stats> seen;
  std::atomic<int> calls{0};
  store.when_flushed([&] {
    if (calls.fetch_add(1) == 0) seen.set_value(store.stats());
  });
  for (std::size_t i = 0; i < per_thread; ++i) store.put(value_of(1000 + i, 512));
  const kv_store_stats at_flush = seen.get_future().get();
  CHECK(at_flush.stored + at_flush.dropped + at_flush.write_errors >= 2 * per_thread);
  CHECK(at_flush.stored >= 2 * per_thread);
  store.flush();
  CHECK(calls.load() == 1);
  io.join();
}

TEST_CASE("the file store tells a receipt stored once renamed, removed when evicted or replaced; FILE") {
  temp_dir dir;
  asio::thread_pool io(2);
  const auto log = std::make_shared<test::receipt_log>();
  const auto put = [&](kv_file_store& store, std::size_t i, const char* name) {
    store.put(std::make_shared<test::bytes_value>(hash_of(i), std::vector<std::byte>(entry, std::byte{7}),
                                                  std::make_shared<test::logging_receipt>(log, name)));
    store.flush();
  };
  {
    kv_file_store store(dir.path, {.max_bytes = 3 * entry, .io_executor = io.get_executor()});
    CHECK(store.medium() == "FILE");
    put(store, 0, "a");
    put(store, 1, "b");
    CHECK(log->get() == std::vector<std::string>{"stored a", "stored b"});
    put(store, 0, "a2");  // replaces a: its stored first, then a's removed
    CHECK(log->get() == std::vector<std::string>{"stored a", "stored b", "stored a2", "removed a"});
    put(store, 2, "c");
    put(store, 3, "d");  // over the budget: b, the least recently used, goes first
    CHECK(log->get() == std::vector<std::string>{"stored a", "stored b", "stored a2", "removed a", "stored c",
                                                 "removed b", "stored d"});
    // A value too large for the budget is dropped: its receipt is told nothing.
    store.put(std::make_shared<test::bytes_value>(hash_of(4), std::vector<std::byte>(4 * entry, std::byte{7}),
                                                  std::make_shared<test::logging_receipt>(log, "e")));
    store.flush();
    CHECK(log->get().size() == 7);
    CHECK(store.stats().dropped == 1);
  }
  io.join();
}

}  // namespace file_store_limits_tests
