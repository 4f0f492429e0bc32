#pragma once
// Paged storage: blocks of `block_tokens` tokens, the page tables that list
// them and the immutable epochs readers pin.
//
// Ownership: an epoch owns its page table, a page table owns its blocks, a
// block owns its pool. Everything here is reference counted, so the last
// snapshot to release an epoch frees what only that epoch could reach, on
// whatever thread it runs.
//
// Mutability: a published page table is never changed. A block's slots
// below the longest length any published epoch has had are never changed
// either; the actor (actor.cpp) writes them only into a fresh copy.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "ghostlink/detail/ref_ptr.hpp"

namespace ghostlink::detail {

/// Counts a cache's blocks and enforces its `max_blocks` budget. Any thread
/// may free a block (a snapshot's last release), so the counters are atomic.
class block_pool : public ref_counted<block_pool> {
 public:
  block_pool(std::size_t width, std::size_t block_tokens, std::size_t max_blocks) noexcept
      : width_(width), block_tokens_(block_tokens), max_blocks_(max_blocks) {}
  static void destroy(block_pool* p) noexcept { delete p; }

  std::size_t width() const noexcept { return width_; }
  std::size_t block_tokens() const noexcept { return block_tokens_; }
  /// Floats of keys (and again of values) in one block.
  std::size_t floats_per_half() const noexcept { return width_ * block_tokens_; }
  std::size_t blocks_in_use() const noexcept { return in_use_.load(std::memory_order_relaxed); }

  /// Counts one block against the budget; false when the budget is spent.
  bool reserve() noexcept;
  void unreserve() noexcept { in_use_.fetch_sub(1, std::memory_order_relaxed); }

 private:
  const std::size_t width_;
  const std::size_t block_tokens_;
  const std::size_t max_blocks_;
  std::atomic<std::size_t> in_use_{0};
};

/// Keys then values of `block_tokens` tokens, in one 64-byte aligned
/// allocation.
class block : public ref_counted<block> {
 public:
  /// Whether a block counts against the pool's budget: every block does but
  /// a cache's one shared zero block, so `max_blocks` counts data blocks.
  enum class budget : bool { counted, exempt };

  /// Whether a new block's payload is all zeros (and counted as
  /// materialized) or left for the writer to fill token by token.
  enum class contents : bool { zeroed, unwritten };

  /// A new block, or null when the pool's budget or memory is spent.
  static ref_ptr<block> make(block_pool& pool, std::uint64_t born_epoch, budget b = budget::counted,
                             contents c = contents::unwritten) noexcept;
  static void destroy(block* b) noexcept;

  float* keys() noexcept { return data(); }
  float* values() noexcept { return data() + pool_->floats_per_half(); }
  const float* keys() const noexcept { return const_cast<block*>(this)->keys(); }
  const float* values() const noexcept { return const_cast<block*>(this)->values(); }

  /// The first epoch that can see this block; set before it is published.
  std::uint64_t born_epoch() const noexcept { return born_epoch_; }

  /// Slots [0, materialized()) hold their tokens' values (written, or zeros
  /// where skipped); later slots hold garbage no epoch reads. The actor's
  /// alone: read and written on the strand only.
  std::size_t materialized() const noexcept { return materialized_; }
  void set_materialized(std::size_t slots) noexcept { materialized_ = slots; }

 private:
  block(block_pool& pool, std::uint64_t born_epoch, budget b) noexcept;
  ~block() = default;
  float* data() noexcept;

  ref_ptr<block_pool> pool_;
  std::uint64_t born_epoch_;
  budget budget_;
  std::size_t materialized_ = 0;
};

/// Up to `size` consecutive entries of a page table. Never changed once
/// published; tables share unchanged chunks.
struct page_chunk : ref_counted<page_chunk> {
  static constexpr std::size_t size = 32;
  explicit page_chunk(std::uint64_t born_epoch) noexcept : born_epoch(born_epoch) {}
  static void destroy(page_chunk* c) noexcept { delete c; }

  const std::uint64_t born_epoch;  // the first epoch that can see it
  std::array<ref_ptr<block>, size> blocks;
};

/// Block `i` holds tokens `[i * block_tokens, (i + 1) * block_tokens)`.
/// Never changed once published, so a block lives exactly as long as some
/// epoch that can read it. Two levels, so that a new table copies the list
/// of chunks and the one chunk it changes, not every block reference.
struct page_table : ref_counted<page_table> {
  explicit page_table(std::uint64_t born_epoch) noexcept : born_epoch(born_epoch) {}
  static void destroy(page_table* t) noexcept { delete t; }

  const ref_ptr<block>& entry(std::size_t b) const noexcept {
    return chunks[b / page_chunk::size]->blocks[b % page_chunk::size];
  }

  const std::uint64_t born_epoch;  // the first epoch that can see it
  std::vector<ref_ptr<page_chunk>> chunks;
  std::size_t blocks = 0;  // entries in use; later ones are null or the zero block
};

/// One published state of a cache: what a snapshot pins.
///
/// Tokens `[0, stored)` live in the table's blocks; tokens `[stored, length)`
/// were made valid by initialize() or skipped by a write and read as zeros
/// from `zeros`, a block that is never written. Keeping them out of the
/// table is what lets the actor fill them in place later: no epoch reads
/// those slots of any block.
struct epoch : ref_counted<epoch> {
  epoch(std::uint64_t number, std::size_t length, std::size_t stored, ref_ptr<page_table> table,
        ref_ptr<block> zeros, std::size_t width, std::size_t block_tokens) noexcept
      : number(number),
        length(length),
        stored(stored),
        table(std::move(table)),
        zeros(std::move(zeros)),
        width(width),
        block_tokens(block_tokens) {}
  static void destroy(epoch* e) noexcept { delete e; }

  /// The block holding token `index` (`index < length`); the slot within it
  /// is `index % block_tokens`.
  const block& block_of(std::size_t index) const noexcept {
    return index < stored ? *table->entry(index / block_tokens) : *zeros;
  }
  /// Tokens from `index` on that share `index`'s block (capped at `end`).
  std::size_t run_from(std::size_t index, std::size_t end) const noexcept {
    const std::size_t run_end = index < stored && stored < end ? stored : end;
    const std::size_t in_block = block_tokens - index % block_tokens;
    return run_end - index < in_block ? run_end - index : in_block;
  }

  const std::uint64_t number;
  const std::size_t length;
  const std::size_t stored;
  const ref_ptr<page_table> table;
  const ref_ptr<block> zeros;
  const std::size_t width;
  const std::size_t block_tokens;
};

}  // namespace ghostlink::detail
