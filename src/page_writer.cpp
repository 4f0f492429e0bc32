#include "page_writer.hpp"

#include <algorithm>
#include <new>

#include "ghostlink/error.hpp"

namespace ghostlink::detail {
namespace {

/// The most chunks a page table may list: 2^31 blocks, 512 MiB of chunk
/// pointers. A write that would need more (a huge max_tokens_per_seq and an
/// index near it) fails with capacity_exhausted instead of asking the
/// allocator for an absurd table.
constexpr std::size_t max_table_chunks = std::size_t{1} << 26;

/// ceil(n / d), without overflow for any n.
std::size_t ceil_div(std::size_t n, std::size_t d) { return n / d + (n % d != 0); }

}  // namespace

page_writer::page_writer(const kv_cache_config& config, ref_ptr<block_pool> pool)
    : config_(config), pool_(std::move(pool)), table_(ref_ptr<page_table>::adopt(new page_table(0))) {}  // built for epoch 0

page_writer::~page_writer() { ::operator delete(spare_epoch_); }

ref_ptr<epoch> page_writer::initial_epoch() { return publish(); }

void page_writer::reserve_epoch() {
  if (!spare_epoch_) spare_epoch_ = ::operator new(sizeof(epoch));
}

ref_ptr<epoch> page_writer::publish() {
  // epoch::destroy deletes with a plain delete-expression, which matches
  // memory from ::operator new(sizeof(epoch)).
  void* memory = spare_epoch_ ? std::exchange(spare_epoch_, nullptr) : ::operator new(sizeof(epoch));
  auto e = ref_ptr<epoch>::adopt(::new (memory) epoch(next_epoch_, length_, stored_, table_, zero_block_,
                                                      config_.token_width(), config_.block_tokens));
  ++next_epoch_;
  published_stored_ = std::max(published_stored_, stored_);
  changed_ = false;
  return e;
}

std::error_code page_writer::apply(const request& r) {
  if (r.op() == request::kind::initialize) return initialize(r.length());
  return write(r.entries());
}

std::error_code page_writer::validate(std::span<const kv_write> entries) const noexcept {
  const std::size_t width = config_.token_width();
  for (const kv_write& w : entries) {
    if (w.keys.size() != w.values.size()) return kv_errc::length_mismatch;
    if (w.keys.size() != width) return kv_errc::width_mismatch;
    if (w.index >= config_.max_tokens_per_seq) return kv_errc::index_out_of_range;
  }
  if (!entries.empty() && !initialized_) return kv_errc::not_initialized;
  return {};
}

std::error_code page_writer::initialize(std::size_t seq_len) {
  if (seq_len == 0) return kv_errc::zero_length;
  const std::size_t length = std::min(seq_len, config_.max_tokens_per_seq);
  if (length > length_) {
    if (!zero_block()) return kv_errc::capacity_exhausted;
    length_ = length;
    changed_ = true;
  }
  if (!initialized_) changed_ = initialized_ = true;
  return {};
}

std::error_code page_writer::write(std::span<const kv_write> entries) {
  if (std::error_code ec = validate(entries)) return ec;
  if (entries.empty()) return {};

  std::size_t stored = stored_;
  for (const kv_write& w : entries) stored = std::max(stored, w.index + 1);

  const std::size_t old_blocks = table_->blocks;
  undo_log undo;
  bool ok = false;
  try {
    undo.reserve(entries.size());  // so recording an undo step cannot throw
    ok = prepare(entries, stored, undo);
  } catch (const std::bad_alloc&) {
    ok = false;  // a table or chunk copy failed; what prepare() did so far is undone below
  }
  if (!ok) {
    // Put back what make_writable() replaced (entries it set are in private
    // chunks); entries past old_blocks may stay null or the zero block.
    for (auto it = undo.rbegin(); it != undo.rend(); ++it) editable_entry(it->first) = std::move(it->second);
    if (table_->blocks != old_blocks) resize_table(old_blocks);
    return kv_errc::capacity_exhausted;
  }

  // Phase 2: copy the data in. Cannot fail.
  const std::size_t bt = config_.block_tokens;
  const std::size_t width = config_.token_width();
  for (const kv_write& w : entries) {
    block& blk = *table_->entry(w.index / bt);
    const std::size_t slot = w.index % bt;
    materialize(blk, slot);
    std::copy(w.keys.begin(), w.keys.end(), blk.keys() + slot * width);
    std::copy(w.values.begin(), w.values.end(), blk.values() + slot * width);
    blk.set_materialized(std::max(blk.materialized(), slot + 1));
  }
  // Every slot below the new stored length must read as its token: zero
  // what was skipped in the blocks this write touched and in the old last
  // block. Those slots are past every published epoch's reach.
  auto complete = [&](std::size_t b) { materialize(*table_->entry(b), std::min(bt, stored - b * bt)); };
  if (stored_ > 0) complete((stored_ - 1) / bt);
  for (const kv_write& w : entries) complete(w.index / bt);
  stored_ = stored;
  length_ = std::max(length_, stored);
  changed_ = true;
  return {};
}

bool page_writer::prepare(std::span<const kv_write> entries, std::size_t stored, undo_log& undo) {
  const std::size_t bt = config_.block_tokens;
  const std::size_t old_blocks = table_->blocks;
  const std::size_t blocks = ceil_div(stored, bt);
  if (blocks > old_blocks && !resize_table(blocks)) return false;
  for (const kv_write& w : entries)
    if (!make_writable(w.index / bt, w.index, undo)) return false;
  // New entries not written in the old last chunk (whole new chunks start
  // as zero chunks): nothing was written there, so they read as zeros.
  const std::size_t old_chunk_end = std::min(blocks, ceil_div(old_blocks, page_chunk::size) * page_chunk::size);
  for (std::size_t b = old_blocks; b < old_chunk_end; ++b) {
    if (table_->entry(b)) continue;
    if (!zero_block()) return false;
    editable_entry(b) = zero_block_;
  }
  return true;
}

void page_writer::own_table() {
  if (table_->born_epoch == next_epoch_) return;
  auto copy = ref_ptr<page_table>::adopt(new page_table(next_epoch_));
  copy->chunks.reserve(table_->chunks.size() + 1);  // an append adds at most one chunk at a time
  copy->chunks = table_->chunks;
  copy->blocks = table_->blocks;
  table_ = std::move(copy);
}

bool page_writer::resize_table(std::size_t blocks) {
  const std::size_t chunks = ceil_div(blocks, page_chunk::size);
  if (chunks > max_table_chunks) return false;
  if (chunks > table_->chunks.size() && !zero_chunk()) return false;
  own_table();
  table_->chunks.resize(chunks, zero_chunk_);  // throws std::bad_alloc before changing anything
  table_->blocks = blocks;
  return true;
}

const ref_ptr<page_chunk>& page_writer::zero_chunk() {
  if (!zero_chunk_ && zero_block()) {
    zero_chunk_ = ref_ptr<page_chunk>::adopt(new page_chunk(0));  // born 0: never edited in place
    zero_chunk_->blocks.fill(zero_block_);
  }
  return zero_chunk_;
}

ref_ptr<block>& page_writer::editable_entry(std::size_t b) {
  own_table();
  ref_ptr<page_chunk>& chunk = table_->chunks[b / page_chunk::size];
  if (chunk->born_epoch != next_epoch_) {
    auto copy = ref_ptr<page_chunk>::adopt(new page_chunk(next_epoch_));
    copy->blocks = chunk->blocks;
    chunk = std::move(copy);
  }
  return chunk->blocks[b % page_chunk::size];
}

bool page_writer::make_writable(std::size_t b, std::size_t index, undo_log& undo) {
  const ref_ptr<block>& current = table_->entry(b);
  if (current && writable_in_place(*current, index)) return true;
  ref_ptr<block> fresh = block::make(*pool_, next_epoch_);
  if (!fresh) return false;
  if (current && current != zero_block_) {  // copy-on-write: a published epoch reads it
    const std::size_t floats = current->materialized() * config_.token_width();
    std::copy_n(current->keys(), floats, fresh->keys());
    std::copy_n(current->values(), floats, fresh->values());
    fresh->set_materialized(current->materialized());
  }
  ref_ptr<block>& slot = editable_entry(b);
  undo.emplace_back(b, std::exchange(slot, std::move(fresh)));
  return true;
}

bool page_writer::writable_in_place(const block& blk, std::size_t index) const noexcept {
  if (&blk == zero_block_.get()) return false;
  return blk.born_epoch() == next_epoch_ || index >= published_stored_;
}

const ref_ptr<block>& page_writer::zero_block() {
  if (!zero_block_) zero_block_ = block::make(*pool_, 0, block::budget::exempt, block::contents::zeroed);
  return zero_block_;
}

void page_writer::materialize(block& blk, std::size_t slots) noexcept {
  if (slots <= blk.materialized()) return;
  const std::size_t width = config_.token_width();
  std::fill(blk.keys() + blk.materialized() * width, blk.keys() + slots * width, 0.0f);
  std::fill(blk.values() + blk.materialized() * width, blk.values() + slots * width, 0.0f);
  blk.set_materialized(slots);
}

}  // namespace ghostlink::detail
