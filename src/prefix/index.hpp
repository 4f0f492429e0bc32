#pragma once
// The prefix cache's index (src/prefix/index.cpp; its hashing in
// src/prefix/hash.cpp): entries by block hash, the blocks they hold,
// which entries are idle, and the eviction order. Every member is safe from
// any thread; all state below is under mutex_.
//
// Invariants (under mutex_):
// - entries_ is prefix-closed: an entry's parent (the previous block of the
//   same prefix) is cached while it is; `children` counts the cached
//   entries whose parent it is.
// - An entry holds one node per layer, or none (null) for a windowed layer
//   (rule_): `windowed_held` counts those of windowed layers; a full
//   layer's node is never null (so an insert revives missing ancestors
//   only where every layer is windowed). An entry holding no node (hollow:
//   every layer windowed, none held) has a child: the last child's
//   removal removes it.
// - nodes_ holds one node per distinct block some entry references, with
//   the entries that do; the block carries block::cached_bit exactly while
//   its node exists.
// - node.in_use is false exactly when the block's outside references are 0.
//   It turns true only here (an attach adds a reference to an idle block,
//   the only way anyone gets one), and false only in block_idle(), which
//   the release that leaves the block with its cached bit alone calls.
// - entry.in_use counts its nodes that are in use; an entry is idle at 0.
// - lru_ holds exactly the evictable entries (idle, no cached child),
//   ordered by (priority, tick) (order(): retention priority, then last
//   attached or inserted); `in_lru()` says which. Each
//   entry's set node is allocated with it and moves between lru_ and the
//   entry, so no eviction or release allocates.
// - window_lru_ holds exactly the entries whose windowed part is evictable
//   on its own (windowed_held > 0, w_in_use == 0: none of its windowed
//   nodes in use), ordered by (priority, wtick) (wtick: last inserted, or
//   attached with a window that read them); `in_window_lru()` says which,
//   with the same allocation-free moves.
// - An entry's priority changes only through set_priority(), which moves
//   it in both sets. expiry_ holds exactly the entries whose priority has a
//   duration (`expires()`: its deadline's node is in the set), ordered by
//   deadline; each deadline is due at most once: expire() takes it out and
//   gives the entry the deadline's `after` priority. An entry's deadline
//   and its set node are allocated together in the first phase of the
//   insert that first gives it a duration, and kept for its life.
// - idle_nodes_ counts nodes that are not in use; idle_entries_ entries at 0.
// - An entry is pinned when it is in use or has a pinned child (an idle
//   parent of an entry in use: two requests computed the same block, one
//   let go). A node is reclaimable when it is not in use and no entry holding
//   it is pinned (a windowed layer's node: no entry holding it has a
//   windowed node in use): evicting leaves and windowed parts frees it. reclaimable_ counts them;
//   it is what the pool's blocks_available() adds to the free budget.
// - The pool's kept() is nodes_.size(), idle_nodes_ and reclaimable_ as
//   publish_counts() last reported them (block_pool::set_kept), whenever
//   they change; zeros once the index is gone.
//
// Locks: the pool's reclaimer mutex, then mutex_ (evictions come from the
// allocation path through the pool, idle blocks from releases). Nothing
// here releases an outside block reference under mutex_: a release may
// call block_idle().

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "core/epoch.hpp"
#include "ghostlink/prefix_cache.hpp"
#include "memory/block.hpp"
#include "memory/block_pool.hpp"
#include "memory/reclaimer.hpp"
#include "prefix/receipt.hpp"
#include "prefix/retention.hpp"
#include "prefix/window_rule.hpp"
#include "store/entry.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

struct prefix_entry;

/// The evictable entries by (order(priority, tick), entry).
using lru_set = std::set<std::pair<std::uint64_t, prefix_entry*>>;
/// The entries whose priority has a duration, by (deadline, entry).
using expiry_set = std::set<std::pair<std::chrono::steady_clock::time_point, prefix_entry*>>;

/// When an entry's priority ends, apart from the entry: most entries never
/// have one, and the entry stays as small as it was without (the eviction
/// path touches every entry it removes).
struct entry_deadline {
  std::chrono::steady_clock::time_point at{};
  std::uint8_t after = kv_retention::default_value;  // the entry's priority once `at` has passed
  expiry_set::node_type node;                        // its place in expiry_ while out of it
};

