// The store tier of a prefix cache's events: the entries this cache put
// that its store says it holds (prefix_index::stored_), as the receipts
// tell (prefix/receipt.hpp), and as fetches that miss correct.

#include <algorithm>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <utility>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "prefix/index.hpp"
#include "prefix/receipt.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

void entry_receipt::stored() noexcept {
  // At most once: the ids move to the index (no copy under the store's lock).
  link_->with([this](prefix_index& p) { p.store_has(hash_, parent_, std::move(tokens_)); });
}

void entry_receipt::removed() noexcept {
  link_->with([this](prefix_index& p) { p.store_lost(hash_); });
}

std::shared_ptr<kv_store_receipt> prefix_index::receipt(const kv_block_hash& hash,
                                                        const std::optional<kv_block_hash>& parent,
                                                        std::span<const token_id> tokens) const noexcept {
  try {
    return std::make_shared<entry_receipt>(link_, hash, parent, tokens);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}

std::shared_ptr<kv_store_receipt> prefix_index::receipt(std::span<const kv_block_hash> chain,
                                                        std::span<const token_id> tokens,
                                                        std::size_t i) const noexcept {
  const std::size_t bt = config_.block_tokens;
  const std::span<const token_id> own =
      tokens.size() >= (i + 1) * bt ? tokens.subspan(i * bt, bt) : std::span<const token_id>();
  return receipt(chain[i], i == 0 ? std::nullopt : std::optional(chain[i - 1]), own);
}

void prefix_index::store_has(const kv_block_hash& hash, const std::optional<kv_block_hash>& parent,
                             std::vector<token_id> tokens) noexcept {
  std::lock_guard lock(mutex_);
  try {
    stored_entry& s = stored_.try_emplace(hash).first->second;  // a throw changes nothing
    if (s.receipts++ != 0) return;
    s.parent = parent;
    s.tokens = std::move(tokens);
    emit(kv_prefix_event::kind::stored, hash, parent ? &*parent : nullptr, kv_retention::default_value,
         s.tokens.empty() ? nullptr : s.tokens.data(), kv_prefix_tier::store);
  } catch (const std::bad_alloc&) {  // not known to be there: a router misses it, never sees one not there
  }
}

void prefix_index::store_lost(const kv_block_hash& hash) noexcept {
  std::lock_guard lock(mutex_);
  if (auto it = stored_.find(hash); it != stored_.end() && --it->second.receipts == 0) forget_stored(it);
}

void prefix_index::store_missed(const kv_block_hash& hash) noexcept {
  std::lock_guard lock(mutex_);
  if (auto it = stored_.find(hash); it != stored_.end()) forget_stored(it);
}

void prefix_index::forget_stored(stored_map::iterator it) noexcept {
  const kv_block_hash hash = it->first;
  stored_.erase(it);
  emit(kv_prefix_event::kind::removed, hash, nullptr, kv_retention::default_value, nullptr, kv_prefix_tier::store);
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
