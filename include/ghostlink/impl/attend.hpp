#pragma once
// Template implementation of `attend` over a snapshot: the snapshot's runs
// handed to the kernel's pass in order.

#include <cstddef>
#include <span>
#include <system_error>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/attend.hpp"
#include "ghostlink/detail/attention_pass.hpp"

GHOSTLINK_NAMESPACE_BEGIN

template <storage_element T>
std::error_code attend(const basic_kv_snapshot<T>& snapshot, std::span<const float> queries, std::span<float> out,
                       const attention_shape& shape, pending_tokens pending) noexcept {
  detail::attention_pass pass;
  if (auto ec = pass.begin(shape, snapshot.token_width(), snapshot.size(), pending, queries, out)) return ec;
  (void)snapshot.for_each_block(0, snapshot.size(),
                                [&](std::size_t first, std::size_t count, std::span<const T> keys,
                                    std::span<const T> values) { pass.add(first, count, keys.data(), values.data()); });
  pass.finish<T>();
  return {};
}

GHOSTLINK_NAMESPACE_END
