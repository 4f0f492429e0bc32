#pragma once
// arena: one block of memory, written once, that each implementation of a
// scenario takes its large buffers from in turn (ghostlink's pool through
// kv_pool_limits::memory, a lock baseline's buffers as std::pmr vectors),
// so that both run on the same physical pages. On a virtual machine where
// memory placed at different times streams at different speeds (up to 13%
// apart here, docs/PERFORMANCE.md), this keeps placement out of a ratio.

#include <cstddef>
#include <cstring>
#include <memory>
#include <memory_resource>
#include <mutex>

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

}  // namespace ghostlink::bench
