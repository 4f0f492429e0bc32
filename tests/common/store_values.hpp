#pragma once
// A store value of given bytes, for the tests that put straight to a store
// (the file store's limits, the Redis store and cluster), and a receipt that
// records what its store told it.

#include <ghostlink/block_store.hpp>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace ghostlink::test {

/// `bytes` under `hash`, encoded as they are, with `receipt` (null: none).
class bytes_value final : public kv_store_value {
 public:
  bytes_value(const kv_block_hash& hash, std::vector<std::byte> bytes,
              std::shared_ptr<kv_store_receipt> receipt = nullptr)
      : hash_(hash), bytes_(std::move(bytes)), receipt_(std::move(receipt)) {}
  const kv_block_hash& hash() const noexcept override { return hash_; }
  std::size_t size() const noexcept override { return bytes_.size(); }
  void encode(std::span<std::byte> out) const noexcept override {
    std::copy(bytes_.begin(), bytes_.end(), out.begin());
  }
  std::shared_ptr<kv_store_receipt> receipt() const noexcept override { return receipt_; }

 private:
  kv_block_hash hash_;
  std::vector<std::byte> bytes_;
  std::shared_ptr<kv_store_receipt> receipt_;
};

/// What the receipts of one test were told, in order: "stored NAME" and
/// "removed NAME".
struct receipt_log {
  std::mutex mutex;
  std::vector<std::string> lines;
  std::vector<std::string> get() {
    std::lock_guard lock(mutex);
    return lines;
  }
};

/// A receipt that writes what it is told to `log`, under `name`.
class logging_receipt final : public kv_store_receipt {
 public:
  logging_receipt(std::shared_ptr<receipt_log> log, std::string name) : log_(std::move(log)), name_(std::move(name)) {}
  void stored() noexcept override { add("stored "); }
  void removed() noexcept override { add("removed "); }

 private:
  void add(const char* what) noexcept {
    std::lock_guard lock(log_->mutex);
    log_->lines.push_back(what + name_);
  }
  std::shared_ptr<receipt_log> log_;
  std::string name_;
};

}  // namespace ghostlink::test
