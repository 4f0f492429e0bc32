// The store tier of a prefix cache's events: the entries this cache put
// that its store says it holds (prefix_index::stored_), as the receipts
// tell (prefix/receipt.hpp), and as fetches that miss correct.

#include <algorithm>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include "ghostlink/detail/flavour.hpp"

#include "prefix/index.hpp"
#include "prefix/receipt.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

void entry_receipt::stored() noexcept {
  link_->with([this](prefix_index& p) { p.store_has(hash_, parent_, tokens_); });
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
                             std::span<const token_id> tokens) noexcept {
  try {
    std::unique_ptr<token_id[]> own;  // allocated outside the lock
    if (tokens.size() == config_.block_tokens) {
      own = std::make_unique_for_overwrite<token_id[]>(tokens.size());
      std::ranges::copy(tokens, own.get());
    }
    std::lock_guard lock(mutex_);
    stored_entry& s = stored_.try_emplace(hash).first->second;  // a throw changes nothing
    if (s.receipts++ != 0) return;
    s.parent = parent;
    s.tokens = std::move(own);
    emit(kv_prefix_event::kind::stored, hash, parent ? &*parent : nullptr, kv_retention::default_value, s.tokens.get(),
         kv_prefix_tier::store);
  } catch (const std::bad_alloc&) {  // not known to be there: a router misses it, never sees one not there
  }
}

void prefix_index::store_lost(const kv_block_hash& hash) noexcept {
  std::lock_guard lock(mutex_);
  auto it = stored_.find(hash);
  if (it == stored_.end() || --it->second.receipts != 0) return;
  stored_.erase(it);
  emit(kv_prefix_event::kind::removed, hash, nullptr, kv_retention::default_value, nullptr, kv_prefix_tier::store);
}

void prefix_index::store_missed(const kv_block_hash& hash) noexcept {
  std::lock_guard lock(mutex_);
  if (stored_.erase(hash) == 0) return;
  emit(kv_prefix_event::kind::removed, hash, nullptr, kv_retention::default_value, nullptr, kv_prefix_tier::store);
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
