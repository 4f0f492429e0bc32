#pragma once
// Little-endian integers in byte buffers: every on-disk and on-wire layout
// of ghostlink (docs/FORMAT.md) writes its fixed fields this way.

#include <cstddef>

#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// Writes `v` little-endian at `at`.
template <class U>
void put_le(std::byte* at, U v) noexcept {
  for (std::size_t i = 0; i < sizeof(U); ++i) at[i] = static_cast<std::byte>((v >> (8 * i)) & 0xffu);
}
/// Reads a little-endian `U` at `at`.
template <class U>
U get_le(const std::byte* at) noexcept {
  U v = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) v |= static_cast<U>(std::to_integer<unsigned>(at[i])) << (8 * i);
  return v;
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
