#pragma once
// Block tables and epochs: the immutable published states of a cache that
// snapshots pin, and the registry of those still in memory.
//
// Ownership: an epoch owns its block table, a table its chunks, a chunk its
// blocks, a block its pool. Everything here is reference counted, so the
// last snapshot to release an epoch frees what only that epoch could reach,
// on whatever thread it runs; a freed block's memory goes back to its pool.
// Tables and chunks belong to one cache (a fork copies them).

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/detail/pinned_epoch.hpp"
#include "ghostlink/detail/ref_ptr.hpp"
#include "ghostlink/types.hpp"
#include "memory/block.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// Memory for a block table, a table chunk or an epoch:
/// `::operator new(size)`, unless a test has asked for it to fail
/// (std::bad_alloc; see src/testing/hooks.hpp).
void* metadata_new(std::size_t size);

/// Up to `size` consecutive blocks of a block table. Never changed once
/// published; tables of one cache share unchanged chunks.
struct table_chunk : ref_counted<table_chunk> {
  static constexpr std::size_t size = 32;
  explicit table_chunk(std::uint64_t born_epoch) noexcept : born_epoch(born_epoch) {}
  static void destroy(table_chunk* c) noexcept { delete c; }
  static void* operator new(std::size_t size) { return metadata_new(size); }
  static void operator delete(void* p) noexcept { ::operator delete(p); }

  const std::uint64_t born_epoch;  // the first epoch of its cache that can see it
  std::array<ref_ptr<block>, size> blocks;
};

/// Entry `b` is the block holding tokens `[b * block_tokens, (b + 1) *
/// block_tokens)`. Never changed once published, so a block lives exactly
/// as long as some epoch that can read it. Two levels, so that a new table
/// copies the list of chunks and the one chunk it changes, not every block
/// reference.
struct block_table : ref_counted<block_table> {
  explicit block_table(std::uint64_t born_epoch) noexcept : born_epoch(born_epoch) {}
  static void destroy(block_table* t) noexcept { delete t; }
  static void* operator new(std::size_t size) { return metadata_new(size); }
  static void operator delete(void* p) noexcept { ::operator delete(p); }

  /// Entry `b` (`b < blocks`): null where a windowed layer dropped it (its
  /// chunk may be gone too).
  const ref_ptr<block>& block_at(std::size_t b) const noexcept {
    const ref_ptr<table_chunk>& chunk = chunks[b / table_chunk::size];
    return chunk ? chunk->blocks[b % table_chunk::size] : dropped();
  }
  static const ref_ptr<block>& dropped() noexcept {
    static const ref_ptr<block> none;
    return none;
  }

  const std::uint64_t born_epoch;  // the first epoch of its cache that can see it
  std::vector<ref_ptr<table_chunk>> chunks;  // null: every block of it dropped (a windowed layer)
  std::size_t blocks = 0;  // blocks in use; later ones are null or the zero block
};

struct epoch;

/// The epochs of one cache still in memory (the latest, and older ones a
/// snapshot pins), oldest first, and the snapshots open on them: what
/// stats() reports, so that a stalled reader holding memory shows. Epochs
/// join when published (the actor) and leave when freed (any thread).
///
/// It also owns the cache's layout: every epoch holds its registry, so an
/// epoch refers to the layout without a reference count of its own (no
/// atomic per publication for it).
class epoch_registry : public ref_counted<epoch_registry> {
 public:
  explicit epoch_registry(ref_ptr<const block_layout> layout) noexcept : layout_(std::move(layout)) {}
  epoch_registry(const epoch_registry&) = delete;
  epoch_registry& operator=(const epoch_registry&) = delete;
  ~epoch_registry() { ::operator delete(spare_.load(std::memory_order_acquire)); }
  static void destroy(epoch_registry* r) noexcept { delete r; }
  const block_layout& layout() const noexcept { return *layout_; }
  /// The cache's block of zeros, once it has one: epochs point at it
  /// without a reference count of their own (they hold the registry). Set
  /// once, by the actor, before an epoch that reads it is published.
  void set_zeros(ref_ptr<block> zeros) noexcept { zeros_ = std::move(zeros); }

  void add(epoch* e) noexcept;
  void remove(epoch* e) noexcept;
  struct reading {
    std::size_t epochs_alive = 0;
    std::uint64_t oldest = 0;
  };
  reading read() const noexcept;

  void snapshot_opened() noexcept { snapshots_.fetch_add(1, std::memory_order_relaxed); }
  void snapshot_closed() noexcept { snapshots_.fetch_sub(1, std::memory_order_relaxed); }
  std::size_t snapshots() const noexcept { return snapshots_.load(std::memory_order_relaxed); }

  /// The memory of a freed epoch, kept for the next one this cache
  /// publishes (so a steady stream of publications allocates nothing), or
  /// null. Any thread may give; only the actor takes.
  void* take_spare_epoch() noexcept { return spare_.exchange(nullptr, std::memory_order_acquire); }
  void give_spare_epoch(void* memory) noexcept {
    ::operator delete(spare_.exchange(memory, std::memory_order_acq_rel));
  }