/// The eviction order's key: the retention priority first, then the tick
/// (a 56-bit count of touches: 2^56 of them take centuries).
constexpr std::uint64_t order(std::uint8_t priority, std::uint64_t tick) noexcept {
  return std::uint64_t{priority} << 56 | tick;
}

/// One block some entries reference.
struct prefix_node {
  const block* blk = nullptr;
  bool windowed = false;                // a windowed layer's block
  bool in_use = true;                   // held outside the cache
  bool reclaimable = false;             // not in use, and every entry holding it unpinned
  std::vector<prefix_entry*> entries;   // usually one
};

/// One cached full block of a prefix, in every layer.
struct prefix_entry {
  kv_block_hash hash;
  prefix_entry* parent = nullptr;   // null for block 0
  std::size_t children = 0;         // cached entries whose parent this is
  std::uint64_t tick = 0;           // last attached or inserted
  std::size_t in_use = 0;           // nodes held outside the cache
  std::size_t pinned_children = 0;  // cached children that are pinned
  bool pinned = false;              // in use, or a pinned child: eviction cannot reach it now
  std::uint8_t priority = kv_retention::default_value;  // retention: the eviction order's first key
  bool in_store = false;            // fetched from the store or handed to it: nothing puts it again
  std::vector<prefix_node*> nodes;  // one per layer, null where a windowed layer holds none
  lru_set::node_type lru_node;      // its place in lru_ while out of it: moving in and out allocates nothing
  // A layout's windows (what an attach of a full layout never reads, last):
  std::uint64_t wtick = 0;          // its windowed part's: last inserted, or read by an attach's window
  std::size_t w_in_use = 0;         // windowed nodes held outside the cache
  std::size_t windowed_held = 0;    // non-null nodes of windowed layers
  lru_set::node_type window_node;   // its place in window_lru_, likewise
  std::unique_ptr<entry_deadline> deadline;  // allocated for the first duration it is given, kept
  std::unique_ptr<token_id[]> tokens;        // its block's block_tokens ids (null if its insert had none)
  /// Evictable: its node is in lru_.
  bool in_lru() const noexcept { return lru_node.empty(); }
  /// Its keys in lru_ and window_lru_.
  std::uint64_t lru_key() const noexcept { return order(priority, tick); }
  std::uint64_t window_key() const noexcept { return order(priority, wtick); }
  /// It holds no block (every layer windowed and dropped): only its children need it.
  bool hollow() const noexcept {
    return std::none_of(nodes.begin(), nodes.end(), [](const prefix_node* n) { return n != nullptr; });
  }
  /// Its priority has a duration that has not ended: its deadline's node is in expiry_.
  bool expires() const noexcept { return deadline && deadline->node.empty(); }
  /// Its windowed part is evictable: its node is in window_lru_.
  bool in_window_lru() const noexcept { return window_node.empty(); }
};

struct block_hash_hasher {
  std::size_t operator()(const kv_block_hash& h) const noexcept {
    std::size_t v = 0;
    for (std::size_t i = 0; i < sizeof v; ++i) v = (v << 8) | h.bytes[i];
    return v;  // SHA-256 bytes are uniform already
  }
};

/// The puts on their way to a store: each from the moment its entry is
/// marked in the store (or removed for a write-back) until its put() has
/// returned. A flush waits for the ones begun before it, never for later
/// ones, so a steady stream of write-backs cannot starve it; each put
/// returns at once, so the wait is short. Its lock is held only briefly,
/// never while another is taken.
class handoff_tracker {
 public:
  /// One handoff in progress, ended by its destruction; empty: none.
  class ticket {
   public:
    ticket() = default;
    ticket(ticket&& o) noexcept : tracker_(std::exchange(o.tracker_, nullptr)), parity_(o.parity_) {}
    ticket& operator=(ticket&& o) noexcept {
      std::swap(tracker_, o.tracker_);
      std::swap(parity_, o.parity_);
      return *this;
    }
    ~ticket() {
      if (tracker_) tracker_->end(parity_);
    }

   private:
    friend class handoff_tracker;
    ticket(handoff_tracker* t, std::size_t parity) noexcept : tracker_(t), parity_(parity) {}
    handoff_tracker* tracker_ = nullptr;
    std::size_t parity_ = 0;
  };

