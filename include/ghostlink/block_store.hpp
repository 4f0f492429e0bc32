#pragma once
/// @file
/// Tiers below a prefix cache's RAM: the block-store interface
/// (`kv_block_store`) that a prefix cache writes its entries to and fetches
/// them back from, the entries it stores (`kv_store_value`), and the file
/// store (`kv_file_store`), a directory on local disk under a byte budget.
///
/// A prefix cache uses a store only when its `kv_prefix_options::store` is
/// set: the default is RAM only. What a store holds is one value per block
/// hash: a header (the hash, the geometry, the element type, checksums)
/// and the keys and values of that block in every layer (docs/FORMAT.md,
/// "Block entries"). The prefix cache encodes and verifies values; a store
/// only keeps bytes under a hash. So a store never needs to be trusted to
/// return the right bytes: a value that is missing, truncated, corrupt,
/// of another hash, model or geometry, or late, is a miss, never data.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/block_hash.hpp"
#include "ghostlink/stats.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// What the putter of a value learns of it from a store that can tell:
/// when the value is stored, and when the store lets it go. A prefix cache
/// gives its values one, to report its store's entries as a tier of their
/// own (`kv_prefix_event::tier`, and so on the wire, `kv_event_publisher`).
///
/// A store calls them from any of its threads (possibly under its own
/// locks, never inside `put()` or `fetch()`), for each hash in the order
/// the changes happened; they are quick and never call the store.
class kv_store_receipt {
 public:
  kv_store_receipt() = default;
  kv_store_receipt(const kv_store_receipt&) = delete;
  kv_store_receipt& operator=(const kv_store_receipt&) = delete;
  virtual ~kv_store_receipt() = default;

  /// The value is stored: a `fetch()` of its hash finds it from now on
  /// (until `removed()`). At most once.
  virtual void stored() noexcept = 0;
  /// The store no longer holds the value `stored()` reported: evicted, or
  /// replaced by a later put of its hash (whose `stored()` came first). At
  /// most once, after `stored()`. A store that cannot tell (a shared
  /// server evicting on its own) never calls it: the putter then learns of
  /// the loss from a `fetch()` that misses.
  virtual void removed() noexcept = 0;
};

/// One entry as a prefix cache hands it to a store: its hash, and its bytes
/// encoded on demand. The prefix cache makes it; the store encodes it on its
/// own thread (a write-through value holds the entry's blocks until then,
/// so encoding it copies them out of the pool only once).
class kv_store_value {
 public:
  kv_store_value() = default;
  kv_store_value(const kv_store_value&) = delete;
  kv_store_value& operator=(const kv_store_value&) = delete;
  virtual ~kv_store_value() = default;

  /// The block hash it is stored under.
  virtual const kv_block_hash& hash() const noexcept = 0;
  /// Its encoded bytes in all.
  virtual std::size_t size() const noexcept = 0;
  /// Writes its encoded bytes to `out` (of exactly `size()` bytes). Safe
  /// from any thread, any number of times.
  virtual void encode(std::span<std::byte> out) const noexcept = 0;
  /// What the store tells of it (see `kv_store_receipt`), kept by a store
  /// that can tell until then, after it has let go of the value itself;
  /// null (the default): nothing to tell.
  virtual std::shared_ptr<kv_store_receipt> receipt() const noexcept { return nullptr; }
};

/// Where a prefix cache keeps entries beyond RAM: a map from block hashes to
/// bytes, written in the background and read pipelined. The interface the
/// file store (`kv_file_store`) implements, and any other tier: a store
/// needs no knowledge of the entries' format.
///
/// Thread safety: every member may be called from any thread, concurrently.
class kv_block_store {
 public:
  /// Receives one looked-up value: `index` into the hashes given to
  /// `fetch()`, and the bytes stored under it, empty for a miss or for any
  /// failure. Returns false when the values not yet delivered are no longer
  /// wanted (the store may then skip them).
  using fetch_handler = std::function<bool(std::size_t index, std::vector<std::byte> bytes)>;

  kv_block_store() = default;
  kv_block_store(const kv_block_store&) = delete;
  kv_block_store& operator=(const kv_block_store&) = delete;
  virtual ~kv_block_store() = default;

