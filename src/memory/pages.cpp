#include "memory/pages.hpp"
#include "ghostlink/detail/flavour.hpp"

#include <cstdint>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#define GHOSTLINK_PAGES 1
#endif

GHOSTLINK_NAMESPACE_BEGIN
namespace detail::pages {

#if GHOSTLINK_PAGES

bool supported() noexcept { return true; }

std::size_t size() noexcept {
  static const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

void* reserve(std::size_t bytes) noexcept {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return nullptr;
#ifdef MADV_NOHUGEPAGE
  ::madvise(p, bytes, MADV_NOHUGEPAGE);  // advice: where it is refused, pages are what the system gives
#endif
  return p;
}

void* reserve_zeros(std::size_t bytes) noexcept {
  void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void unreserve(void* p, std::size_t bytes) noexcept { ::munmap(p, bytes); }

void release(void* p, std::size_t bytes) noexcept {
  const auto begin = reinterpret_cast<std::uintptr_t>(p), end = begin + bytes;
  const std::uintptr_t first = (begin + size() - 1) / size() * size(), last = end / size() * size();
  // MADV_DONTNEED on private anonymous memory: the pages read as zeros
  // next, and are memory again only once written.
  if (first < last) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

std::size_t resident(const void* p, std::size_t bytes) noexcept {
  const auto begin = reinterpret_cast<std::uintptr_t>(p) / size() * size();
  const std::size_t n = (reinterpret_cast<std::uintptr_t>(p) + bytes - begin + size() - 1) / size();
  try {
    std::vector<unsigned char> in(n);
    if (::mincore(reinterpret_cast<void*>(begin), n * size(), in.data()) != 0) return 0;
    std::size_t pages = 0;
    for (unsigned char c : in) pages += c & 1u;
    return pages * size();
  } catch (...) {
    return 0;
  }
}

#else

bool supported() noexcept { return false; }
std::size_t size() noexcept { return 4096; }
void* reserve(std::size_t) noexcept { return nullptr; }
void* reserve_zeros(std::size_t) noexcept { return nullptr; }
void unreserve(void*, std::size_t) noexcept {}
void release(void*, std::size_t) noexcept {}
std::size_t resident(const void*, std::size_t) noexcept { return 0; }

#endif

}  // namespace detail::pages
GHOSTLINK_NAMESPACE_END
