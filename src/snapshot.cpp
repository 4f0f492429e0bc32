#include "ghostlink/snapshot.hpp"

#include <algorithm>

namespace ghostlink {

std::error_code kv_snapshot::read_kv(std::size_t index, std::span<float> keys_out,
                                     std::span<float> values_out) const {
  if (index >= size()) return kv_errc::index_out_of_range;
  return read_range(index, index + 1, keys_out, values_out);
}

std::error_code kv_snapshot::read_range(std::size_t begin, std::size_t end, std::span<float> keys_out,
                                        std::span<float> values_out) const {
  if (std::error_code ec = check_range(begin, end)) return ec;
  const std::size_t floats = (end - begin) * token_width();
  if (keys_out.size() < floats || values_out.size() < floats) return kv_errc::buffer_too_small;
  const std::size_t width = token_width();
  return for_each_block(begin, end, [&](std::size_t first, std::size_t, auto keys, auto values) {
    const std::size_t at = (first - begin) * width;
    std::copy(keys.begin(), keys.end(), keys_out.begin() + static_cast<std::ptrdiff_t>(at));
    std::copy(values.begin(), values.end(), values_out.begin() + static_cast<std::ptrdiff_t>(at));
  });
}

std::error_code kv_snapshot::read_kv(std::size_t index, kv_entry& out) const {
  out = {};
  if (index >= size()) return kv_errc::index_out_of_range;
  out.keys.resize(token_width());
  out.values.resize(token_width());
  return read_kv(index, out.keys, out.values);
}

std::error_code kv_snapshot::read_range(std::size_t begin, std::size_t end, kv_range& out) const {
  out = {begin, end, {}, {}};
  if (std::error_code ec = check_range(begin, end)) return ec;
  out.keys.resize((end - begin) * token_width());
  out.values.resize(out.keys.size());
  return read_range(begin, end, out.keys, out.values);
}

}  // namespace ghostlink