  ticket begin() noexcept {
    std::lock_guard lock(mutex_);
    const std::size_t p = generation_ & 1;
    ++in_flight_[p];
    return {this, p};
  }
  /// Returns once every handoff begun before the call has ended.
  void wait_for_earlier() noexcept {
    std::lock_guard one(waiter_);  // one waiter flips at a time: the other side is empty when it does
    std::unique_lock lock(mutex_);
    const std::size_t p = generation_++ & 1;
    ended_.wait(lock, [&] { return in_flight_[p] == 0; });
  }

 private:
  void end(std::size_t p) noexcept {
    std::lock_guard lock(mutex_);
    if (--in_flight_[p] == 0) ended_.notify_all();
  }

  std::mutex waiter_;
  std::mutex mutex_;
  std::condition_variable ended_;
  std::uint64_t generation_ = 0;
  std::size_t in_flight_[2] = {0, 0};
};

/// The root hash of the definition (src/prefix/hash.cpp).
kv_block_hash root_hash(std::string_view model, std::string_view salt, const kv_model_layout& layout,
                        const kv_cache_config& config, std::uint8_t element);

/// The pool's reclaimer (memory/reclaimer.hpp).
class prefix_index final : public reclaimer {
 public:
  /// Claims `pool` for this index.
  /// @throws std::system_error(kv_errc::invalid_config) if the pool has an index already.
  prefix_index(const kv_model_layout& layout, const kv_cache_config& config, element_codec codec,
               ref_ptr<block_pool> pool, std::string model, std::shared_ptr<kv_block_store> store,
               kv_store_policy policy);
  /// Lets go of the pool, then of every entry.
  ~prefix_index() override;
  prefix_index(const prefix_index&) = delete;
  prefix_index& operator=(const prefix_index&) = delete;

  std::size_t num_layers() const noexcept { return num_layers_; }
  /// The layout of the sequences it caches (with their rollback_tokens).
  const kv_model_layout& layout() const noexcept { return rule_.layout(); }
  /// The match rule of that layout.
  const window_rule& rule() const noexcept { return rule_; }
  const kv_cache_config& config() const noexcept { return config_; }
  element_codec codec() const noexcept { return codec_; }
  const ref_ptr<block_pool>& pool() const noexcept { return pool_; }
  /// The tier below RAM (null: none), and when entries go to it.
  const std::shared_ptr<kv_block_store>& store() const noexcept { return store_; }
  kv_store_policy store_policy() const noexcept { return policy_; }
  /// The geometry of its entries as a store keeps them.
  const entry_geometry& geometry() const noexcept { return geometry_; }

  /// The tokens of `tokens` an attached sequence can hold: at most
  /// `max_tokens_per_seq` (entries inserted from sequences of a larger
  /// bound may be longer).
  std::span<const token_id> within_max(std::span<const token_id> tokens) const noexcept {
    return tokens.first(std::min(tokens.size(), config_.max_tokens_per_seq));
  }
  /// The hashes of the full blocks of `tokens` under `salt` (no lock).
  std::vector<kv_block_hash> hashes(std::span<const token_id> tokens, std::string_view salt) const;
  /// The hash before block 0's under `salt`.
  kv_block_hash root(std::string_view salt) const;
  /// The hash of the block of `tokens` (block_tokens of them) after `prev`,
  /// in `scratch` (kept by the caller, so that it allocates once).
  static kv_block_hash next_hash(const kv_block_hash& prev, std::span<const token_id> tokens,
                                 std::vector<std::uint8_t>& scratch);

