// Prints block_hashes() for cases read from standard input, one per line:
//   <model hex> <salt hex> <layers> <heads> <head_dim> <block_tokens> <element 0-5> <key_scale> <value_scale>
//   <keys_only 0/1> <windows: "-" for full layers, else "W:S,W:S,..." one per layer> <t0,t1,...>
// (strings hex-encoded, so any byte may be in them; "-" for an empty one),
// as one line of space-separated hex digests each. check_hash.py computes
// the same from the definition with hashlib and compares.

#include <ghostlink/kv_cache.hpp>

#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string unhex(const std::string& s) {
  std::string out;
  if (s == "-") return out;
  for (std::size_t i = 0; i + 1 < s.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(s.substr(i, 2), nullptr, 16)));
  return out;
}

template <class T>
std::vector<ghostlink::kv_block_hash> hashes(const ghostlink::kv_model_layout& layout,
                                             const ghostlink::kv_cache_config& c, const std::string& model,
                                             const std::string& salt, const std::vector<ghostlink::token_id>& tokens) {
  const auto pool = ghostlink::kv_block_pool::for_caches<T>(
      c, layout.keys_only ? ghostlink::kv_block_kind::keys_only : ghostlink::kv_block_kind::keys_and_values);
  const ghostlink::basic_kv_prefix_cache<T> cache(layout, c, pool, {.model = model});
  return cache.block_hashes(tokens, salt);
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string model, salt, windows, list;
    std::size_t layers = 0, element = 0;
    int keys_only = 0;
    ghostlink::kv_cache_config c;
    in >> model >> salt >> layers >> c.num_heads >> c.head_dim >> c.block_tokens >> element >> c.key_scale >>
        c.value_scale >> keys_only >> windows >> list;
    ghostlink::kv_model_layout layout = ghostlink::kv_model_layout::full(layers);
    layout.keys_only = keys_only != 0;
    if (windows != "-") {
      std::istringstream each(windows);
      std::size_t l = 0;
      for (std::string item; std::getline(each, item, ',') && l < layers; ++l) {
        const std::size_t colon = item.find(':');
        layout.layers[l] = {std::stoul(item.substr(0, colon)), std::stoul(item.substr(colon + 1))};
      }
    }
    std::vector<ghostlink::token_id> tokens;
    std::istringstream items(list);
    for (std::string item; std::getline(items, item, ',');) tokens.push_back(std::stoi(item));
    const std::string m = unhex(model), s = unhex(salt);
    std::vector<ghostlink::kv_block_hash> h;
    switch (element) {
      case 0: h = hashes<float>(layout, c, m, s, tokens); break;
      case 1: h = hashes<ghostlink::half>(layout, c, m, s, tokens); break;
      case 2: h = hashes<ghostlink::bfloat16>(layout, c, m, s, tokens); break;
      case 3: h = hashes<ghostlink::q8_0>(layout, c, m, s, tokens); break;
      case 4: h = hashes<ghostlink::q4_0>(layout, c, m, s, tokens); break;
      default: h = hashes<ghostlink::fp8_e4m3>(layout, c, m, s, tokens); break;
    }
    for (std::size_t i = 0; i < h.size(); ++i) std::cout << (i ? " " : "") << h[i].hex();
    std::cout << '\n';
  }
  return 0;
}
