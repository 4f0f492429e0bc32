#include "core/working_state.hpp"
#include "ghostlink/detail/flavour.hpp"

#include <algorithm>
#include <cstring>
#include <new>
#include <ranges>

#include "ghostlink/error.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

/// The most chunks a page table may list: 2^31 blocks, 512 MiB of chunk
/// pointers. A write that would need more (a huge max_tokens_per_seq and an
/// index near it) fails with capacity_exhausted instead of asking the
/// allocator for an absurd table.
constexpr std::size_t max_table_chunks = std::size_t{1} << 26;

/// ceil(n / d), without overflow for any n.
std::size_t ceil_div(std::size_t n, std::size_t d) { return n / d + (n % d != 0); }

}  // namespace

working_state::working_state(const kv_cache_config& config, ref_ptr<const block_layout> layout,
                             ref_ptr<block_pool> pool, bool initialized, std::span<ref_ptr<block>> prefix)
    : config_(config),
      layout_(std::move(layout)),
      pool_(std::move(pool)),
      owner_(block_pool::new_owner_id()),
      table_(ref_ptr<block_table>::adopt(new block_table(0))),  // built for epoch 0
      size_(prefix.size() * config.block_tokens),
      stored_(size_),
      initialized_(initialized),
      changed_(!prefix.empty()) {
  // Another owner's blocks: never written here, so never sealed either.
  table_->chunks.reserve(ceil_div(prefix.size(), table_chunk::size));
  for (std::size_t b = 0; b < prefix.size(); ++b) {
    if (b % table_chunk::size == 0) table_->chunks.push_back(ref_ptr<table_chunk>::adopt(new table_chunk(0)));
    table_->chunks.back()->blocks[b % table_chunk::size] = std::move(prefix[b]);
  }
  table_->blocks = prefix.size();
}

working_state::working_state(const working_state& parent, std::uint64_t next_epoch)
    : config_(parent.config_),
      layout_(parent.layout_),
      pool_(parent.pool_),
      owner_(block_pool::new_owner_id()),
      table_(ref_ptr<block_table>::adopt(new block_table(next_epoch))),
      zero_block_(parent.zero_block_),
      layer_(parent.layer_),
      kept_from_(parent.kept_from_),
      dropped_to_(parent.dropped_to_),
      size_(parent.size_),
      stored_(parent.stored_),
      next_epoch_(next_epoch),
      initialized_(parent.initialized_),
      changed_(true) {
  if (zero_block_) registry_->set_zeros(zero_block_);
  // Chunks belong to one cache: copy each (sharing its blocks), so neither
  // side ever edits a chunk the other reads.
  const block_table& from = *parent.table_;
  table_->chunks.reserve(from.chunks.size());
  for (const ref_ptr<table_chunk>& chunk : from.chunks) {
    if (!chunk) {  // dropped
      table_->chunks.emplace_back();
      continue;
    }
    if (chunk == parent.zero_chunk_ && zero_chunk()) {
      table_->chunks.push_back(zero_chunk_);
      continue;
    }
    auto copy = ref_ptr<table_chunk>::adopt(new table_chunk(next_epoch));
    copy->blocks = chunk->blocks;
    table_->chunks.push_back(std::move(copy));
  }
  table_->blocks = from.blocks;
}

working_state::~working_state() { ::operator delete(spare_epoch_); }

ref_ptr<epoch> working_state::initial_epoch() { return publish(); }

std::unique_ptr<working_state> working_state::fork() {
  auto child = std::unique_ptr<working_state>(new working_state(*this, next_epoch_));
  seal();  // the child now reads every position this cache holds
  return child;
}

void working_state::prepare_epoch() {
  if (spare_epoch_) return;
  spare_epoch_ = registry_->take_spare_epoch();
  if (!spare_epoch_) spare_epoch_ = metadata_new(sizeof(epoch));
}

