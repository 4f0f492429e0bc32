#include "core/epoch.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <new>
#include "ghostlink/detail/flavour.hpp"

#include "base/fault_countdown.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

std::atomic<std::size_t>& metadata_countdown() noexcept {
  static std::atomic<std::size_t> countdown{0};
  return countdown;
}

void* metadata_new(std::size_t size) {
  if (count_down(metadata_countdown()) == 1) throw std::bad_alloc();  // the one the countdown reaches fails
  return ::operator new(size);
}

void epoch_registry::add(epoch* e) noexcept {
  std::lock_guard lock(mutex_);
  e->older = newest_;
  (newest_ ? newest_->newer : oldest_) = e;
  newest_ = e;
  ++count_;
}

void epoch_registry::remove(epoch* e) noexcept {
  std::lock_guard lock(mutex_);
  (e->older ? e->older->newer : oldest_) = e->newer;
  (e->newer ? e->newer->older : newest_) = e->older;
  --count_;
}

epoch_registry::reading epoch_registry::read() const noexcept {
  std::lock_guard lock(mutex_);
  return {count_, oldest_ ? oldest_->number : 0};
}

std::size_t stored_runs(const epoch& e, std::size_t first, std::size_t end, std::span<stored_run> out) noexcept {
  const block_layout& layout = *e.layout;
  const std::size_t bt = layout.block_tokens;
  std::size_t n = 0;
  // The stored tokens: a run per stretch of table blocks each of which is
  // the block right after the one before (one extent), told from the
  // pointers alone. Chunk by chunk, a compare per block: the processor
  // reads ahead through the chunks' lines rather than waiting on each.
  if (const std::size_t stored_end = std::min(end, e.stored); first < stored_end) {
    const block_table& table = *e.table;
    std::size_t b = first / bt;
    const std::size_t last = (stored_end - 1) / bt;
    const block* prev = table.block_at(b).get();
    const std::size_t position = first - b * bt;
    stored_run r{first, 0, layout.keys(*prev, position), layout.values(*prev, position)};
    for (++b; b <= last;) {
      const std::size_t chunk = b / table_chunk::size;
      const ref_ptr<block>* blocks = table.chunks[chunk]->blocks.data();
      const std::size_t chunk_end = std::min(last + 1, (chunk + 1) * table_chunk::size);
      for (; b < chunk_end; ++b) {
        const block* next = blocks[b - chunk * table_chunk::size].get();
        if (!prev->followed_by(*next)) {
          r.count = b * bt - r.first;
          out[n++] = r;
          if (n == out.size()) return n;
          r = {b * bt, 0, layout.keys(*next), layout.values(*next)};
        }
        prev = next;
      }
    }
    r.count = stored_end - r.first;
    out[n++] = r;
    first = stored_end;
  }
  // Past them: the block of zeros, up to a block's worth at a time.
  while (first < end && n < out.size()) {
    const std::size_t position = first % bt;
    const std::size_t count = std::min(end - first, bt - position);
    out[n++] = {first, count, layout.keys(*e.zeros, position), layout.values(*e.zeros, position)};
    first += count;
  }
  return n;
}

void unpin(const epoch& e) noexcept {
  if (e.registry) e.registry->snapshot_closed();
  e.release();
}

const block* layer_blocks::whole_block(std::size_t b) const noexcept {
  const std::size_t bt = layout->block_tokens;
  if (stored < (b + 1) * bt || b >= table->blocks) return nullptr;
  const block* blk = table->block_at(b).get();
  if (!blk || !blk->counted()) return nullptr;  // dropped, or the zero block
  // A windowed layer's block with a position past the sinks and before
  // kept_from: that position is not the layer's any more.
  if (window != 0 && (b + 1) * bt > sinks && std::max(b * bt, sinks) < kept_from) return nullptr;
  return blk;
}

token_id layer_blocks::stored_id(std::size_t i) const noexcept {
  const std::size_t bt = layout->block_tokens;
  if (i >= stored) return no_token_id;
  const block* blk = table->block_at(i / bt).get();
  if (!blk) return no_token_id;
  float bits = 0;
  std::memcpy(&bits, layout->keys(*blk, i % bt), sizeof bits);
  return std::bit_cast<token_id>(bits);
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
