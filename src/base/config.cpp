#include "ghostlink/config.hpp"
#include "ghostlink/detail/flavour.hpp"

#include <limits>
#include <ostream>
#include <system_error>

#include "ghostlink/error.hpp"

GHOSTLINK_NAMESPACE_BEGIN

namespace {

/// `n`, or "unlimited" for the default of a budget.
void print_limit(std::ostream& os, std::size_t n) {
  if (n == std::numeric_limits<std::size_t>::max())
    os << "unlimited";
  else
    os << n;
}

}  // namespace

std::ostream& operator<<(std::ostream& os, const kv_cache_config& c) {
  os << "{max_tokens_per_seq=" << c.max_tokens_per_seq << ", num_heads=" << c.num_heads << ", head_dim=" << c.head_dim
     << ", block_tokens=" << c.block_tokens << ", max_blocks=";
  print_limit(os, c.max_blocks);
  os << ", max_pending=";
  print_limit(os, c.max_pending);
  return os << ", key_scale=" << c.key_scale << ", value_scale=" << c.value_scale << '}';
}

namespace detail {

void validate(const kv_cache_config& c, std::size_t group_bytes, std::size_t group, bool scaled) {
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  const bool zero = c.max_tokens_per_seq == 0 || c.num_heads == 0 || c.head_dim == 0 || c.block_tokens == 0 ||
                    c.max_blocks == 0 || c.max_pending == 0;
  // A block holds 2 * block_tokens * token_width elements after a small
  // header; that many bytes, and a token index times the width, must not
  // overflow.
  constexpr std::size_t header_reserve = 4096;
  const bool overflow = zero || c.num_heads > max / c.head_dim ||
                        c.token_width() > (max - header_reserve) / (2 * group_bytes) / c.block_tokens ||
                        c.token_width() > max / c.max_tokens_per_seq;
  const bool bad_scale = !valid_scale(c.key_scale, scaled) || !valid_scale(c.value_scale, scaled);
  if (zero || overflow || c.head_dim % group != 0 || bad_scale)
    throw std::system_error(make_error_code(kv_errc::invalid_config));
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