ref_ptr<epoch> working_state::publish() {
  seal();
  // ::operator new(sizeof(epoch)) memory, fresh or given back to the
  // registry by an earlier epoch (epoch::destroy).
  prepare_epoch();
  void* memory = std::exchange(spare_epoch_, nullptr);
  const window_view window{layer_.window, layer_.sink_tokens, kept_from_};
  auto e = ref_ptr<epoch>::adopt(
      ::new (memory) epoch(next_epoch_, size_, stored_, table_, zero_block_.get(), *layout_, registry_, window));
  ++next_epoch_;
  changed_ = false;
  return e;
}

void working_state::seal() noexcept {
  for (block* blk : touched_) blk->set_readable(std::max(blk->readable(), blk->materialized()));
  touched_.clear();
}

error_code working_state::validate(std::span<const kv_write> writes) const noexcept {
  const std::size_t width = config_.token_width();
  const bool keys_only = layout_->keys_only();  // then every write's values are empty
  for (const kv_write& w : writes) {
    if (w.values.size() != (keys_only ? 0 : w.keys.size())) return kv_errc::length_mismatch;
    if (w.keys.size() != width) return kv_errc::width_mismatch;
    if (w.index >= config_.max_tokens_per_seq) return kv_errc::index_out_of_range;
  }
  if (!writes.empty() && !initialized_) return kv_errc::not_initialized;
  return {};
}

error_code working_state::initialize(std::size_t size) {
  if (size == 0) return kv_errc::zero_length;
  size = std::min(size, config_.max_tokens_per_seq);
  if (size > size_) {
    if (!zero_block()) return kv_errc::capacity_exhausted;
    size_ = size;
    changed_ = true;
  }
  if (!initialized_) changed_ = initialized_ = true;
  return {};
}

error_code working_state::truncate(std::size_t size) {
  if (error_code ec = prepare_truncate(size)) return ec;
  cut(size);
  return {};
}

error_code working_state::prepare_truncate(std::size_t size) {
  if (size >= size_) return {};
  const std::size_t blocks = ceil_div(std::min(stored_, size), config_.block_tokens);
  if (blocks >= table_->blocks) return {};
  // Copy what a published epoch reads and cut() edits: the kept part of
  // the last kept chunk, or the list of chunks.
  const std::size_t chunk_end = std::min(table_->blocks, ceil_div(blocks, table_chunk::size) * table_chunk::size);
  try {
    if (blocks < chunk_end)
      editable_block(blocks);
    else
      own_table();
  } catch (const std::bad_alloc&) {
    return kv_errc::capacity_exhausted;
  }
  return {};
}

void working_state::cut(std::size_t size) noexcept {
  if (size >= size_) return;
  const std::size_t bt = config_.block_tokens;
  const std::size_t stored = std::min(stored_, size);
  const std::size_t blocks = ceil_div(stored, bt);
  if (blocks < table_->blocks) {
    // Drop the blocks past the new end of the last kept chunk; whole
    // chunks past it go with the list's tail. prepare_truncate() made both
    // editable: nothing here allocates.
    const std::size_t chunk_end = std::min(table_->blocks, ceil_div(blocks, table_chunk::size) * table_chunk::size);
    seal();  // touched blocks may be dropped below; none is touched again before the next seal
    for (std::size_t b = blocks; b < chunk_end; ++b) editable_block(b) = {};
    table_->chunks.resize(ceil_div(blocks, table_chunk::size));
    table_->blocks = blocks;
  }
  // The new last block's positions past `stored` no longer hold this
  // cache's tokens: make skipped positions there read as zeros if written
  // again.
  if (stored % bt != 0) {
    block* last = table_->block_at(blocks - 1).get();  // null: dropped (a window of 1 cut inside what it dropped)
    if (last && last->owner() == owner_ && last->materialized() > stored % bt) {
      last->set_materialized(stored % bt);
      last->set_rewound_epoch(next_epoch_);
    }
  }
  if (layer_.window != 0 && kept_from_ > size) {
    // Cut inside what the window dropped: the positions it dropped below
    // `size` stay dropped, the rest are gone; or, cut into the sinks,
    // nothing past them is held.
    dropped_to_ = std::min(dropped_to_, size / bt);
    kept_from_ = std::max(size, layer_.sink_tokens);
    if (size <= layer_.sink_tokens) {
      dropped_to_ = first_droppable();
      kept_from_ = layer_.sink_tokens;
    }
  }
  stored_ = stored;
  size_ = size;
  changed_ = true;
}

