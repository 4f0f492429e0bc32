#pragma once
// arena: one block of memory, written once, that each implementation of a
// scenario takes its large buffers from in turn (ghostlink's pool through
// kv_pool_limits::memory, a lock baseline's buffers as std::pmr vectors),
// so that both run on the same physical pages. On a virtual machine where
// memory placed at different times streams at different speeds (up to 13%
// apart here, docs/PERFORMANCE.md), this keeps placement out of a ratio.

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <memory_resource>
#include <mutex>

#include <ghostlink/kv_cache.hpp>

namespace ghostlink::bench {

class arena {
 public:
  /// `bytes` of memory, every page written.
  explicit arena(std::size_t bytes) : bytes_(bytes), memory_(new std::byte[bytes]) {
    std::memset(memory_.get(), 0, bytes);
  }

  /// A resource handing out the arena from its start, thread-safe, never
  /// reusing what it gave (deallocation does nothing) and throwing
  /// std::bad_alloc past the end. One at a time: each starts over.
  class resource final : public std::pmr::memory_resource {
   public:
    explicit resource(arena& a) : buffer_(a.memory_.get(), a.bytes_, std::pmr::null_memory_resource()) {}

   private:
    void* do_allocate(std::size_t bytes, std::size_t alignment) override {
      const std::lock_guard lock(mutex_);
      return buffer_.allocate(bytes, alignment);
    }
    void do_deallocate(void*, std::size_t, std::size_t) override {}
    bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override { return this == &other; }

    std::mutex mutex_;
    std::pmr::monotonic_buffer_resource buffer_;
  };

 private:
  std::size_t bytes_;
  std::unique_ptr<std::byte[]> memory_;
};

/// Blocks a ghostlink pool preallocates for `caches` caches of `c`, as the
/// lock baseline allocates each buffer at its longest before the clock
/// starts: every cache's blocks at `max_tokens_per_seq`, plus the extent
/// each one fills (of `extent_blocks`: the pool's blocks_per_extent()).
inline std::size_t preallocated_blocks(const kv_cache_config& c, std::size_t caches,
                                       std::size_t extent_blocks = kv_block_pool::extent_blocks) {
  return caches * ((c.max_tokens_per_seq + c.block_tokens - 1) / c.block_tokens + extent_blocks);
}

/// Bytes of an arena that holds either side in turn: ghostlink's pool of
/// preallocated_blocks(c, caches) (whole extents with their headers, and
/// each cache's block of zeros) or the baseline's two buffers of
/// `max_tokens_per_seq` tokens per cache; with room to spare.
inline std::size_t arena_bytes(const kv_cache_config& c, std::size_t caches) {
  const std::size_t block = kv_block_pool::block_bytes_for(c), page = 4096;
  const std::size_t extents = preallocated_blocks(c, caches) / kv_block_pool::extent_blocks + 1;
  const std::size_t pool = extents * (kv_block_pool::extent_blocks * block + page) + caches * (block + page);
  const std::size_t buffers = caches * 2 * (c.max_tokens_per_seq * c.token_width() * sizeof(float) + page);
  return std::max(pool, buffers) / 16 * 17 + (std::size_t{64} << 20);
}

}  // namespace ghostlink::bench
