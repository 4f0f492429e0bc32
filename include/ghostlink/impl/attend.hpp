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
  const detail::window_view window{snapshot.window(), snapshot.sink_tokens(), snapshot.kept_from()};
  const bool keys_only = snapshot.token_width() != 0 && snapshot.value_width() == 0;
  if (auto ec = pass.begin(shape, snapshot.token_width(), snapshot.size(), pending, queries, out, window, keys_only,
                           {snapshot.key_scale(), snapshot.value_scale()}, elements_per<T>))
    return ec;
  const auto add = [&](std::size_t first, std::size_t count, std::span<const T> keys, std::span<const T> values) {
    pass.add(first, count, keys.data(), values.data());
  };
  // A windowed layer's sinks, then what its rows' windows reach; all else.
  const std::size_t size = snapshot.size(), from = std::min(pass.first_attended(), size);
  const std::size_t sinks = window.window != 0 ? std::min(window.sinks, from) : 0;
  (void)snapshot.for_each_block(0, sinks, add);
  (void)snapshot.for_each_block(std::max(sinks, from), size, add);
  pass.finish<T>();
  return {};
}

GHOSTLINK_NAMESPACE_END