void working_state::use_layer_layout(const kv_layer_layout& l) noexcept {
  layer_ = l;
  kept_from_ = l.sink_tokens;
  dropped_to_ = first_droppable();
}

void working_state::restore_kept_from(std::size_t kept_from) noexcept {
  if (layer_.window == 0 || kept_from <= layer_.sink_tokens) return;
  kept_from_ = kept_from;
  dropped_to_ = std::max(first_droppable(), kept_from / config_.block_tokens);
}

std::size_t working_state::first_droppable() const noexcept {
  return ceil_div(layer_.sink_tokens, config_.block_tokens);
}

bool working_state::can_truncate(std::size_t n) const noexcept {
  if (layer_.window == 0) return true;
  // The positions past the sinks that a token at `n` attends: [need, n).
  const std::size_t need = std::max(layer_.sink_tokens, n + 1 > layer_.window ? n + 1 - layer_.window : 0);
  return need >= n || kept_from_ <= need;
}

void working_state::drop_before(std::size_t keep) noexcept {
  if (layer_.window == 0) return;
  const std::size_t bt = config_.block_tokens;
  const std::size_t end = std::min(keep / bt, table_->blocks);
  std::size_t b = std::max(dropped_to_, first_droppable());
  if (b >= end) return;
  try {
    seal();  // blocks touched since the last seal may go below
    own_table();
    while (b < end) {
      const std::size_t c = b / table_chunk::size, chunk_first = c * table_chunk::size;
      if (b == chunk_first && end >= chunk_first + table_chunk::size) {
        table_->chunks[c] = {};  // every block of it
        b += table_chunk::size;
      } else {
        if (table_->chunks[c]) editable_block(b) = {};
        ++b;
      }
      dropped_to_ = b;
      kept_from_ = std::max(kept_from_, b * bt);
      changed_ = true;
    }
  } catch (const std::bad_alloc&) {
    // Kept until a later publication drops them: nothing read changed.
  }
}

error_code working_state::set_aside(std::size_t index, std::size_t tokens) {
  set_aside_.clear();
  const std::size_t bt = config_.block_tokens;
  // A block that already holds position `index` and takes the write in
  // place needs no fresh one; every other block of [index, index + tokens)
  // is a fresh one (a copy or a new block). Nothing but that write reaches
  // the cache until then (its sequence is busy), and no epoch is published
  // in between unless this truncates: what is writable in place now still
  // is then. After a truncate, count conservatively.
  std::size_t first = index / bt;
  const std::size_t last = (index + tokens - 1) / bt;
  const std::size_t kept = std::min(stored_, index);
  if (index % bt != 0 && first < ceil_div(kept, bt) && size_ <= index) {
    const ref_ptr<block>& blk = table_->block_at(first);
    if (blk && writable_in_place(first, *blk, index % bt)) ++first;
  }
  // A write past a partial last block below `index` zero-fills it (a copy
  // if it is not writable in place): one more, to be safe.
  const bool gap = kept < index && kept % bt != 0;
  const std::size_t needed = last + 1 - first + (gap ? 1 : 0);
  try {
    if (!zero_chunk()) return kv_errc::capacity_exhausted;  // a table that grows takes whole zero chunks
    std::vector<ref_ptr<block>> fresh;
    fresh.reserve(needed);
    for (std::size_t i = 0; i < needed; ++i) {
      fresh.push_back(block::make(*pool_, cursor_, owner_, account_.get()));
      if (!fresh.back()) return kv_errc::capacity_exhausted;
    }
    std::reverse(fresh.begin(), fresh.end());  // taken from the back: the first made goes first
    if (error_code ec = truncate(index)) return ec;
    set_aside_ = std::move(fresh);
  } catch (const std::bad_alloc&) {
    return kv_errc::capacity_exhausted;
  }
  return {};
}

