#pragma once
// A memory resource that counts what it hands out: for the tests of pools
// given one (kv_pool_limits::memory).

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory_resource>
#include <mutex>
#include <utility>

namespace ghostlink::test {

/// Memory from operator new's resource, counted, from any thread: what is
/// live, what was asked, and any allocation misaligned or given back with
/// another size or alignment than it was taken with.
class counting_resource final : public std::pmr::memory_resource {
 public:
  struct counts {
    std::size_t live_bytes = 0, allocations = 0, misaligned = 0, mismatched = 0;
  };
  counts read() const {
    const std::lock_guard lock(mutex_);
    return counts_;
  }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    void* p = std::pmr::new_delete_resource()->allocate(bytes, alignment);
    const std::lock_guard lock(mutex_);
    counts_.live_bytes += bytes;
    ++counts_.allocations;
    if (alignment < 64 || reinterpret_cast<std::uintptr_t>(p) % 64 != 0) ++counts_.misaligned;
    taken_[p] = {bytes, alignment};
    return p;
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) override {
    std::pair<std::size_t, std::size_t> taken{bytes, alignment};
    {
      const std::lock_guard lock(mutex_);
      const auto it = taken_.find(p);
      if (it == taken_.end() || it->second != taken) ++counts_.mismatched;
      if (it == taken_.end()) return;  // not ours: leave it
      taken = it->second;
      taken_.erase(it);
      counts_.live_bytes -= taken.first;
    }
    std::pmr::new_delete_resource()->deallocate(p, taken.first, taken.second);
  }
  bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override { return this == &other; }

  mutable std::mutex mutex_;
  counts counts_;
  std::map<void*, std::pair<std::size_t, std::size_t>> taken_;
};

}  // namespace ghostlink::test
