#pragma once
// Blocks: the memory of `block_tokens` tokens (their keys, and their
// values) of one cache, from a block_pool; and the layout that says where a
// token lives in one.
//
// A block's keys and its values are two separate runs of memory: a pool
// slices extents of blocks into [keys of every slot][values of every slot]
// (src/memory/block_pool.cpp), so the blocks one cache fills one after another
// lie next to each other, keys after keys and values after values, and a
// reader streams them as one run (stored_runs, src/core/epoch.cpp).
//
// Sharing: blocks may be shared by several caches (a fork shares all of its
// parent's) and held by a prefix cache. Only the cache that made a block
// (its owner) ever writes into it, and only at positions no published epoch
// of any cache reads and no prefix cache holds (see working_state.hpp).
//
// The reference count: the low 31 bits count the outside references
// (tables, epochs, forks); the top bit, `cached_bit`, stands for the hold of
// the pool's reclaimer, the prefix cache (however many of its entries
// reference the block). A release that leaves exactly `cached_bit` makes the
// block idle and tells the pool (block_pool::kept_block_idle), which tells
// the reclaimer; only the reclaimer, under its lock, hands out a new
// reference to an idle block (an attach), so its view of which blocks are
// idle is kept exact by those two events.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/config.hpp"
#include "ghostlink/detail/ref_ptr.hpp"
#include "ghostlink/element.hpp"
#include "memory/block_pool.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class block;

/// How one cache lays its tokens out in blocks. Computed once per cache
/// from its config and element type, never changed, and shared by its
/// working state, its forks and every epoch it publishes (so by every
/// snapshot): readers find a token from it alone, without touching the pool
/// or any counter.
struct block_layout : ref_counted<block_layout> {
  /// Keys and values of `config`'s width, or (`keys_only`) keys alone.
  block_layout(const kv_cache_config& config, element_codec codec, bool keys_only = false) noexcept
      : token_width(config.token_width()),
        value_width(keys_only ? 0 : token_width),
        block_tokens(config.block_tokens),
        token_bytes(codec.bytes(config.token_width())),
        value_token_bytes(codec.bytes(value_width)),
        half_bytes(block_tokens * token_bytes),
        block_bytes(half_bytes + block_tokens * value_token_bytes),
        codec(codec),
        key_scale(config.key_scale),
        value_scale(config.value_scale) {}
  static void destroy(block_layout* l) noexcept { delete l; }

  /// True when blocks hold keys alone (kv_block_kind::keys_only).
  bool keys_only() const noexcept { return value_width == 0; }
  /// True when `pool`'s blocks are of this layout's size and kind: a cache
  /// of this layout may take its blocks (whatever the bytes, a pool of keys
  /// alone fits only keys alone).
  bool fits(const block_pool& pool) const noexcept {
    return pool.payload_bytes() == block_bytes && pool.keys_only() == keys_only();
  }

  const std::size_t token_width;        // elements per token's keys
  const std::size_t value_width;        // elements per token's values: token_width, or 0 (keys only)
  const std::size_t block_tokens;       // tokens per block
  const std::size_t token_bytes;        // bytes of one token's keys
  const std::size_t value_token_bytes;  // bytes of one token's values: token_bytes, or 0
  const std::size_t half_bytes;         // a block's keys
  const std::size_t block_bytes;        // a block's payload: its keys and its values
  const element_codec codec;            // how floats are stored
  const float key_scale;                // what fp8 keys are divided by (1 for other types)
  const float value_scale;              // and values

  std::byte* keys(block& b, std::size_t position = 0) const noexcept;
  std::byte* values(block& b, std::size_t position = 0) const noexcept;
  const std::byte* keys(const block& b, std::size_t position = 0) const noexcept;
  const std::byte* values(const block& b, std::size_t position = 0) const noexcept;
};

/// Where a block's header, keys and values go: a slot of one of a pool's
/// extents, memory of its own (`slot == standalone`), or the pool's
/// mapping of zeros that no one writes (`slot == zeros`).
struct block_memory {
  static constexpr std::uint8_t standalone = 0xff;
  static constexpr std::uint8_t zeros = 0xfe;
  void* header = nullptr;  // block::header_bytes, 64-byte aligned
  std::byte* keys = nullptr;
  std::byte* values = nullptr;
  std::uint8_t slot = standalone;
  explicit operator bool() const noexcept { return header != nullptr; }
};

/// The keys and the values of `block_tokens` tokens (each half
/// `block_layout::half_bytes`), and a one-cache-line header, from a
/// block_pool. A token's place in its block is its
/// *position* (`index % block_tokens`).
class block {
 public:
  /// The header's size: one cache line.
  static constexpr std::size_t header_bytes = 64;

  /// Whether a block counts against the pool's budget: every block does but
  /// a cache's shared zero block, so budgets count data blocks.
  enum class budget : bool { counted, exempt };

