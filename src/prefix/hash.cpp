// The prefix cache's block hash: OpenSSL's SHA-256 over the definition in
// ghostlink/prefix_cache.hpp.

#include <openssl/evp.h>
#include "ghostlink/detail/flavour.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "io/bytes.hpp"
#include "prefix/index.hpp"

GHOSTLINK_NAMESPACE_BEGIN

std::string kv_block_hash::hex() const {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s(2 * bytes.size(), '0');
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    s[2 * i] = digits[bytes[i] >> 4];
    s[2 * i + 1] = digits[bytes[i] & 0xf];
  }
  return s;
}

GHOSTLINK_NAMESPACE_END

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

/// SHA-256 through one reused OpenSSL context per thread, with the
/// algorithm fetched once (an implicit fetch per digest costs more than a
/// 96-byte digest).
class sha256 {
 public:
  sha256() : ctx_(EVP_MD_CTX_new()) {
    if (!ctx_) throw std::bad_alloc();
  }
  ~sha256() { EVP_MD_CTX_free(ctx_); }
  sha256(const sha256&) = delete;
  sha256& operator=(const sha256&) = delete;

  static sha256& for_this_thread() {
    thread_local sha256 h;
    return h;
  }
  void begin() {
    if (EVP_DigestInit_ex2(ctx_, algorithm(), nullptr) != 1) throw std::bad_alloc();
  }
  void add(const void* data, std::size_t n) { EVP_DigestUpdate(ctx_, data, n); }
  kv_block_hash end() {
    kv_block_hash h;
    unsigned int n = 0;
    EVP_DigestFinal_ex(ctx_, h.bytes.data(), &n);
    return h;
  }

 private:
  static const EVP_MD* algorithm() {
    static const std::unique_ptr<EVP_MD, void (*)(EVP_MD*)> md(EVP_MD_fetch(nullptr, "SHA256", nullptr), &EVP_MD_free);
    if (!md) throw std::bad_alloc();
    return md.get();
  }
  EVP_MD_CTX* ctx_;
};

void add_u64(sha256& h, std::uint64_t v) {
  std::array<std::uint8_t, 8> le{};
  for (std::size_t i = 0; i < le.size(); ++i) le[i] = static_cast<std::uint8_t>(v >> (8 * i));
  h.add(le.data(), le.size());
}

}  // namespace

kv_block_hash root_hash(std::string_view model, std::string_view salt, const kv_model_layout& layout,
                        const kv_cache_config& c, std::uint8_t element) {
  static constexpr std::string_view tag = "ghostlink-prefix-v1";
  sha256& h = sha256::for_this_thread();
  h.begin();
  h.add(tag.data(), tag.size());
  add_u64(h, model.size());
  h.add(model.data(), model.size());
  add_u64(h, salt.size());
  h.add(salt.data(), salt.size());
  add_u64(h, layout.num_layers());
  add_u64(h, c.num_heads);
  add_u64(h, c.head_dim);
  add_u64(h, c.block_tokens);
  h.add(&element, 1);
  // An fp8 block's scales are part of what its bytes mean.
  if (element == element_code<fp8_e4m3>) {
    std::array<std::byte, 8> scales{};
    put_le<std::uint32_t>(scales.data(), std::bit_cast<std::uint32_t>(c.key_scale));
    put_le<std::uint32_t>(scales.data() + 4, std::bit_cast<std::uint32_t>(c.value_scale));
    h.add(scales.data(), scales.size());
  }
  // A layout other than full layers storing values: what each layer keeps.
  // (rollback_tokens changes nothing stored: not part of it).
  const bool full =
      std::all_of(layout.layers.begin(), layout.layers.end(), [](const kv_layer_layout& l) { return l.window == 0; });
  if (!full || layout.keys_only) {
    const auto keys_only = static_cast<std::uint8_t>(layout.keys_only ? 1 : 0);
    h.add(&keys_only, 1);
    for (const kv_layer_layout& l : layout.layers) {
      add_u64(h, l.window);
      add_u64(h, l.sink_tokens);
    }
  }
  return h.end();
}

kv_block_hash prefix_index::root(std::string_view salt) const {
  return salt.empty() ? unsalted_root_ : root_hash(model_, salt, layout(), config_, codec_.code);
}

namespace {

/// h[i] from h[i - 1] (`prev`) and block i's `tokens`, through `h` and the
/// scratch `buffer`: the previous hash, then the tokens as little-endian i32.
kv_block_hash chain_hash(sha256& h, std::vector<std::uint8_t>& buffer, const kv_block_hash& prev,
                         std::span<const token_id> tokens) {
  buffer.resize(32 + 4 * tokens.size());
  std::memcpy(buffer.data(), prev.bytes.data(), 32);
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(buffer.data() + 32, tokens.data(), 4 * tokens.size());
  } else {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const auto v = static_cast<std::uint32_t>(tokens[i]);
      for (std::size_t k = 0; k < 4; ++k) buffer[32 + 4 * i + k] = static_cast<std::uint8_t>(v >> (8 * k));
    }
  }
  h.begin();
  h.add(buffer.data(), buffer.size());
  return h.end();
}

}  // namespace

kv_block_hash prefix_index::next_hash(const kv_block_hash& prev, std::span<const token_id> tokens,
                                      std::vector<std::uint8_t>& scratch) {
  return chain_hash(sha256::for_this_thread(), scratch, prev, tokens);
}

std::vector<kv_block_hash> prefix_index::hashes(std::span<const token_id> tokens, std::string_view salt) const {
  const std::size_t bt = config_.block_tokens;
  const std::size_t n = tokens.size() / bt;
  std::vector<kv_block_hash> out;
  out.reserve(n);
  if (n == 0) return out;
  // One context and one buffer for every block (a thread-local lookup each
  // would cost about as much as a 96-byte digest's bookkeeping).
  sha256& h = sha256::for_this_thread();
  std::vector<std::uint8_t> buffer(32 + 4 * bt);
  kv_block_hash prev = root(salt);
  for (std::size_t b = 0; b < n; ++b) {
    prev = chain_hash(h, buffer, prev, tokens.subspan(b * bt, bt));
    out.push_back(prev);
  }
  return out;
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
