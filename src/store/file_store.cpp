// kv_file_store: one file per entry in one directory, under a byte budget.
//
// State (file_store_state, shared with every queued job so that the jobs
// outlive the handle): the index of the entries this process knows of, with
// their sizes and eviction order, the counters, and the puts in flight; all
// under mutex_. The files themselves are the truth for lookups: a lookup
// reads the file whether or not the index knows it, so a file another
// process wrote is found, and an index entry whose file is gone is a miss.
//
// The budget: see file_store_state's bytes_ and make_room(). A write
// reserves its room when its job starts; its temporary file is written,
// then renamed over the entry's name and indexed under mutex_ (so an
// eviction, which unlinks under mutex_, never unlinks a file it does not
// index); its reservation becomes indexed bytes in that same hold, or is
// released when it fails. A lookup that reads a file this process did not
// know of indexes it if it fits the same way.

#include <signal.h>  // NOLINT(modernize-deprecated-headers): POSIX kill
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>
#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/block_store.hpp"
#include "ghostlink/detail/io_op.hpp"
#include "io/file.hpp"
#include "store/counting.hpp"
#include "store/hooks.hpp"
#include "store/pending_puts.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

constexpr std::string_view entry_suffix = ".kvb";

/// The hash a file name `<64 hex digits>.kvb` names, if it is one.
bool parse_entry_name(const std::string& name, kv_block_hash& out) {
  if (name.size() != 64 + entry_suffix.size() || !name.ends_with(entry_suffix)) return false;
  for (std::size_t i = 0; i < 32; ++i) {
    unsigned v = 0;
    const auto [end, ec] = std::from_chars(name.data() + 2 * i, name.data() + 2 * i + 2, v, 16);
    if (ec != std::errc() || end != name.data() + 2 * i + 2) return false;
    out.bytes[i] = static_cast<std::uint8_t>(v);
  }
  return out.hex() + std::string(entry_suffix) == name;  // lowercase only
}

