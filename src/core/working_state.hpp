#pragma once
// A cache's working state: what the actor has applied and not yet published,
// and the only code that writes into blocks.
//
// Strand only: every member of working_state is read and written by the
// actor's drain, on the actor's strand, and nowhere else. Readers never see
// this object; they see the epochs publish() hands out.
//
// Invariants:
// - Tokens [0, stored_) live in blocks; [stored_, size_) read as zeros
//   (see epoch in epoch.hpp). stored_ <= size_.
// - table_ holds exactly ceil(stored_ / block_tokens) blocks, none null;
//   blocks of never-written tokens below stored_ are the zero block;
//   places past them are null or the zero block.
// - In a block this cache owns, every position below stored_ is materialized
//   (see block::materialized): new blocks are not zeroed up front; the
//   positions skipped are zero-filled as stored_ passes them. Blocks owned
//   by another cache (shared by a fork) are never written and their owner's
//   counters never read here: a copy takes the positions below stored_.
// - A block is writable in place at position p only if this cache owns it
//   and no epoch of any cache that is still alive reads the position:
//   - p >= its readable(): no published epoch ever read it (an append); or
//   - a rewrite after a rollback: p >= its materialized() (the cache no
//     longer holds p; a truncate cut it off), that truncate is published
//     (rewound_epoch() < next_epoch_), the registry holds no epoch but the
//     latest, and no one but this cache's table and latest epoch holds a
//     reference to the block (no fork, no other holder).
//   Anything else is copied first (copy-on-write): an overwrite of a token
//   the cache holds always copies, as a snapshot may pin the latest epoch at
//   any moment.
// - readable() only grows, and covers every position a published epoch or
//   a fork can read: seal() raises it for every block touched since the
//   last seal, before an epoch is published or a fork shares the blocks.
// - A table or chunk born before next_epoch_ may be read by a published
//   epoch and is never edited (it is copied first). Tables and chunks are
//   never shared between caches; a fork copies them.
// - apply() changes nothing visible unless it returns success.
// - set_aside_ holds fresh blocks of this cache that no table or epoch
//   refers to, set aside by set_aside() for the next write or open(); the
//   next one that succeeds frees what it did not use.
// - A sequence step's positions (open()): from the open to the commit or
//   the end, positions [first, first + tokens) belong to the step. The
//   epoch staged right after the open (its publish()) covers them, so seal()
//   counts them readable and nothing here writes them in place again; the
//   step's writer alone stores into them (store_step(), on its own thread),
//   and only the step reads them, after that store (its release).
// - A windowed layer (layer_.window > 0): table entries
//   [first_droppable(), dropped_to_) are null (dropped), a chunk wholly in
//   that range may be null itself, and positions [sink_tokens, kept_from_)
//   are never read (the epochs say so: window_view). kept_from_ <= size_
//   unless the layer holds no position past its sinks. Everything past
//   kept_from_ below stored_ is held.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <system_error>
#include <utility>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "core/epoch.hpp"
#include "ghostlink/config.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/layout.hpp"
#include "ghostlink/types.hpp"
#include "memory/block.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class working_state {
 public:
  /// A cache holding `prefix` (full blocks of another owner, tokens
  /// `[0, prefix.size() * block_tokens)`, moved from; none: an empty cache);
  /// `initialized` makes it accept writes without an initialize() first (a
  /// sequence's layers). Throws std::bad_alloc.
  working_state(const kv_cache_config& config, ref_ptr<const block_layout> layout, ref_ptr<block_pool> pool,
                bool initialized, std::span<ref_ptr<block>> prefix = {});
  ~working_state();
  working_state(const working_state&) = delete;
  working_state& operator=(const working_state&) = delete;

  /// The first epoch, published when the actor is built: empty, or a
  /// fork's copy of its parent.
  ref_ptr<epoch> initial_epoch();

  // Each applies one request all-or-nothing: on error nothing changed.
  error_code initialize(std::size_t size);
  error_code write(std::span<const kv_write> writes);
  error_code truncate(std::size_t size);
  /// Phase 1 of a truncate to `size`: copies what it will edit that a
  /// published epoch reads. On error (capacity_exhausted) nothing changed;
  /// on success, cut(size) cannot fail.
  error_code prepare_truncate(std::size_t size);
  /// Phase 2 of a truncate, after prepare_truncate(size). Also undoes a
  /// write() or an open() of tokens from `size` on applied since the last
  /// publish(): their tables and chunks are this epoch's, so nothing is
  /// copied.
  void cut(std::size_t size) noexcept;
  /// A step's begin (a sequence's layers, whose tokens are all stored):
  /// makes positions `[first, first + tokens)` the step's, in blocks
  /// writable in place, and counts them as held; the step stores them
  /// (store_step) before they are published. `first` is size(), after
  /// set_aside(first, tokens). On error (capacity_exhausted) nothing changed.
  error_code open(std::size_t first, std::size_t tokens);
  /// Stores tokens from `first` on (`keys.size()` / width of them),
  /// converted, into the positions an open() just made writable (an
  /// append of a group).
  void store(std::size_t first, std::span<const float> keys, std::span<const float> values) noexcept;
  /// The step's writer: as store(), into the positions an open() made the
  /// step's, which `e` (the epoch staged after it) covers. Any thread.
  static void store_step(const epoch& e, std::size_t first, std::span<const float> keys,
                         std::span<const float> values) noexcept;
  /// Frees what set_aside() set aside (a group's begin that another layer
  /// refused).
  void release_set_aside() noexcept { set_aside_.clear(); }
  /// Drops the tokens from `index` on, frees the blocks set aside before,
  /// and sets aside every block a write of tokens `[index, index + tokens)`
  /// (`tokens` > 0) will need, so that it cannot fail for want of a block
  /// (a group's append or step begin, before open()). On error
  /// (capacity_exhausted) nothing is set aside and nothing changed.
  error_code set_aside(std::size_t index, std::size_t tokens);
  /// A new working state equal to this one, sharing every block
  /// (copy-on-write on both sides). Throws std::bad_alloc, changing nothing.
  std::unique_ptr<working_state> fork();
  /// True when something was applied since the last publish().
  bool has_changes() const noexcept { return changed_; }
  /// Sets aside the memory of the next epoch, so that publish() cannot fail
  /// once requests are applied. Throws std::bad_alloc.
  void prepare_epoch();
  /// Freezes the working state into the next epoch (in the memory
  /// prepare_epoch() set aside, if any).
  ref_ptr<epoch> publish();
  std::size_t size() const noexcept { return size_; }
  const kv_cache_config& config() const noexcept { return config_; }
  const ref_ptr<block_pool>& pool() const noexcept { return pool_; }
  /// The registry every epoch this state publishes joins.
  const ref_ptr<epoch_registry>& registry() const noexcept { return registry_; }
  /// The id this cache's blocks carry (its id in stats and events).
  std::uint64_t owner() const noexcept { return owner_; }
  /// New blocks draw their budget from `account` first (its sequence's);
  /// set before the first request reaches the actor.
  void use_account(ref_ptr<block_account> account) noexcept { account_ = std::move(account); }
  /// Makes this a layer of `l` (a window, sinks); before the first request.
  void use_layer_layout(const kv_layer_layout& l) noexcept;
  const kv_layer_layout& layer_layout() const noexcept { return layer_; }
  /// The first position past the sinks this layer holds.
  std::size_t kept_from() const noexcept { return kept_from_; }
  /// What it holds now, as the prefix cache reads it (a drain's observer).
  layer_blocks blocks() const noexcept {
    return {table_.get(), layout_.get(), stored_, layer_.window, layer_.sink_tokens, kept_from_};
  }
  /// A loaded windowed layer, made with null blocks where what it held
  /// (from `kept_from` on, and its sinks) left none: before the first epoch.
  void restore_kept_from(std::size_t kept_from) noexcept;
  /// Whether a truncate to `n` leaves this layer every position the window
  /// of a token at `n` attends (always, without a window).
  bool can_truncate(std::size_t n) const noexcept;
  /// A windowed layer drops the blocks past its sinks that hold no position
  /// at or after `keep`; none without a window. Never fails: without memory
  /// for a table copy it keeps them until a later call.
  void drop_before(std::size_t keep) noexcept;

 private:
  working_state(const working_state& parent, std::uint64_t next_epoch);

  error_code validate(std::span<const kv_write> writes) const noexcept;

  /// Entry `b` of the working table, ready to be set: the table and the
  /// block's chunk are copied first if a published epoch can see them.
  ref_ptr<block>& editable_block(std::size_t b);
  /// Sets the working table's block count; whole new chunks are the zero
  /// chunk. False when the zero block cannot be had or the table would pass
  /// its bound; throws std::bad_alloc (changing nothing) when the list of
  /// chunks cannot grow.
  bool resize_table(std::size_t blocks);
  /// A chunk whose every block is the zero block; never edited in place.
  const ref_ptr<table_chunk>& zero_chunk();
  /// Makes the working table one no published epoch reads (a copy of its
  /// list of chunks, unless it was born in the epoch being built).
  void own_table();
  using undo_log = std::vector<std::pair<std::size_t, ref_ptr<block>>>;
  /// Phase 1 of a write or an open: every block of `writes` and of
  /// positions `[first, end)` writable, gaps filled with the zero block,
  /// for `count` writes or blocks. Changes no token's value; false (and
  /// nothing changed) when out of blocks or memory.
  bool make_writable(std::span<const kv_write> writes, std::size_t first, std::size_t end, std::size_t stored,
                     std::size_t count);
  /// The work of make_writable() above, recording what it replaced in `undo`.
  bool prepare(std::span<const kv_write> writes, std::size_t first, std::size_t end, std::size_t stored,
               undo_log& undo);
  /// Makes block `b` writable at token `index`; records what it replaced.
  bool make_writable(std::size_t b, std::size_t index, undo_log& undo);
  bool writable_in_place(std::size_t b, const block& blk, std::size_t position) const noexcept;
  /// The rewrite-after-rollback case of writable_in_place (see above).
  bool rewritable_in_place(std::size_t b, const block& blk, std::size_t position) const noexcept;
  const ref_ptr<block>& zero_block();
  /// A fresh block of this cache: one set aside by set_aside(), else a new one
  /// (null when the pool has none to give).
  ref_ptr<block> fresh_block() noexcept;
  /// The first block a window may drop: past every sink.
  std::size_t first_droppable() const noexcept;
  /// Zero-fills `blk`'s positions from its materialized count up to `positions`.
  void materialize(block& blk, std::size_t positions) noexcept;
  /// Raises readable() of every block touched since the last seal to what
  /// it holds, so no later in-place write reaches a position an epoch or a
  /// fork may read.
  void seal() noexcept;

  const kv_cache_config config_;
  const ref_ptr<const block_layout> layout_;
  const ref_ptr<block_pool> pool_;
  block_cursor cursor_{*pool_};  // where this cache's next new block goes
  const std::uint64_t owner_;  // this cache's blocks carry it
  const ref_ptr<epoch_registry> registry_ = ref_ptr<epoch_registry>::adopt(new epoch_registry(layout_));
  ref_ptr<block_table> table_;
  ref_ptr<block> zero_block_;  // shared filler for never-written tokens; never written
  ref_ptr<table_chunk> zero_chunk_;
  undo_log undo_;                // a one-token write's undo log; empty between writes
  std::vector<block*> touched_;  // owned blocks written since the last seal (all in table_)
  std::vector<ref_ptr<block>> set_aside_;  // set aside by set_aside() for the next write
  ref_ptr<block_account> account_;        // its sequence's (none for a layer cache)
  kv_layer_layout layer_{};                // a sequence's layer: its window (none for a layer cache)
  std::size_t kept_from_ = 0;              // see the invariants
  std::size_t dropped_to_ = 0;             // see the invariants
  std::size_t size_ = 0;
  std::size_t stored_ = 0;
  std::uint64_t next_epoch_ = 0;
  void* spare_epoch_ = nullptr;  // raw memory for the next epoch
  bool initialized_ = false;
  bool changed_ = false;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