  /// A new block owned by `owner`, counted against the budget, its payload
  /// garbage (nothing materialized), or null when the pool's budget or
  /// memory is spent. Its budget comes from `account` if it has any left,
  /// else from the pool (evicting idle prefix-cache entries if the budget
  /// is spent). Its memory is the slot of `cursor`'s extent after the one
  /// `cursor` gave last, when that is free (see block_cursor).
  static ref_ptr<block> make(block_pool& pool, block_cursor& cursor, std::uint64_t owner,
                             block_account* account = nullptr) noexcept;
  /// A block of zeros owned by no cache, outside the budget, in memory of
  /// its own.
  static ref_ptr<block> make_zeros(block_pool& pool, std::size_t block_tokens) noexcept;

  // Reference counting (used by ref_ptr). The pool counts blocks crossing
  // between one reference and more: that is its `blocks_shared`.
  void add_ref() const noexcept;
  void release() const noexcept;

  std::byte* keys() noexcept { return keys_; }
  std::byte* values() noexcept { return values_; }
  const std::byte* keys() const noexcept { return keys_; }
  const std::byte* values() const noexcept { return values_; }
  /// Its slot in its pool's extent, or block_memory::standalone or zeros.
  std::uint8_t slot() const noexcept { return slot_; }
  /// Whether `next` is in the slot after this one's in the same extent, so
  /// that its keys and values lie right after this block's: the only
  /// block whose header is the next 64 bytes (an extent's headers are an
  /// array followed by no block; a standalone block's by its payload; a
  /// block of the pool's zeros' by the rest of its own allocation).
  bool followed_by(const block& next) const noexcept {
    return reinterpret_cast<const std::byte*>(&next) == reinterpret_cast<const std::byte*>(this) + header_bytes;
  }

  block_pool& pool() const noexcept { return *pool_; }
  /// The cache that made this block and alone may write into it; 0 for the
  /// zero block, which no one writes.
  std::uint64_t owner() const noexcept { return owner_; }

  /// The owner's alone, on its strand: positions [0, materialized()) hold
  /// the owner's current tokens (written, or zeros where skipped).
  std::size_t materialized() const noexcept { return materialized_; }
  void set_materialized(std::size_t positions) noexcept { materialized_ = positions; }
  /// The owner's alone, on its strand: no published epoch of any cache
  /// reads positions at or past readable(), so the owner may write them in
  /// place.
  std::size_t readable() const noexcept { return readable_; }
  void set_readable(std::size_t positions) noexcept { readable_ = positions; }
  /// A block filled whole before any cache sees it (a load, a store's
  /// value, zeros): every one of its `positions` materialized and readable.
  void set_filled(std::size_t positions) noexcept { materialized_ = readable_ = positions; }
  /// The owner's alone, on its strand: the number of the first epoch
  /// published after the last truncate that cut into this block. Epochs
  /// from it on read no position at or past materialized(); only older ones
  /// may read [materialized(), readable()).
  std::uint64_t rewound_epoch() const noexcept { return rewound_epoch_; }
  void set_rewound_epoch(std::uint64_t number) noexcept { rewound_epoch_ = number; }
  /// References held now, the prefix cache's hold counted as one. Acquire:
  /// once it reads 1, every use by a holder that has let go happens-before
  /// what the caller does next.
  std::uint32_t references() const noexcept {
    const std::uint32_t word = refs_.load(std::memory_order_acquire);
    return (word & outside_mask) + ((word & cached_bit) != 0 ? 1u : 0u);
  }

  // The reclaimer's hold (src/prefix/index.cpp, under its lock).
  static constexpr std::uint32_t cached_bit = std::uint32_t{1} << 31;
  static constexpr std::uint32_t outside_mask = cached_bit - 1;
  /// Outside references now (the prefix cache's hold aside).
  std::uint32_t outside_references() const noexcept { return refs_.load(std::memory_order_acquire) & outside_mask; }
  /// The prefix cache starts holding the block (it holds none yet).
  void set_cached() const noexcept { refs_.fetch_add(cached_bit, std::memory_order_acq_rel); }
  /// The prefix cache lets go; the block is freed if nothing else holds it.
  void drop_cached() const noexcept {
    if (refs_.fetch_sub(cached_bit, std::memory_order_acq_rel) == cached_bit) destroy();
  }
  bool counted() const noexcept { return budget_ == budget::counted; }

 private:
  block(block_pool& pool, std::uint64_t owner, budget b, const block_memory& memory) noexcept;
  ~block() = default;
  void destroy() const noexcept;

  mutable std::atomic<std::uint32_t> refs_{1};
  const budget budget_;
  const std::uint8_t slot_;
  ref_ptr<block_pool> pool_;
  const std::uint64_t owner_;
  std::byte* const keys_;
  std::byte* const values_;
  std::size_t materialized_ = 0;
  std::size_t readable_ = 0;
  std::uint64_t rewound_epoch_ = 0;
};

inline std::byte* block_layout::keys(block& b, std::size_t position) const noexcept {
  return b.keys() + position * token_bytes;
}
inline std::byte* block_layout::values(block& b, std::size_t position) const noexcept {
  return b.values() + position * value_token_bytes;
}
inline const std::byte* block_layout::keys(const block& b, std::size_t position) const noexcept {
  return b.keys() + position * token_bytes;
}
inline const std::byte* block_layout::values(const block& b, std::size_t position) const noexcept {
  return b.values() + position * value_token_bytes;
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
