#pragma once
// A store value of given bytes, for the tests that put straight to a store
// (the file store's limits, the Redis store and cluster).

#include <ghostlink/block_store.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

namespace ghostlink::test {

/// `bytes` under `hash`, encoded as they are.
class bytes_value final : public kv_store_value {
 public:
  bytes_value(const kv_block_hash& hash, std::vector<std::byte> bytes) : hash_(hash), bytes_(std::move(bytes)) {}
  const kv_block_hash& hash() const noexcept override { return hash_; }
  std::size_t size() const noexcept override { return bytes_.size(); }
  void encode(std::span<std::byte> out) const noexcept override {
    std::copy(bytes_.begin(), bytes_.end(), out.begin());
  }

 private:
  kv_block_hash hash_;
  std::vector<std::byte> bytes_;
};

}  // namespace ghostlink::test