ref_ptr<block> working_state::fresh_block() noexcept {
  if (set_aside_.empty()) return block::make(*pool_, cursor_, owner_, account_.get());
  ref_ptr<block> b = std::move(set_aside_.back());
  set_aside_.pop_back();
  return b;
}

error_code working_state::write(std::span<const kv_write> writes) {
  if (error_code ec = validate(writes)) return ec;
  if (writes.empty()) return {};

  std::size_t stored = stored_;
  for (const kv_write& w : writes) stored = std::max(stored, w.index + 1);
  if (!make_writable(writes, 0, 0, stored, writes.size())) return kv_errc::capacity_exhausted;

  // Phase 2: copy the data in. Cannot fail.
  const std::size_t bt = config_.block_tokens;
  const block_layout& layout = *layout_;
  for (const kv_write& w : writes) {
    block& blk = *table_->block_at(w.index / bt);
    const std::size_t position = w.index % bt;
    materialize(blk, position);
    layout.codec.store(w.keys, layout.keys(blk, position), layout.key_scale);
    layout.codec.store(w.values, layout.values(blk, position), layout.value_scale);
    blk.set_materialized(std::max(blk.materialized(), position + 1));
  }
  // Every position below the new stored size must read as its token: zero
  // what was skipped in the blocks this write touched and in the old last
  // block (prepare() made both writable; the zero block is all zeros).
  auto complete = [&](std::size_t b) {
    block& blk = *table_->block_at(b);
    if (&blk != zero_block_.get()) materialize(blk, std::min(bt, stored - b * bt));
  };
  if (stored > stored_ && stored_ % bt != 0) complete((stored_ - 1) / bt);
  for (const kv_write& w : writes) complete(w.index / bt);
  stored_ = stored;
  size_ = std::max(size_, stored);
  changed_ = true;
  return {};
}

bool working_state::make_writable(std::span<const kv_write> writes, std::size_t first, std::size_t end,
                                  std::size_t stored, std::size_t count) {
  const std::size_t old_blocks = table_->blocks;
  const std::size_t old_touched = touched_.size();
  // A one-token write (a decode step) or a one-block step replaces at most
  // two blocks: the old last one and its own. Its undo log is a member kept
  // between writes, so it allocates nothing; a batch gets one of its own,
  // freed after.
  undo_log batch_undo;
  undo_log& undo = count == 1 ? undo_ : batch_undo;
  bool ok = false;
  try {
    // So that recording an undo step or a touched block cannot throw.
    undo.reserve(count + 1);
    const std::size_t touches = touched_.size() + count + 1;
    if (touched_.capacity() < touches) touched_.reserve(std::max(touches, 2 * touched_.capacity()));
    ok = prepare(writes, first, end, stored, undo);
  } catch (const std::bad_alloc&) {
    ok = false;  // a table or chunk copy failed; what prepare() did so far is undone below
  }
  if (!ok) {
    // Put back what make_writable() replaced (the blocks it set are in private
    // chunks); blocks past old_blocks may stay null or the zero block.
    touched_.resize(old_touched);
    for (auto& [index, old] : std::ranges::reverse_view(undo)) editable_block(index) = std::move(old);
    if (table_->blocks != old_blocks) resize_table(old_blocks);
    undo.clear();
    return false;
  }
  set_aside_.clear();  // a set-aside serves one write
  // Blocks replaced by copies leave the table (and may be freed with the
  // undo log): forget them.
  for (const auto& replaced : undo) std::erase(touched_, replaced.second.get());
  undo.clear();
  return true;
}

