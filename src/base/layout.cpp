#include "ghostlink/layout.hpp"
#include "ghostlink/detail/flavour.hpp"

#include <algorithm>
#include <limits>
#include <ostream>
#include <system_error>

#include "ghostlink/error.hpp"

GHOSTLINK_NAMESPACE_BEGIN

kv_model_layout kv_model_layout::full(std::size_t num_layers) {
  return {.layers = std::vector<kv_layer_layout>(num_layers)};
}

kv_model_layout kv_model_layout::interleaved(std::size_t num_layers, std::size_t period, std::size_t window,
                                             std::size_t sink_tokens) {
  if (period == 0 || window == 0) throw std::system_error(make_error_code(kv_errc::invalid_config));
  kv_model_layout layout;
  layout.layers.reserve(num_layers);
  for (std::size_t i = 0; i < num_layers; ++i)
    layout.layers.push_back((i + 1) % period == 0 ? kv_layer_layout{} : kv_layer_layout{window, sink_tokens});
  return layout;
}

kv_model_layout kv_model_layout::sliding(std::size_t num_layers, std::size_t window, std::size_t sink_tokens) {
  if (window == 0) throw std::system_error(make_error_code(kv_errc::invalid_config));
  return {.layers = std::vector<kv_layer_layout>(num_layers, kv_layer_layout{window, sink_tokens})};
}

bool kv_model_layout::windowed() const noexcept {
  return std::ranges::any_of(layers, [](const kv_layer_layout& l) { return l.window != 0; });
}

std::ostream& operator<<(std::ostream& os, const kv_layer_layout& l) {
  return os << "{window=" << l.window << ", sink_tokens=" << l.sink_tokens << '}';
}

std::ostream& operator<<(std::ostream& os, const kv_model_layout& layout) {
  os << "{layers=[";
  for (std::size_t i = 0; i < layout.layers.size(); ++i) os << (i ? ", " : "") << layout.layers[i];
  return os << "], keys_only=" << layout.keys_only << ", rollback_tokens=" << layout.rollback_tokens << '}';
}

namespace detail {

void validate(const kv_model_layout& layout) {
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  bool bad = layout.layers.empty();
  for (const kv_layer_layout& l : layout.layers)
    bad = bad || (l.window == 0 && l.sink_tokens != 0) || l.window > max - layout.rollback_tokens;
  if (bad) throw std::system_error(make_error_code(kv_errc::invalid_config));
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