/// Whether `name` is a temporary file of replacement_file whose process is
/// gone (".<target>.tmp.<pid>.<n>").
bool is_orphaned_temporary(const std::string& name) {
  const std::size_t at = name.find(".tmp.");
  if (name.empty() || name[0] != '.' || at == std::string::npos) return false;
  long pid = 0;
  const char* first = name.data() + at + 5;
  const auto [end, ec] = std::from_chars(first, name.data() + name.size(), pid);
  if (ec != std::errc() || end == first || pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

}  // namespace

class file_store_state : public std::enable_shared_from_this<file_store_state> {
 public:
  file_store_state(std::filesystem::path directory, kv_file_store_limits limits)
      : directory_(std::move(directory)), limits_(std::move(limits)), io_(io_pool_executor(limits_.io_executor)) {
    if (limits_.max_value_bytes) cap_.raise(*limits_.max_value_bytes);
    if (error_code ec = make_directories(directory_, directory_mode(limits_.file_mode)))
      throw std::system_error(std::error_code(ec), "ghostlink: kv_file_store directory " + directory_.string());
    struct stat st {};
    // Group or others may write it, sticky or not: even where they cannot
    // replace our files they can add entries and fill the disk.
    if (::stat(directory_.c_str(), &st) == 0)
      stats_.directory_writable_by_others = (st.st_mode & (S_IWGRP | S_IWOTH)) != 0;
    std::vector<std::pair<std::filesystem::file_time_type, kv_block_hash>> found;
    for (const std::filesystem::directory_entry& f : std::filesystem::directory_iterator(directory_)) {
      const std::string name = f.path().filename().string();
      std::error_code ec;
      if (is_orphaned_temporary(name)) {
        std::filesystem::remove(f.path(), ec);
        continue;
      }
      kv_block_hash h;
      if (!f.is_regular_file(ec) || !parse_entry_name(name, h)) continue;
      const std::uintmax_t bytes = f.file_size(ec);
      if (ec) continue;
      if (bytes > value_cap()) {  // not an entry: left alone, not indexed
        ++stats_.oversized;
        continue;
      }
      const auto modified = f.last_write_time(ec);
      if (ec) continue;
      entries_[h].bytes = bytes;
      bytes_ += bytes;
      found.emplace_back(modified, h);
    }
    std::sort(found.begin(), found.end());
    for (const auto& [time, h] : found) touch(h);
    evict_until(0);
  }

  const std::filesystem::path& directory() const noexcept { return directory_; }
  std::filesystem::path path_of(const kv_block_hash& h) const {
    return directory_ / (h.hex() + std::string(entry_suffix));
  }

  void put(std::shared_ptr<const kv_store_value> value) noexcept {
    const std::size_t size = value->size();
    std::uint64_t ticket = 0;
    try {
      std::lock_guard lock(mutex_);
      ++stats_.puts;
      if (size > limits_.max_bytes || size > value_cap() || pending_bytes_ + size > limits_.max_pending_bytes) {
        ++stats_.dropped;
        return;
      }
      ticket = puts_.add();
      pending_bytes_ += size;
    } catch (...) {  // memory refused
      std::lock_guard lock(mutex_);
      count_write_error(kv_errc::capacity_exhausted);
      return;
    }
    try {
      asio::post(io_, [self = shared_from_this(), value = std::move(value), ticket]() mutable {
        self->write(std::move(value), ticket);
      });
    } catch (...) {  // memory refused, or the executor's own failure: not stored
      finish_put(ticket, size, kv_errc::capacity_exhausted, false);
    }
  }

  void fetch(std::vector<kv_block_hash> hashes, const kv_block_store::fetch_handler& on_value) {
    auto request = std::make_shared<fetch_request>(std::move(hashes), on_value);
    {
      std::lock_guard lock(mutex_);
      stats_.lookups += request->hashes.size();
    }
    std::size_t i = 0;
    try {
      for (; i < request->hashes.size(); ++i)
        asio::post(io_, [self = shared_from_this(), request, i] { self->read(*request, i); });
    } catch (...) {  // memory refused part way: the rest are misses
      for (; i < request->hashes.size() && !request->stopped.load(std::memory_order_acquire); ++i)
        if (!request->on_value(i, {})) request->stopped.store(true, std::memory_order_release);
    }
  }

  kv_store_stats stats() const noexcept {
    std::lock_guard lock(mutex_);
    kv_store_stats s = stats_;
    s.entries = entries_.size();
    s.bytes = bytes_;
    s.pending_bytes = pending_bytes_;
    return s;
  }

  void flush() { wait_settled(mutex_, idle_, puts_); }
  void when_flushed(std::function<void()> done) { call_when_settled(mutex_, puts_, std::move(done)); }

  /// The cap rises to `bytes` (the largest call holds); indexed entries
  /// above it leave the index, their files kept: another process, of
  /// another geometry, may share the directory and read them.
  void limit_value_size(std::size_t bytes) noexcept {
    std::lock_guard lock(mutex_);
    cap_.raise(bytes);
    for (auto it = entries_.begin(); it != entries_.end();) {
      const kv_block_hash h = it->first;
      const std::uint64_t bytes = (it++)->second.bytes;  // forget() erases it
      if (bytes <= value_cap()) continue;
      forget(h);
      ++stats_.oversized;
    }
  }

 private:
  struct indexed {
    std::uint64_t bytes = 0;
    std::uint64_t tick = 0;
    std::shared_ptr<kv_store_receipt> receipt;  // its putter's, told removed() when the file goes
  };
  struct fetch_request {
    fetch_request(std::vector<kv_block_hash> h, kv_block_store::fetch_handler f)
        : hashes(std::move(h)), on_value(std::move(f)) {}
    std::vector<kv_block_hash> hashes;
    kv_block_store::fetch_handler on_value;
    std::atomic<bool> stopped{false};
  };

  /// The largest value read or written: the cap, if any.
  std::uint64_t value_cap() const noexcept { return cap_.get(); }

  /// Makes `h` the most recently used (under mutex_).
  void touch(const kv_block_hash& h) {
    indexed& e = entries_[h];
    if (e.tick != 0) lru_.erase({e.tick, h});
    e.tick = ++clock_;
    lru_.emplace(e.tick, h);
  }

  /// Drops `h` from the index (under mutex_); returns its receipt (null
  /// if none, or not there).
  std::shared_ptr<kv_store_receipt> forget(const kv_block_hash& h) {
    auto it = entries_.find(h);
    if (it == entries_.end()) return nullptr;
    bytes_ -= it->second.bytes;
    lru_.erase({it->second.tick, h});
    std::shared_ptr<kv_store_receipt> r = std::move(it->second.receipt);
    entries_.erase(it);
    return r;
  }

  /// Evicts the least recently used entries, their files unlinked, until
  /// `incoming` more bytes fit the budget beside those indexed and those
  /// reserved, or none is left to evict (under mutex_). An entry being
  /// rewritten is skipped: its write replaces it.
  void evict_until(std::uint64_t incoming) {
    auto it = lru_.begin();
    while (it != lru_.end() && bytes_ + bytes_in_flight_ + incoming > limits_.max_bytes) {
      const kv_block_hash h = (it++)->second;
      if (writing_.contains(h)) continue;
      const std::shared_ptr<kv_store_receipt> r = forget(h);
      (void)::unlink(path_of(h).c_str());
      if (r) r->removed();  // under mutex_: after its stored(), before any later put's
      ++stats_.evictions;
    }
  }

  /// The budget's one gate (under mutex_): whether `size` more bytes fit
  /// beside those indexed and those reserved, once every entry it may
  /// evict is gone; if so, evicts until they do (and nothing otherwise).
  /// The caller then reserves or indexes them in the same hold.
  bool make_room(std::uint64_t size) {
    std::uint64_t kept = bytes_in_flight_ + size;  // what no eviction frees
    for (const auto& [h, n] : writing_)
      if (auto e = entries_.find(h); e != entries_.end()) kept += e->second.bytes;
    if (kept > limits_.max_bytes) return false;
    evict_until(size);
    return true;
  }

  /// The bytes of the budget now used, for the test hook (under mutex_).
  void observe_budget() const noexcept {
    if (auto* hook = file_store_reserved_hook.load(std::memory_order_relaxed))
      hook(bytes_ + bytes_in_flight_, limits_.max_bytes);  // tests only
  }

  /// Reserves `size` bytes for a write of `h` (under mutex_); false, with
  /// nothing reserved or evicted, if they cannot fit.
  bool reserve(const kv_block_hash& h, std::uint64_t size) {
    if (!make_room(size)) return false;
    ++writing_[h];
    bytes_in_flight_ += size;
    observe_budget();
    return true;
  }

  /// A write's reservation and mark given back (under mutex_).
  void release(const kv_block_hash& h, std::uint64_t size) noexcept {
    bytes_in_flight_ -= size;
    if (auto w = writing_.find(h); w != writing_.end() && --w->second == 0) writing_.erase(w);
  }

  /// Indexes the file of `h`, `size` bytes, as the most recently used
  /// (under mutex_), in place of any entry of `h` indexed before: a
  /// write's, whose `receipt` is told stored() (then the replaced one's
  /// removed()), or a file a lookup found (no receipt).
  void index(const kv_block_hash& h, std::uint64_t size, std::shared_ptr<kv_store_receipt> receipt = nullptr) {
    const std::shared_ptr<kv_store_receipt> replaced = forget(h);
    touch(h);
    indexed& e = entries_[h];
    e.bytes = size;
    bytes_ += size;
    if (receipt) receipt->stored();
    e.receipt = std::move(receipt);
    if (replaced) replaced->removed();
  }

  /// Every error met (a write's, a read's, a value refused) is recorded
  /// here, with its time (under mutex_).
  void note_error(const error_code& ec) noexcept { record_error(stats_, std::error_code(ec)); }
  void count_write_error(const error_code& ec) noexcept {
    ++stats_.write_errors;
    note_error(ec);
  }

  void write(std::shared_ptr<const kv_store_value> value, std::uint64_t ticket) noexcept {
    const std::size_t size = value->size();
    const kv_block_hash h = value->hash();
    error_code ec;
    bool fits = true;
    bool holding = false;
    replacement_file file;
    try {
      {
        std::lock_guard lock(mutex_);
        holding = fits = reserve(h, size);
      }
      if (fits) {
        std::vector<std::byte> bytes(size);
        value->encode(bytes);
        ec = file.create(path_of(h), 0, limits_.file_mode);
        if (!ec) ec = write_at(file.file(), 0, bytes);
        if (!ec && limits_.durable) ec = file.sync();
        if (!ec) {
          // The rename and the indexing under one hold of the lock: an
          // eviction sees the file indexed or not yet there.
          std::lock_guard lock(mutex_);
          ec = file.rename();
          if (!ec) {
            index(h, size, value->receipt());
            release(h, size);  // in the same hold: never counted twice
            holding = false;
          }
        }
      }
    } catch (...) {  // memory refused: not stored
      ec = kv_errc::capacity_exhausted;
    }
    if (holding) {
      std::lock_guard lock(mutex_);
      release(h, size);
    }
    if (fits && !ec && limits_.durable) ec = file.sync_directory();  // renamed, but not known to be on disk
    value.reset();  // its blocks back to the pool before flush() may return
    finish_put(ticket, size, ec, !fits);
  }

  void finish_put(pending_puts::ticket ticket, std::size_t size, const error_code& ec, bool dropped) noexcept {
    pending_puts::ready_list ready;
    {
      std::lock_guard lock(mutex_);
      if (dropped)
        ++stats_.dropped;
      else if (ec)
        count_write_error(ec);
      else
        ++stats_.stored;
      pending_bytes_ -= size;
      puts_.settle(ticket, ready);
      idle_.notify_all();
    }
    run_ready(ready);
  }

  /// Counts a lookup's outcome (taking mutex_): a value over the cap, an
  /// error, or a hit of `hit_bytes`, which a file another process wrote
  /// turns into an entry if it fits.
  void count_read(const kv_block_hash& h, std::size_t hit_bytes, const error_code& ec, bool oversized) noexcept {
    if (!oversized && !ec && hit_bytes == 0) return;  // a plain miss: nothing to count
    try {
      std::lock_guard lock(mutex_);
      if (oversized) {
        ++stats_.oversized;
        note_error(errno_code(EFBIG));
      }
      if (ec) note_error(ec);
      if (hit_bytes == 0) return;
      ++stats_.hits;
      if (entries_.contains(h)) {
        touch(h);
      } else if (make_room(hit_bytes)) {  // written by another process: it counts now, if it fits
        index(h, hit_bytes);
        observe_budget();
      }
    } catch (...) {  // memory refused while indexing: the bytes are still an answer
    }
  }

  void read(fetch_request& request, std::size_t i) noexcept {
    if (request.stopped.load(std::memory_order_acquire)) return;
    std::vector<std::byte> bytes;
    error_code ec;
    bool oversized = false;
    const kv_block_hash& h = request.hashes[i];
    try {
      file_descriptor file;
      std::uint64_t file_bytes = 0;
      ec = open_for_reading(path_of(h), file, file_bytes);
      if (ec == errno_code(ENOENT)) {
        ec = {};  // a miss, no error
      } else if (!ec && file_bytes > value_cap()) {
        oversized = true;  // never read: its size is the file's, from fstat
      } else if (!ec && file_bytes <= limits_.max_bytes) {
        bytes.resize(file_bytes);  // at most the cap: a file grown since is read no further
        ec = read_at(file, 0, bytes);
        if (ec) bytes.clear();
      }
    } catch (...) {  // memory refused: a miss
      ec = kv_errc::capacity_exhausted;
      bytes.clear();
    }
    count_read(h, bytes.size(), ec, oversized);
    bool more = false;
    try {
      more = request.on_value(i, std::move(bytes));
    } catch (...) {
    }
    if (!more) request.stopped.store(true, std::memory_order_release);
  }

  const std::filesystem::path directory_;
  const kv_file_store_limits limits_;
  const asio::any_io_executor io_;
  value_size_cap cap_;  // the largest value read or written

  mutable std::mutex mutex_;
  std::condition_variable idle_;  // a put finished
  std::map<kv_block_hash, indexed> entries_;
  std::set<std::pair<std::uint64_t, kv_block_hash>> lru_;  // (tick, hash), least recent first
  std::uint64_t clock_ = 0;
  // The budget's invariant, whatever the puts and lookups in flight and the
  // I/O threads: bytes_ + bytes_in_flight_ <= limits_.max_bytes once the
  // constructor has listed the directory. Only make_room() lets either
  // grow (reserve() for a write, read() indexing a file found); a write's
  // reservation turns into indexed bytes, or is released, in one hold.
  std::uint64_t bytes_ = 0;            // bytes of the entries indexed
  std::uint64_t bytes_in_flight_ = 0;  // bytes reserved by the writes in progress
  std::map<kv_block_hash, std::size_t> writing_;  // writes in progress, by hash
  std::size_t pending_bytes_ = 0;
  pending_puts puts_;                // those not finished, and who waits for them
  kv_store_stats stats_;
};

}  // namespace detail

kv_file_store::kv_file_store(std::filesystem::path directory, kv_file_store_limits limits)
    : state_(std::make_shared<detail::file_store_state>(std::move(directory), std::move(limits))) {}

kv_file_store::~kv_file_store() = default;

void kv_file_store::put(std::shared_ptr<const kv_store_value> value) noexcept {
  if (value) state_->put(std::move(value));
}
void kv_file_store::fetch(std::vector<kv_block_hash> hashes, fetch_handler on_value) {
  state_->fetch(std::move(hashes), on_value);
}
kv_store_stats kv_file_store::stats() const noexcept { return state_->stats(); }
const std::filesystem::path& kv_file_store::directory() const noexcept { return state_->directory(); }
std::filesystem::path kv_file_store::path_of(const kv_block_hash& hash) const { return state_->path_of(hash); }
void kv_file_store::flush() { state_->flush(); }
void kv_file_store::when_flushed(std::function<void()> done) { state_->when_flushed(std::move(done)); }
void kv_file_store::limit_value_size(std::size_t bytes) noexcept { state_->limit_value_size(bytes); }

GHOSTLINK_NAMESPACE_END
