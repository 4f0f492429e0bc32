#pragma once
// The actor's private storage state and the only code that mutates blocks.
//
// Strand only: every member of page_writer is read and written by the
// actor's drain, on the actor's strand, and nowhere else. Readers never see
// this object; they see the epochs publish() hands out.
//
// Invariants:
// - Tokens [0, stored_) live in blocks; [stored_, length_) read as zeros
//   (see epoch in storage.hpp). stored_ <= length_.
// - table_ holds exactly ceil(stored_ / block_tokens) blocks, none null;
//   blocks of never-written tokens below stored_ are the zero block;
//   entries past them are null or the zero block.
// - Every slot below stored_ is materialized in its block (see
//   block::materialized): new blocks are not zeroed up front, the writer
//   zero-fills skipped slots as stored_ passes them.
// - A block is writable in place at index i only if it is not the zero
//   block and either it was born in the epoch being built (no published
//   epoch references it) or i >= published_stored_ (no published epoch
//   reads that slot from any block). Anything else is copied first.
// - A table, chunk or block born before next_epoch_ may be read by a
//   published epoch: a table or chunk is then never edited (it is copied
//   first), a block only as the in-place rule above allows.
// - apply() changes nothing visible unless it returns success.

#include <cstddef>
#include <cstdint>
#include <span>
#include <system_error>
#include <utility>
#include <vector>

#include "ghostlink/config.hpp"
#include "ghostlink/detail/request.hpp"
#include "ghostlink/detail/storage.hpp"

namespace ghostlink::detail {

class page_writer {
 public:
  page_writer(const kv_cache_config& config, ref_ptr<block_pool> pool);
  ~page_writer();
  page_writer(const page_writer&) = delete;
  page_writer& operator=(const page_writer&) = delete;

  /// Epoch 0: empty. Published once, when the actor is built.
  ref_ptr<epoch> initial_epoch();
  /// Applies one request all-or-nothing to the working state.
  std::error_code apply(const request& r);
  /// True when something was applied since the last publish().
  bool has_changes() const noexcept { return changed_; }
  /// Sets aside the memory of the next epoch, so that publish() cannot fail
  /// once requests are applied. Throws std::bad_alloc.
  void reserve_epoch();
  /// Freezes the working state into the next epoch (in the memory
  /// reserve_epoch() set aside, if any).
  ref_ptr<epoch> publish();
  std::size_t length() const noexcept { return length_; }

 private:
  std::error_code validate(std::span<const kv_write> entries) const noexcept;
  std::error_code initialize(std::size_t seq_len);
  std::error_code write(std::span<const kv_write> entries);

  /// Entry `b` of the working table, ready to be set: the table and the
  /// entry's chunk are copied first if a published epoch can see them.
  ref_ptr<block>& editable_entry(std::size_t b);
  /// Sets the working table's entry count; whole new chunks are the zero
  /// chunk. False when the zero block cannot be had or the table would pass
  /// its bound; throws std::bad_alloc (changing nothing) when the list of
  /// chunks cannot grow.
  bool resize_table(std::size_t blocks);
  /// A chunk whose every entry is the zero block; never edited in place.
  const ref_ptr<page_chunk>& zero_chunk();
  /// Makes the working table one no published epoch reads (a copy of its
  /// list of chunks, unless it was born in the epoch being built).
  void own_table();
  using undo_log = std::vector<std::pair<std::size_t, ref_ptr<block>>>;
  /// Phase 1 of a write: every target block writable, gaps filled with the
  /// zero block. Changes no token's value; false when out of blocks.
  bool prepare(std::span<const kv_write> entries, std::size_t stored, undo_log& undo);
  /// Makes block `b` writable at token `index`; records what it replaced.
  bool make_writable(std::size_t b, std::size_t index, undo_log& undo);
  bool writable_in_place(const block& blk, std::size_t index) const noexcept;
  const ref_ptr<block>& zero_block();
  /// Zero-fills `blk`'s slots from its materialized count up to `slots`.
  void materialize(block& blk, std::size_t slots) noexcept;

  const kv_cache_config config_;
  const ref_ptr<block_pool> pool_;
  ref_ptr<page_table> table_;
  ref_ptr<block> zero_block_;  // shared filler for never-written tokens; never written
  ref_ptr<page_chunk> zero_chunk_;
  std::size_t length_ = 0;
  std::size_t stored_ = 0;
  std::size_t published_stored_ = 0;  // the most any published epoch stored
  std::uint64_t next_epoch_ = 0;
  void* spare_epoch_ = nullptr;  // raw memory for the next epoch
  bool initialized_ = false;
  bool changed_ = false;
};

}  // namespace ghostlink::detail