error_code working_state::open(std::size_t first, std::size_t tokens) {
  const std::size_t bt = config_.block_tokens;
  const std::size_t end = first + tokens;
  const std::size_t first_block = first / bt;
  const std::size_t last_block = (end - 1) / bt;
  if (!make_writable({}, first, end, std::max(stored_, end), last_block + 1 - first_block))
    return kv_errc::capacity_exhausted;
  // The step writes every position of [first, end) before its commit
  // publishes them (or its end cuts them off again): count them as held.
  for (std::size_t b = first_block; b <= last_block; ++b) {
    block& blk = *table_->block_at(b);
    materialize(blk, first > b * bt ? first - b * bt : 0);
    blk.set_materialized(std::max(blk.materialized(), std::min(bt, end - b * bt)));
  }
  stored_ = std::max(stored_, end);
  size_ = std::max(size_, end);
  changed_ = true;
  return {};
}

namespace {

/// Copies tokens from `first` on (`keys.size()` / width of them), converted,
/// into the blocks `block_at(b)` returns, one run of a block's positions at
/// a time.
template <class BlockAt>
void copy_tokens(const block_layout& layout, BlockAt block_at, std::size_t first, std::span<const float> keys,
                 std::span<const float> values) noexcept {
  const std::size_t width = layout.token_width, value_width = layout.value_width, bt = layout.block_tokens;
  const std::size_t tokens = keys.size() / width;
  for (std::size_t t = 0; t < tokens;) {
    const std::size_t index = first + t, position = index % bt, n = std::min(bt - position, tokens - t);
    block& blk = block_at(index / bt);
    layout.codec.store(keys.subspan(t * width, n * width), layout.keys(blk, position), layout.key_scale);
    layout.codec.store(values.subspan(t * value_width, n * value_width), layout.values(blk, position),
                       layout.value_scale);
    t += n;
  }
}

}  // namespace

void working_state::store(std::size_t first, std::span<const float> keys, std::span<const float> values) noexcept {
  copy_tokens(
      *layout_, [&](std::size_t b) -> block& { return *table_->block_at(b); }, first, keys, values);
}

void working_state::store_step(const epoch& e, std::size_t first, std::span<const float> keys,
                               std::span<const float> values) noexcept {
  // The step's own positions (see open()): no epoch in a cell reads them.
  copy_tokens(
      *e.layout,
      [&](std::size_t b) -> block& {
        // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): the step's blocks, writable (see open())
        return const_cast<block&>(*e.table->block_at(b));
      },
      first, keys, values);
}

bool working_state::prepare(std::span<const kv_write> writes, std::size_t first, std::size_t end, std::size_t stored,
                            undo_log& undo) {
  const std::size_t bt = config_.block_tokens;
  const std::size_t old_blocks = table_->blocks;
  const std::size_t blocks = ceil_div(stored, bt);
  if (blocks > old_blocks && !resize_table(blocks)) return false;
  // The old last block gets zeros past stored_ if the write goes beyond it.
  if (stored > stored_ && stored_ % bt != 0) {
    const std::size_t last = (stored_ - 1) / bt;
    if (table_->block_at(last) != zero_block_ && !make_writable(last, stored_, undo)) return false;
  }
  for (const kv_write& w : writes)
    if (!make_writable(w.index / bt, w.index, undo)) return false;
  for (std::size_t b = first / bt; first < end && b <= (end - 1) / bt; ++b)
    if (!make_writable(b, std::max(first, b * bt), undo)) return false;
  // New blocks not written in the old last chunk (whole new chunks start
  // as zero chunks): nothing was written there, so they read as zeros.
  const std::size_t old_chunk_end = std::min(blocks, ceil_div(old_blocks, table_chunk::size) * table_chunk::size);
  for (std::size_t b = old_blocks; b < old_chunk_end; ++b) {
    if (table_->block_at(b)) continue;
    if (!zero_block()) return false;
    editable_block(b) = zero_block_;
  }
  return true;
}

void working_state::own_table() {
  if (table_->born_epoch == next_epoch_) return;
  auto copy = ref_ptr<block_table>::adopt(new block_table(next_epoch_));
  copy->chunks.reserve(table_->chunks.size() + 1);  // an append adds at most one chunk at a time
  copy->chunks = table_->chunks;
  copy->blocks = table_->blocks;
  table_ = std::move(copy);
}

