#pragma once
// The constructors' and checks' one way to throw a kv_errc.

#include <system_error>

#include "ghostlink/error.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// Throws `std::system_error` of `e` (`kv_category()`).
[[noreturn]] inline void throw_errc(kv_errc e) { throw std::system_error(make_error_code(e)); }

}  // namespace detail
GHOSTLINK_NAMESPACE_END
