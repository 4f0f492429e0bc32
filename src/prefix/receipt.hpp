#pragma once
// The receipts a prefix cache gives the values it puts (kv_store_receipt):
// how its store tells it which of its entries the tier below RAM holds.

#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <utility>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/block_store.hpp"
#include "ghostlink/types.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class prefix_index;

/// What every receipt of one index holds: the index until it goes. A store
/// may keep a receipt (and call it) long after the index is gone.
class store_link {
 public:
  explicit store_link(prefix_index* index) noexcept : index_(index) {}
  /// Calls `f(index)` under the link's lock, unless the index is gone.
  template <class F>
  void with(F&& f) noexcept {
    std::lock_guard lock(mutex_);
    if (index_) std::forward<F>(f)(*index_);
  }
  /// The index goes: no receipt calls it from now on.
  void cut() noexcept {
    std::lock_guard lock(mutex_);
    index_ = nullptr;
  }

 private:
  std::mutex mutex_;
  prefix_index* index_;
};

/// One entry's receipt: what its store-tier stored event carries.
class entry_receipt final : public kv_store_receipt {
 public:
  /// @throws std::bad_alloc
  entry_receipt(std::shared_ptr<store_link> link, const kv_block_hash& hash, std::optional<kv_block_hash> parent,
                std::span<const token_id> tokens)
      : link_(std::move(link)), hash_(hash), parent_(parent), tokens_(tokens.begin(), tokens.end()) {}
  void stored() noexcept override;
  void removed() noexcept override;

 private:
  std::shared_ptr<store_link> link_;
  kv_block_hash hash_;
  std::optional<kv_block_hash> parent_;
  std::vector<token_id> tokens_;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