  /// Stores `value` under `value->hash()` in the background, replacing any
  /// value stored under it. Returns at once: no I/O on the caller's thread,
  /// which may be inside an actor's drain (a write-back on eviction). A
  /// value not stored (a limit, an error) is counted, never reported: the
  /// tier is a cache. A store that can tell calls the value's `receipt()`
  /// as `kv_store_receipt` says; one that cannot (the default of a store
  /// of the user's own) leaves its tier out of the prefix cache's events.
  virtual void put(std::shared_ptr<const kv_store_value> value) noexcept = 0;

  /// Looks up every hash of `hashes`, pipelined (all requests in flight at
  /// once, not one after another), and calls `on_value` once per index
  /// whose answer it has, in any order, from any thread (concurrently
  /// too), until one call returns false. A store that cannot answer in time
  /// answers with no bytes (so does one refused memory part way). Returns
  /// at once.
  /// @throws std::bad_alloc, having requested and called nothing.
  virtual void fetch(std::vector<kv_block_hash> hashes, fetch_handler on_value) = 0;

  /// The counters now.
  virtual kv_store_stats stats() const noexcept = 0;

  /// The tier's name as a router keys on it: the `medium` of its entries'
  /// KV events (`kv_event_publisher`). The file store's is "FILE", the
  /// Redis store's "REDIS"; the default "STORE".
  virtual std::string_view medium() const noexcept { return "STORE"; }

  /// Caps the values this store reads: a value stored larger than `bytes`
  /// is a miss, read or buffered no further than that (and a file store
  /// does not count such a file as an entry). A prefix cache calls it with
  /// the size of its entries (every entry of a geometry has one size) when
  /// it is made on the store; with several prefix caches on one store the
  /// largest call holds. Until called, no cap (the default does nothing:
  /// a store of the user's own may ignore it).
  virtual void limit_value_size(std::size_t bytes) noexcept { (void)bytes; }

  /// Calls `done` exactly once, when every `put()` that returned before this
  /// call has settled: its value stored (a `fetch()` from then on finds it),
  /// dropped or failed (counted in `stats()`), and let go of (a value that
  /// holds blocks has given them back to their pool). Puts made during or
  /// after the call may or may not be waited for. `done` runs on any thread:
  /// one of the store's, or inside this call when nothing is pending; it is
  /// quick and does not throw. A store destroyed first still calls it, once
  /// its queued puts are written or discarded: a prefix cache's
  /// `async_flush()` completes only through it.
  ///
  /// The default calls `done` at once, inside this call: right for a store
  /// whose `put()` has stored (or dropped) its value when it returns. A
  /// store that queues its puts overrides it, or `async_flush()` completes
  /// before the store has the entries.
  /// @throws std::bad_alloc, having kept nothing of `done`, which is then
  ///         never called.
  // NOLINTNEXTLINE(performance-unnecessary-value-param): the interface takes it by value, for overrides that keep it
  virtual void when_flushed(std::function<void()> done) { done(); }
};

/// The limits and I/O of a `kv_file_store`.
struct kv_file_store_limits {
  /// The bytes its files may take together: storing beyond evicts the
  /// least recently used files (written or read last) until the new one
  /// fits. The bytes indexed plus those reserved by writes in flight never
  /// pass it, whatever the puts and I/O threads at once: a write reserves
  /// its room when it starts, and one that cannot fit beside the writes in
  /// flight, even with every entry it may evict gone, is dropped, as is a
  /// value larger than the budget.
  std::uint64_t max_bytes = std::uint64_t{1} << 30;
  /// The bytes of puts waiting to be written, beyond which a put is
  /// dropped: what a slow disk may hold of the pool (a write-through value
  /// holds its blocks) and of memory (a write-back value is a copy). A
  /// dropped write-through entry is not offered again while RAM holds it:
  /// set this above the bytes of the longest prompt's entries (4096 tokens
  /// of 32 layers of 8 x 128 floats: 256 entries of 1 MiB).
  std::size_t max_pending_bytes = std::size_t{1} << 30;
  /// fsync every file before its rename, and the directory after: stored
  /// entries then survive a power loss. Without it (the default) a killed
  /// process still leaves whole files or none (the rename is atomic), and a
  /// file torn by a power loss fails its checksum: a miss.
  bool durable = false;
  /// The largest value read, as `kv_block_store::limit_value_size` sets
  /// it, known before the directory is listed (so a file larger is not
  /// counted at start either); none: until a prefix cache sets it.
  std::optional<std::size_t> max_value_bytes{};
  /// The permission bits of the files it creates (whatever the umask);
  /// the directory and each missing parent, if it makes them, get these
  /// plus the execute bit of each class that may read. Default: the owner
  /// only (0600 files, a 0700 directory). 0640, say, shares the cache with
  /// the file's group (a 0750 directory). An existing directory is left as
  /// it is (see `kv_store_stats::directory_writable_by_others`).
  std::filesystem::perms file_mode = std::filesystem::perms::owner_read | std::filesystem::perms::owner_write;
  /// Where the file I/O runs; none: ghostlink's private I/O pool (the one
  /// saves and loads use, two threads).
  std::optional<asio::any_io_executor> io_executor{};
};