 private:
  const ref_ptr<const block_layout> layout_;
  ref_ptr<block> zeros_;  // set once (set_zeros)
  mutable std::mutex mutex_;
  epoch* oldest_ = nullptr;  // mutex_; a list through epoch::newer / epoch::older
  epoch* newest_ = nullptr;  // mutex_
  std::size_t count_ = 0;    // mutex_
  std::atomic<std::size_t> snapshots_{0};
  std::atomic<void*> spare_{nullptr};  // ::operator new(sizeof(epoch)) memory, or null
};

/// A layer's blocks as the prefix cache reads them, from an epoch or from
/// a working state inside its drain.
struct layer_blocks {
  const block_table* table = nullptr;
  const block_layout* layout = nullptr;
  std::size_t stored = 0;           // tokens [0, stored) live in the table's blocks
  std::size_t window = 0;           // a windowed layer's (0: none)
  std::size_t sinks = 0;
  std::size_t kept_from = 0;        // positions [sinks, kept_from) dropped

  /// Block `b` when the layer holds every one of its tokens as data of its
  /// own (its sinks, or past `kept_from`; not the zero block); else null.
  const block* whole_block(std::size_t b) const noexcept;
  /// Token `i`'s id, read from a token-id layer (no_token_id past `stored`).
  token_id stored_id(std::size_t i) const noexcept;
};

/// One published state of a cache: what a snapshot pins.
///
/// Tokens `[0, stored)` live in the table's blocks; tokens `[stored, size)`
/// were made valid by initialize() or skipped by a write and read as zeros
/// from `zeros`, a block that is never written. Keeping them out of the
/// table is what lets the actor fill them in place later: no epoch reads
/// those positions of any block.
struct epoch : ref_counted<epoch> {
  epoch(std::uint64_t number, std::size_t size, std::size_t stored, ref_ptr<block_table> table, const block* zeros,
        const block_layout& layout, ref_ptr<epoch_registry> registry = {}, window_view window = {}) noexcept
      : number(number),
        size(size),
        stored(stored),
        table(std::move(table)),
        zeros(zeros),
        layout(&layout),
        window(window),
        registry(std::move(registry)) {
    if (this->registry) this->registry->add(this);
  }
  /// Leaves the registry and gives the memory back to it for the next
  /// epoch (memory from `::operator new(sizeof(epoch))`, as metadata_new
  /// and the spare are).
  static void destroy(epoch* e) noexcept {
    ref_ptr<epoch_registry> registry = std::move(e->registry);
    if (!registry) {
      delete e;
      return;
    }
    registry->remove(e);
    e->~epoch();
    registry->give_spare_epoch(e);
  }

  /// The block holding token `index` (`index < size`); its position there
  /// is `index % block_tokens`.
  const block& block_of(std::size_t index) const noexcept {
    return index < stored ? *table->block_at(index / layout->block_tokens) : *zeros;
  }
  /// Its blocks, as the prefix cache reads them.
  layer_blocks blocks() const noexcept {
    return {table.get(), layout, stored, window.window, window.sinks, window.kept_from};
  }

  const std::uint64_t number;
  const std::size_t size;
  const std::size_t stored;
  const ref_ptr<block_table> table;
  const block* const zeros;  // the registry's (or, without one, a test's): read only past `stored`
  const block_layout* const layout;        // its registry's (or, without one, a test's)
  const window_view window;                // a windowed layer's: positions [sinks, kept_from) are dropped
  ref_ptr<epoch_registry> registry;        // null only in tests of epochs alone; set once
  epoch* older = nullptr;                  // the registry's list, under its mutex
  epoch* newer = nullptr;
};

/// One published state of a group of layers (a sequence's layers and its
/// token ids): the epoch of each layer as one drain left them, so that
/// every layer shows the same tokens. What a sequence snapshot pins.
struct group_epoch : ref_counted<group_epoch> {
  static void destroy(group_epoch* g) noexcept { delete g; }
  static void* operator new(std::size_t size) { return metadata_new(size); }
  static void operator delete(void* p) noexcept { ::operator delete(p); }

  std::vector<ref_ptr<epoch>> layers;  // filled by the actor before publication, never changed after
};

/// Turns an epoch reference into a reader's pin and back.
struct epoch_access {
  /// A pin holding the reference `e` carries, counted in its registry.
  static pinned_epoch pin(ref_ptr<epoch> e) noexcept {
    if (e->registry) e->registry->snapshot_opened();
    const epoch* raw = e.detach();
    return {raw,
            raw->number,
            raw->size,
            raw->layout->token_width,
            raw->layout->value_width,
            raw->window,
            {raw->layout->key_scale, raw->layout->value_scale}};
  }
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