bool working_state::resize_table(std::size_t blocks) {
  const std::size_t chunks = ceil_div(blocks, table_chunk::size);
  if (chunks > max_table_chunks) return false;
  if (chunks > table_->chunks.size() && !zero_chunk()) return false;
  own_table();
  table_->chunks.resize(chunks, zero_chunk_);  // throws std::bad_alloc before changing anything
  table_->blocks = blocks;
  return true;
}

const ref_ptr<table_chunk>& working_state::zero_chunk() {
  if (!zero_chunk_ && zero_block()) {
    zero_chunk_ = ref_ptr<table_chunk>::adopt(new table_chunk(0));  // born 0: never edited in place
    zero_chunk_->blocks.fill(zero_block_);
  }
  return zero_chunk_;
}

ref_ptr<block>& working_state::editable_block(std::size_t b) {
  own_table();
  ref_ptr<table_chunk>& chunk = table_->chunks[b / table_chunk::size];
  if (!chunk || chunk->born_epoch != next_epoch_ || chunk == zero_chunk_) {
    auto copy = ref_ptr<table_chunk>::adopt(new table_chunk(next_epoch_));
    if (chunk) copy->blocks = chunk->blocks;  // none: a chunk a window dropped whole
    chunk = std::move(copy);
  }
  return chunk->blocks[b % table_chunk::size];
}

bool working_state::make_writable(std::size_t b, std::size_t index, undo_log& undo) {
  const ref_ptr<block>& current = table_->block_at(b);
  if (current && writable_in_place(b, *current, index % config_.block_tokens)) {
    if (touched_.empty() || touched_.back() != current.get()) touched_.push_back(current.get());
    return true;
  }
  ref_ptr<block> fresh = fresh_block();
  if (!fresh) return false;
  // Copy-on-write: the tokens this cache holds in the block (another
  // owner's counters are not ours to read).
  const std::size_t first = b * config_.block_tokens;
  const std::size_t held = first < stored_ ? std::min(config_.block_tokens, stored_ - first) : 0;
  if (current && current != zero_block_ && held > 0) {
    std::memcpy(layout_->keys(*fresh), layout_->keys(*current), held * layout_->token_bytes);
    std::memcpy(layout_->values(*fresh), layout_->values(*current), held * layout_->value_token_bytes);
    pool_->count_cow_copy();
  }
  fresh->set_materialized(!current || current == zero_block_ ? 0 : held);  // null: dropped, zero-filled
  touched_.push_back(fresh.get());
  ref_ptr<block>& target = editable_block(b);
  undo.emplace_back(b, std::exchange(target, std::move(fresh)));
  return true;
}

bool working_state::writable_in_place(std::size_t b, const block& blk, std::size_t position) const noexcept {
  if (blk.owner() != owner_) return false;
  return position >= blk.readable() || rewritable_in_place(b, blk, position);
}

bool working_state::rewritable_in_place(std::size_t b, const block& blk, std::size_t position) const noexcept {
  if (position < blk.materialized() || blk.rewound_epoch() >= next_epoch_) return false;
  if (registry_->read().epochs_alive != 1) return false;  // an older epoch may read the position
  // The working table's chunk holds one reference; the latest epoch's holds
  // another only when the working chunk was copied since it was published.
  // Any more is a fork's or another holder's.
  const bool chunk_copied = table_->chunks[b / table_chunk::size]->born_epoch == next_epoch_;
  return blk.references() == (chunk_copied ? 2u : 1u);
}

const ref_ptr<block>& working_state::zero_block() {
  if (!zero_block_) {
    zero_block_ = block::make_zeros(*pool_, config_.block_tokens);
    if (zero_block_) registry_->set_zeros(zero_block_);
  }
  return zero_block_;
}

void working_state::materialize(block& blk, std::size_t positions) noexcept {
  if (positions <= blk.materialized()) return;
  const std::size_t tokens = positions - blk.materialized();
  std::memset(layout_->keys(blk, blk.materialized()), 0, tokens * layout_->token_bytes);
  std::memset(layout_->values(blk, blk.materialized()), 0, tokens * layout_->value_token_bytes);
  blk.set_materialized(positions);
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