namespace detail {
class file_store_state;
}

/// A block store in one directory of local disk: one file per entry, named
/// `<hash hex>.kvb`, written to a temporary name and renamed, under a byte
/// budget enforced by LRU eviction. Several processes may share the
/// directory for reading; each evicts only what it knows of (its own
/// writes, and the files found when it was made).
///
/// A value's receipt (`kv_store_receipt`) is told `stored()` when its file
/// is renamed into place, and `removed()` when this store evicts the file
/// or a later put of its hash replaces it; the store keeps it until then.
///
/// Costs: a put is queued (no I/O on the caller's thread); the file I/O runs
/// on the I/O executor, so lookups and writes of different entries overlap
/// on its threads. A value is encoded into one buffer and written with one
/// `pwrite`; a lookup reads one file with one `pread`.
class kv_file_store final : public kv_block_store {
 public:
  /// A store in `directory` (made if absent, with `file_mode` plus execute
  /// bits; an existing one others can write sets
  /// `kv_store_stats::directory_writable_by_others`: use a directory of
  /// your own). Lists the entries already there (from an earlier run; not
  /// those over `max_value_bytes`), the least recently modified first in
  /// the eviction order, evicting beyond the budget; removes temporary
  /// files that a killed process left. Blocks on that I/O.
  /// @throws std::system_error if the directory cannot be made or listed.
  explicit kv_file_store(std::filesystem::path directory, kv_file_store_limits limits = {});
  /// Puts still queued go on in the background; their I/O keeps what it
  /// needs alive.
  ~kv_file_store() override;

  void put(std::shared_ptr<const kv_store_value> value) noexcept override;
  void fetch(std::vector<kv_block_hash> hashes, fetch_handler on_value) override;
  kv_store_stats stats() const noexcept override;
  /// "FILE".
  std::string_view medium() const noexcept override { return "FILE"; }
  /// As `kv_block_store::limit_value_size`: the cap only rises (the largest
  /// call, or `max_value_bytes`, holds). Entries indexed that are larger
  /// leave the index (they count no longer, in `entries`, `bytes` or the
  /// budget; each counts once in `oversized`) but their files are kept:
  /// another process, of another geometry, may share the directory. A put
  /// larger than the cap is dropped.
  void limit_value_size(std::size_t bytes) noexcept override;

  /// The directory it stores in.
  const std::filesystem::path& directory() const noexcept;
  /// The file an entry is stored in, whether or not it exists.
  std::filesystem::path path_of(const kv_block_hash& hash) const;
  /// Blocks the calling thread until every put queued before the call is
  /// stored or dropped, and has let go of its value (a write-through
  /// value's blocks are back with their pool). Never call it from the I/O
  /// executor's threads.
  void flush();
  /// As `kv_block_store::when_flushed`: `done` runs on the I/O thread that
  /// settles the last put queued before the call (each having let go of
  /// its value), or inside this call if none is pending; puts queued later
  /// never delay it.
  void when_flushed(std::function<void()> done) override;

 private:
  std::shared_ptr<detail::file_store_state> state_;
};

GHOSTLINK_NAMESPACE_END