  /// The blocks of the longest match of `hashes` from block 0 (the rule);
  /// counts a query of `hashes.size()` blocks. Throws std::bad_alloc.
  std::size_t match(std::span<const kv_block_hash> hashes) const;
  /// As match(), and references the blocks an attach of the match needs:
  /// `out[l]` gets layer l's, in block order (null where a windowed layer
  /// needs none); the matched entries become the most recently used (the
  /// windowed parts read, too) and those blocks are in use. Throws
  /// std::bad_alloc, changing nothing.
  std::size_t take(std::span<const kv_block_hash> hashes, std::vector<std::vector<ref_ptr<block>>>& out);
  /// Adds an entry for each of `chain[first..]` that has none, referencing
  /// `blocks[i]` (one per layer, null where a windowed layer has none; held
  /// by the caller throughout) for `chain[first + i]`; an existing one
  /// takes the windowed blocks it lacks, and becomes the most recently
  /// used. `chain` is the prefix's hashes from block 0: ancestors evicted
  /// meanwhile come back as entries holding nothing where every layer is
  /// windowed; with a full layer, whose blocks only the caller could
  /// give, nothing is inserted then (returns 0). Each entry of
  /// `chain[i]`, added or not (ancestors revived too), takes
  /// `retention->at(i)`; null (a store's entries): those added take the
  /// default priority, the others keep theirs. Returns the entries
  /// added, and appends their indices into `blocks` to `added` (if given,
  /// with room for `blocks.size()` reserved). `tokens`: the token ids of
  /// `chain`'s blocks from block 0, which each entry added keeps (for its
  /// stored event and dump()); an entry past their end keeps none.
  /// `in_store`: they came from the store, or the caller hands them to it
  /// (write-through). Throws std::bad_alloc, changing nothing.
  std::size_t insert(std::span<const kv_block_hash> chain, std::span<const token_id> tokens, std::size_t first,
                     std::span<const std::vector<const block*>> blocks, const retention_rule* retention,
                     std::vector<std::size_t>* added = nullptr, bool in_store = false);
  /// The entries of `hashes` (those still cached) are not in the store
  /// after all: their handing was refused memory.
  void mark_unstored(std::span<const kv_block_hash> hashes) noexcept;
  /// Held from before an entry is marked in the store, or removed for a
  /// write-back, until its put() has returned: what a flush waits for.
  handoff_tracker::ticket handing() noexcept { return handoffs_.begin(); }
  /// Hands the store every entry not in it yet (in use or idle), each
  /// holding its blocks until written (idle ones are in use meanwhile, as
  /// an attach's), then waits for the puts other threads are making. False
  /// if memory was refused for some (they stay unstored). No store: true.
  bool flush() noexcept;
  /// Counts an attach's tokens from the store, the entries handed to it,
  /// and the values it returned that were refused.
  void count_store_hits(std::size_t tokens) noexcept { store_hit_tokens_.fetch_add(tokens, std::memory_order_relaxed); }
  void count_store_puts(std::size_t entries) noexcept { store_puts_.fetch_add(entries, std::memory_order_relaxed); }
  void count_store_reject() noexcept { store_rejects_.fetch_add(1, std::memory_order_relaxed); }
  /// A receipt for the value of the entry `hash` (after `parent`, of
  /// `tokens`, or none) about to be put, so that the store tells which
  /// entries it holds; null if memory is refused (its store-tier events
  /// are then lost: a router misses an entry, never sees one not there).
  std::shared_ptr<kv_store_receipt> receipt(const kv_block_hash& hash, const std::optional<kv_block_hash>& parent,
                                            std::span<const token_id> tokens) const noexcept;
  /// The receipt of `chain[i]` (block i of a prefix): its parent
  /// `chain[i - 1]` (none for block 0), its tokens block i's of `tokens`
  /// (from block 0; none past their end).
  std::shared_ptr<kv_store_receipt> receipt(std::span<const kv_block_hash> chain, std::span<const token_id> tokens,
                                            std::size_t i) const noexcept;
  /// The store holds `hash` (a receipt's stored()): a store-tier stored
  /// event if no receipt held it yet.
  void store_has(const kv_block_hash& hash, const std::optional<kv_block_hash>& parent,
                 std::vector<token_id> tokens) noexcept;
  /// The store let go of a value of `hash` it held (a receipt's removed()):
  /// a store-tier removed event once no receipt holds it.
  void store_lost(const kv_block_hash& hash) noexcept;
  /// A fetch of `hash` found no valid value: gone from the store, whatever
  /// its receipts said (a store-tier removed event if it was there).
  void store_missed(const kv_block_hash& hash) noexcept;
  void clear() noexcept;
  kv_prefix_stats stats() const noexcept;
  void set_event_handler(kv_prefix_event_handler handler);
  /// Every entry, as of the events after the handler's event number it
  /// reports (see basic_kv_prefix_cache::dump): copied under mutex_ a few
  /// buckets at a time, so that an insert waits for one chunk at most.
  /// Throws std::bad_alloc.
  kv_prefix_dump dump() const;

  // The pool's calls, under its reclaimer mutex.
  /// Evicts the least recently used evictable entry; false if none.
  bool evict_one() noexcept override;
  /// `b` may have become idle; it is only looked up (it may be gone).
  void block_idle(const block* b) noexcept override;

