#pragma once
// The checksums of what ghostlink writes (saved sequences, store entries):
// XXH3-64 with seed 0, from xxHash (docs/FORMAT.md).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// XXH3-64 (seed 0) of `bytes`.
std::uint64_t xxh3_64(std::span<const std::byte> bytes) noexcept;

/// XXH3-64 (seed 0) of bytes given in pieces.
class xxh3_stream {
 public:
  xxh3_stream();
  ~xxh3_stream();
  xxh3_stream(const xxh3_stream&) = delete;
  xxh3_stream& operator=(const xxh3_stream&) = delete;
  void update(std::span<const std::byte> bytes) noexcept;
  std::uint64_t digest() const noexcept;

 private:
  struct state;
  std::unique_ptr<state> state_;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
