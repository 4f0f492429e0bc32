#pragma once
// Pages from the system, reserved before they are used: address space that
// costs no memory until a page of it is first written, and that can be
// given back a page at a time while the address stays reserved. What a
// pool made without a memory resource keeps its extents in
// (src/memory/block_pool.hpp).

#include <cstddef>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail::pages {

/// Whether this system reserves pages as this file says (Linux); where it
/// does not, pools take their extents from `operator new`, whole.
bool supported() noexcept;
/// The system's page size.
std::size_t size() noexcept;
/// `bytes` (a multiple of size()) of address space, readable and writable,
/// none of it memory until written; or null. Huge pages are not used: one
/// would make 2 MiB of memory out of a first write.
void* reserve(std::size_t bytes) noexcept;
/// `bytes` of address space that reads as zeros and can never be written
/// (it never becomes memory); or null.
void* reserve_zeros(std::size_t bytes) noexcept;
/// Gives back what reserve() or reserve_zeros() returned.
void unreserve(void* p, std::size_t bytes) noexcept;
/// Gives the memory of the whole pages inside [p, p + bytes) back to the
/// system; they read as zeros, and are memory again once written.
void release(void* p, std::size_t bytes) noexcept;
/// Bytes of the pages of [p, p + bytes) that are memory now (the kernel's
/// count: a test hook's).
std::size_t resident(const void* p, std::size_t bytes) noexcept;

}  // namespace detail::pages
GHOSTLINK_NAMESPACE_END