 private:
  /// The cached run of `hashes` from block 0, in blocks (under mutex_).
  std::size_t cached_run(std::span<const kv_block_hash> hashes) const noexcept;
  /// The longest match of `hashes` (under mutex_); its entries in `chain`
  /// (resized to the cached run). Throws std::bad_alloc.
  std::size_t valid_run(std::span<const kv_block_hash> hashes, std::vector<prefix_entry*>& chain) const;
  /// Marks `e` used now (its eviction order).
  void touch(prefix_entry& e) noexcept;
  /// Gives `e` priority `p`, moving it in the eviction sets it is in.
  void set_priority(prefix_entry& e, std::uint8_t p) noexcept;
  /// Gives `e` what an insert at `now` with `r` gives it: the priority,
  /// and the deadline (its expiry node allocated already) or none.
  void retain(prefix_entry& e, const block_retention& r, std::chrono::steady_clock::time_point now) noexcept;
  /// The durations due by now end: their entries take their `after` priority.
  void expire() noexcept;
  /// Marks `e`'s windowed part used now.
  void touch_window(prefix_entry& e) noexcept;
  /// Puts `e` in window_lru_ or takes it out, as its counts say.
  void refresh_window(prefix_entry& e) noexcept;
  /// `e`'s windowed nodes in use changed: its place in window_lru_, and
  /// whether its windowed nodes are reclaimable.
  void window_use_changed(prefix_entry& e) noexcept;
  /// Evicts `e`'s windowed part: its windowed nodes go (freed where no
  /// other entry holds them); a hollow entry without children goes too.
  void drop_window(prefix_entry& e) noexcept;
  /// Removes `e`'s node of layer `l` from it, and the node from the index
  /// when no entry holds it any more (its block loses its cached bit).
  void detach_node(prefix_entry& e, std::size_t l) noexcept;
  void node_in_use(prefix_node& n) noexcept;
  void entry_idle(prefix_entry& e) noexcept;
  void entry_in_use(prefix_entry& e) noexcept;
  void lru_add(prefix_entry& e) noexcept;
  /// Recomputes `e`'s pin from its counts, and up its ancestors while it changes.
  void refresh_pin(prefix_entry* e) noexcept;
  void refresh_node(prefix_node& n) noexcept;
  void lru_remove(prefix_entry& e) noexcept;
  /// Evicts `e` (counted, a removed event): drops it from the index, its
  /// eviction sets and its nodes; the blocks no entry holds any more lose their cached bit (freed
  /// if idle). Its parent goes too when that leaves it hollow without
  /// children, and so on up.
  void remove(prefix_entry& e) noexcept;
  /// The entries a flush or a clear() hands the store, collected under
  /// mutex_: their hashes, their blocks referenced (let go of outside the
  /// lock) and their receipts.
  struct collected {
    std::vector<kv_block_hash> hashes;
    std::vector<std::vector<ref_ptr<block>>> refs;
    std::vector<std::shared_ptr<kv_store_receipt>> receipts;
  };
  /// Under mutex_: collects the entries not in the store into `out`; they
  /// count as in the store from now. `pin`: their idle nodes turn in use
  /// (the entries stay cached). False if memory was refused part way (what
  /// was collected stands).
  bool collect_unstored(collected& out, bool pin) noexcept;
  /// Outside mutex_, within a handing() ticket: puts a held_entry of each collected
  /// entry, keeping each value in `values` so that no block is let go of
  /// here. Returns how many were put (fewer if memory was refused).
  std::size_t put_collected(const collected& in, std::vector<std::shared_ptr<const kv_store_value>>& values) noexcept;
  /// Whether entries leaving RAM are written back.
  bool writes_back() const noexcept { return store_ && policy_ == kv_store_policy::write_back; }
  void emit(kv_prefix_event::kind what, const kv_block_hash& hash, const kv_block_hash* parent,
            std::uint8_t priority = kv_retention::default_value, const token_id* tokens = nullptr,
            kv_prefix_tier tier = kv_prefix_tier::ram) noexcept;
  /// `e`'s parent's hash, none for block 0.
  static std::optional<kv_block_hash> parent_of(const prefix_entry& e) noexcept {
    return e.parent ? std::optional(e.parent->hash) : std::nullopt;
  }
  /// `e`'s token ids (empty if its insert had none).
  std::span<const token_id> tokens_of(const prefix_entry& e) const noexcept {
    return e.tokens ? std::span<const token_id>(e.tokens.get(), config_.block_tokens) : std::span<const token_id>();
  }
  void publish_counts() noexcept;

