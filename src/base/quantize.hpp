#pragma once
// The bulk quantizers behind detail::narrow() (element.hpp): portable code,
// and AVX2 code that gives the same bits (quantize_avx2.cpp), chosen once at
// run time. Both are named here so that the tests run the portable path on
// every machine and compare the two.

#include <cstddef>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/element.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

void narrow_portable(const float* src, std::size_t n, q8_0* dst) noexcept;
void narrow_portable(const float* src, std::size_t n, q4_0* dst) noexcept;
void narrow_portable(const float* src, std::size_t n, fp8_e4m3* dst, float scale) noexcept;

/// False where the processor lacks AVX2 (or this is no x86-64 build):
/// nothing is written then.
bool narrow_avx2(const float* src, std::size_t n, q8_0* dst) noexcept;
bool narrow_avx2(const float* src, std::size_t n, q4_0* dst) noexcept;
bool narrow_avx2(const float* src, std::size_t n, fp8_e4m3* dst, float scale) noexcept;

}  // namespace detail
GHOSTLINK_NAMESPACE_END