  const window_rule rule_;
  const std::size_t num_layers_;
  const kv_cache_config config_;
  const element_codec codec_;
  const ref_ptr<block_pool> pool_;
  const std::string model_;
  const kv_block_hash unsalted_root_;
  const std::shared_ptr<kv_block_store> store_;
  const kv_store_policy policy_;
  const entry_geometry geometry_;

  handoff_tracker handoffs_;  // see handing()
  mutable std::mutex mutex_;
  std::unordered_map<kv_block_hash, std::unique_ptr<prefix_entry>, block_hash_hasher> entries_;
  std::unordered_map<const block*, prefix_node> nodes_;
  lru_set lru_;
  lru_set window_lru_;
  expiry_set expiry_;
  std::uint64_t clock_ = 0;
  std::size_t idle_nodes_ = 0;
  std::size_t idle_entries_ = 0;
  std::size_t reclaimable_ = 0;
  kv_prefix_event_handler handler_;
  std::uint64_t event_sequence_ = 0;
  /// The store tier's entries: those this cache put that its store says it
  /// holds (receipts: the store's values of the hash it has not let go of).
  struct stored_entry {
    std::optional<kv_block_hash> parent;
    std::vector<token_id> tokens;  // block_tokens of them (its receipt's), or none
    std::size_t receipts = 0;
  };
  using stored_map = std::unordered_map<kv_block_hash, stored_entry, block_hash_hasher>;
  stored_map stored_;
  /// Under mutex_: erases the store tier's entry `it` (a removed event).
  void forget_stored(stored_map::iterator it) noexcept;
  const std::shared_ptr<store_link> link_;  // what this index's receipts hold: cut first when it goes
  std::vector<const std::byte*> halves_;  // a write-back's, two per layer: eviction allocates no room for them

  // Counters (relaxed; stats() reads them without the lock). A match()
  // counts a query without changing any entry.
  mutable std::atomic<std::uint64_t> queries_{0};
  mutable std::atomic<std::uint64_t> query_tokens_{0};
  mutable std::atomic<std::uint64_t> hit_tokens_{0};
  std::atomic<std::uint64_t> inserted_{0};
  std::atomic<std::uint64_t> evicted_{0};
  std::array<std::atomic<std::uint64_t>, 4> evicted_by_band_{};  // kv_priority_band()
  std::atomic<std::uint64_t> window_evicted_{0};
  std::atomic<std::size_t> cached_{0};
  std::atomic<std::size_t> idle_{0};
  std::atomic<std::uint64_t> store_hit_tokens_{0};
  std::atomic<std::uint64_t> store_puts_{0};
  std::atomic<std::uint64_t> store_rejects_{0};
};

/// Throws std::system_error as insert() documents for a `seq` this cache
/// cannot take entries from (src/prefix/cache.cpp).
void check_insertable(const prefix_index& p, const sequence_state* seq);

/// Block `b` of each of `layers` as an entry holds it: null for a windowed
/// layer that does not hold all of it; empty if a full layer does not.
/// Throws std::bad_alloc.
std::vector<const block*> entry_blocks(const prefix_index& p, std::span<const layer_blocks> layers, std::size_t b);

/// prefix_index::insert() of `blocks` for `chain[first..]` (less those at
/// the end holding no block at all; `tokens` those of `chain` from block
/// 0), handing the new entries to a write-through store. Returns the
/// entries added. Throws std::bad_alloc.
std::size_t insert_blocks(prefix_index& p, std::span<const kv_block_hash> chain, std::span<const token_id> tokens,
                          std::size_t first, std::span<const std::vector<const block*>> blocks,
                          const retention_rule& retention = {});

/// What an attach returns: a sequence on `ex` of `blocks` (`blocks[l]`
/// layer l's, in block order, null where a windowed layer has none),
/// holding the first `attached` blocks of `tokens` and their ids; a
/// windowed layer keeps only the blocks the rule needs for `attached`.
/// Throws std::bad_alloc.
std::shared_ptr<sequence_state> attached_sequence(const prefix_index& p, asio::any_io_executor ex,
                                                  std::vector<std::vector<ref_ptr<block>>> blocks,
                                                  std::span<const token_id> tokens, std::size_t attached);

}  // namespace detail
GHOSTLINK_NAMESPACE_END
