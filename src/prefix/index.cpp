// The prefix cache's index: its entries, which of them are idle and
// evictable, and their eviction (invariants in index.hpp).

#include <algorithm>
#include <ranges>
#include <system_error>
#include <utility>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/error.hpp"
#include "prefix/index.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

prefix_index::prefix_index(std::size_t num_layers, const kv_cache_config& config, element_codec codec,
                           ref_ptr<block_pool> pool, std::string model, std::shared_ptr<kv_block_store> store,
                           kv_store_policy policy)
    : num_layers_(num_layers),
      config_(config),
      codec_(codec),
      pool_(std::move(pool)),
      model_(std::move(model)),
      unsalted_root_(root_hash(model_, {}, num_layers_, config_, codec_.code)),
      store_(std::move(store)),
      policy_(policy),
      geometry_(num_layers_, config_, codec_),
      halves_(2 * num_layers_) {
  if (!pool_->attach_reclaimer(this)) throw std::system_error(make_error_code(kv_errc::invalid_config));
  if (store_) store_->limit_value_size(geometry_.entry_bytes());
}

prefix_index::~prefix_index() {
  pool_->detach_reclaimer();  // waits for an eviction or idle report in progress
  std::lock_guard lock(mutex_);
  for (auto& [blk, node] : nodes_) blk->drop_cached();
  nodes_.clear();
  pool_->set_kept({});
}

std::size_t prefix_index::cached_run(std::span<const kv_block_hash> hashes) const noexcept {
  // Prefix-closed (an entry's parent is cached while it is, and h[i] names
  // h[i - 1] through SHA-256): whether h[i] is cached is monotone in i, so a
  // binary search finds the run with log2(n) lookups, not n.
  std::size_t lo = 0, hi = hashes.size();
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo + 1) / 2;
    if (entries_.contains(hashes[mid - 1]))
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

std::size_t prefix_index::match(std::span<const kv_block_hash> hashes) const noexcept {
  std::size_t found = 0;
  {
    std::lock_guard lock(mutex_);
    found = cached_run(hashes);
  }
  queries_.fetch_add(1, std::memory_order_relaxed);
  query_tokens_.fetch_add(hashes.size() * config_.block_tokens, std::memory_order_relaxed);
  hit_tokens_.fetch_add(found * config_.block_tokens, std::memory_order_relaxed);
  return found;
}

std::size_t prefix_index::take(std::span<const kv_block_hash> hashes, std::vector<std::vector<ref_ptr<block>>>& out) {
  // Room first: nothing may throw (and release a reference) under the lock.
  out.assign(num_layers_, {});
  for (auto& layer : out) layer.reserve(hashes.size());
  std::vector<prefix_entry*> matched;
  matched.reserve(hashes.size());
  std::lock_guard lock(mutex_);
  // The run's last entry, then its parents: one lookup in all.
  const std::size_t run = cached_run(hashes);
  matched.resize(run);
  prefix_entry* e = run == 0 ? nullptr : entries_.find(hashes[run - 1])->second.get();
  for (std::size_t i = run; i-- > 0; e = e->parent) matched[i] = e;
  // Later blocks count as used first, so a child is older than its parent.
  for (prefix_entry* e : std::views::reverse(matched)) touch(*e);
  for (prefix_entry* e : matched)
    for (std::size_t l = 0; l < num_layers_; ++l) {
      prefix_node& n = *e->nodes[l];
      // The attached layer never writes into it (another owner's), only refers to it.
      out[l].push_back(ref_ptr<block>::share(const_cast<block*>(n.blk)));
      if (!n.in_use) node_in_use(n);
    }
  publish_counts();
  queries_.fetch_add(1, std::memory_order_relaxed);
  query_tokens_.fetch_add(hashes.size() * config_.block_tokens, std::memory_order_relaxed);
  hit_tokens_.fetch_add(matched.size() * config_.block_tokens, std::memory_order_relaxed);
  return matched.size();
}

std::size_t prefix_index::insert(std::span<const kv_block_hash> hashes,
                                 std::span<const std::vector<const block*>> blocks, std::vector<std::size_t>* added,
                                 bool in_store) {
  std::vector<prefix_entry*> chain(hashes.size(), nullptr);
  std::vector<bool> is_new(hashes.size(), false);
  std::vector<kv_block_hash> created;
  created.reserve(hashes.size());
  std::vector<prefix_node*> created_nodes;
  created_nodes.reserve(hashes.size() * num_layers_);
  std::lock_guard lock(mutex_);
  // Phase 1, undone if anything cannot be allocated: the entries and nodes.
  try {
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      auto [it, fresh] = entries_.try_emplace(hashes[i]);
      if (!fresh) {
        chain[i] = it->second.get();
        continue;
      }
      created.push_back(hashes[i]);
      it->second = std::make_unique<prefix_entry>();
      prefix_entry& e = *it->second;
      e.hash = hashes[i];
      e.nodes.reserve(num_layers_);
      e.lru_node = lru_.extract(lru_.emplace(0, &e).first);
      chain[i] = &e;
      is_new[i] = true;
      for (std::size_t l = 0; l < num_layers_; ++l) {
        auto [pos, new_node] = nodes_.try_emplace(blocks[i][l]);
        prefix_node& n = pos->second;
        if (new_node) {
          n.blk = blocks[i][l];
          created_nodes.push_back(&n);
        }
        n.entries.push_back(&e);
        e.nodes.push_back(&n);
      }
    }
  } catch (const std::bad_alloc&) {
    for (const kv_block_hash& h : created) {
      auto it = entries_.find(h);
      if (it->second)
        for (prefix_node* n : it->second->nodes) std::erase(n->entries, it->second.get());
      entries_.erase(it);
    }
    for (prefix_node* n : created_nodes) nodes_.erase(n->blk);
    throw;
  }
  // Phase 2 allocates nothing.
  for (prefix_node* n : created_nodes) n->blk->set_cached();
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    if (!is_new[i]) continue;
    prefix_entry& e = *chain[i];
    e.in_store = in_store;
    if (added) added->push_back(i);  // room reserved by the caller
    e.parent = i == 0 ? nullptr : chain[i - 1];
    if (e.parent && e.parent->children++ == 0 && e.parent->in_lru()) lru_remove(*e.parent);
    // The caller holds every block, so every node is in use (an idle node's
    // block has no outside reference, and only an attach gives one out).
    e.in_use = e.nodes.size();
    refresh_pin(&e);
    emit(kv_prefix_event::kind::stored, e.hash, e.parent ? &e.parent->hash : nullptr);
  }
  for (std::size_t i = hashes.size(); i-- > 0;) touch(*chain[i]);
  inserted_.fetch_add(created.size(), std::memory_order_relaxed);
  publish_counts();
  return created.size();
}

void prefix_index::touch(prefix_entry& e) noexcept {
  const bool was = e.in_lru();
  if (was) lru_remove(e);
  e.tick = ++clock_;
  if (was) lru_add(e);
}

void prefix_index::node_in_use(prefix_node& n) noexcept {
  n.in_use = true;
  --idle_nodes_;
  for (prefix_entry* e : n.entries) {
    if (e->in_use++ == 0) entry_in_use(*e);
    refresh_pin(e);
  }
  refresh_node(n);
}

void prefix_index::refresh_pin(prefix_entry* e) noexcept {
  while (e) {
    const bool pinned = e->in_use > 0 || e->pinned_children > 0;
    if (pinned == e->pinned) return;
    e->pinned = pinned;
    for (prefix_node* n : e->nodes) refresh_node(*n);
    if (e->parent) {
      if (pinned)
        ++e->parent->pinned_children;
      else
        --e->parent->pinned_children;
    }
    e = e->parent;
  }
}

void prefix_index::refresh_node(prefix_node& n) noexcept {
  const bool reclaimable =
      !n.in_use && std::none_of(n.entries.begin(), n.entries.end(), [](const prefix_entry* e) { return e->pinned; });
  if (reclaimable == n.reclaimable) return;
  n.reclaimable = reclaimable;
  if (reclaimable)
    ++reclaimable_;
  else
    --reclaimable_;
}

void prefix_index::entry_in_use(prefix_entry& e) noexcept {
  --idle_entries_;
  if (e.in_lru()) lru_remove(e);
}

void prefix_index::entry_idle(prefix_entry& e) noexcept {
  ++idle_entries_;
  if (e.children == 0) lru_add(e);
}

void prefix_index::lru_add(prefix_entry& e) noexcept {
  e.lru_node.value() = {e.tick, &e};
  lru_.insert(std::move(e.lru_node));
}

void prefix_index::lru_remove(prefix_entry& e) noexcept { e.lru_node = lru_.extract(std::pair{e.tick, &e}); }

void prefix_index::block_idle(const block* b) noexcept {
  std::lock_guard lock(mutex_);
  auto it = nodes_.find(b);
  if (it == nodes_.end()) return;  // dropped meanwhile
  prefix_node& n = it->second;
  // A late report: the block may be in use again (an attach since).
  if (!n.in_use || n.blk->outside_references() != 0) return;
  n.in_use = false;
  ++idle_nodes_;
  for (prefix_entry* e : n.entries) {
    if (--e->in_use == 0) entry_idle(*e);
    refresh_pin(e);
  }
  refresh_node(n);
  publish_counts();
}

bool prefix_index::evict_one() noexcept {
  std::shared_ptr<copied_entry> written_back;
  handoff_tracker::ticket handoff;
  if (writes_back()) handoff = handing();  // until the put: a flush waits for it
  {
    std::lock_guard lock(mutex_);
    if (lru_.empty()) return false;
    prefix_entry& e = *lru_.begin()->second;
    lru_remove(e);
    if (writes_back() && !e.in_store) {
      // The copy is made here, as the blocks are about to be freed; memory
      // refused only loses the write-back.
      for (std::size_t l = 0; l < num_layers_; ++l) {
        halves_[2 * l] = e.nodes[l]->blk->keys();
        halves_[2 * l + 1] = e.nodes[l]->blk->values();
      }
      written_back = copied_entry::make(geometry_, e.hash, halves_);
    }
    const kv_block_hash hash = e.hash;
    remove(e);
    evicted_.fetch_add(1, std::memory_order_relaxed);
    emit(kv_prefix_event::kind::removed, hash, nullptr);
    publish_counts();
  }
  if (written_back) {
    store_->put(std::move(written_back));
    store_puts_.fetch_add(1, std::memory_order_relaxed);
  }
  return true;
}

void prefix_index::remove(prefix_entry& e) noexcept {
  if (e.parent && --e.parent->children == 0 && e.parent->in_use == 0) lru_add(*e.parent);
  if (e.in_use == 0) --idle_entries_;
  for (prefix_node* n : e.nodes) {
    std::erase(n->entries, &e);
    if (!n->entries.empty()) {
      refresh_node(*n);
      continue;
    }
    const block* blk = n->blk;
    if (!n->in_use) --idle_nodes_;
    if (n->reclaimable) --reclaimable_;
    nodes_.erase(blk);
    blk->drop_cached();  // frees it when idle
  }
  entries_.erase(e.hash);  // destroys e
}

bool prefix_index::collect_unstored(std::vector<kv_block_hash>& hashes, std::vector<std::vector<ref_ptr<block>>>& refs,
                                    bool pin) noexcept {
  try {
    hashes.reserve(entries_.size());
    refs.reserve(entries_.size());
    for (auto& [hash, entry] : entries_) {
      prefix_entry& e = *entry;
      if (e.in_store) continue;
      std::vector<ref_ptr<block>> held;
      held.reserve(num_layers_);  // the last allocation: a throw leaves nothing held
      for (prefix_node* n : e.nodes) {
        // As an attach's: the block never changes while cached.
        held.push_back(ref_ptr<block>::share(const_cast<block*>(n->blk)));
        if (pin && !n->in_use) node_in_use(*n);
      }
      e.in_store = true;
      hashes.push_back(hash);       // reserved: cannot throw
      refs.push_back(std::move(held));
    }
    return true;
  } catch (const std::bad_alloc&) {
    return false;
  }
}

std::size_t prefix_index::put_collected(std::span<const kv_block_hash> hashes,
                                        std::span<const std::vector<ref_ptr<block>>> refs,
                                        std::vector<std::shared_ptr<const kv_store_value>>& values) noexcept {
  std::size_t put = 0;
  try {
    values.reserve(hashes.size());
    for (; put < hashes.size(); ++put) {
      // A copy of the references: `refs` lets go of its own outside the locks.
      values.push_back(std::make_shared<held_entry>(geometry_, hashes[put], refs[put]));
      store_->put(values.back());
    }
  } catch (const std::bad_alloc&) {
  }
  store_puts_.fetch_add(put, std::memory_order_relaxed);
  return put;
}

bool prefix_index::flush() noexcept {
  if (!store_) return true;
  std::vector<kv_block_hash> hashes;
  std::vector<std::vector<ref_ptr<block>>> refs;  // let go of last, outside the lock
  std::vector<std::shared_ptr<const kv_store_value>> values;
  bool whole = false;
  std::size_t put = 0;
  {
    const auto handoff = handing();
    {
      std::lock_guard lock(mutex_);
      whole = collect_unstored(hashes, refs, true);
      publish_counts();
    }
    put = put_collected(hashes, refs, values);
  }
  if (put < hashes.size()) {
    whole = false;
    mark_unstored(std::span(hashes).subspan(put));
  }
  // The puts of other threads that took entries before this one looked
  // (a write-back, another flush, a clear()) have returned after this.
  handoffs_.wait_for_earlier();
  return whole;
}

void prefix_index::mark_unstored(std::span<const kv_block_hash> hashes) noexcept {
  std::lock_guard lock(mutex_);
  for (const kv_block_hash& h : hashes)
    if (auto it = entries_.find(h); it != entries_.end()) it->second->in_store = false;
}

void prefix_index::clear() noexcept {
  std::vector<kv_block_hash> hashes;
  std::vector<std::vector<ref_ptr<block>>> refs;  // let go of last, outside the lock
  std::vector<std::shared_ptr<const kv_store_value>> values;
  handoff_tracker::ticket handoff;
  if (store_) handoff = handing();
  {
    std::lock_guard lock(mutex_);
    // Every entry leaves RAM here: those not in the store yet go to it,
    // holding their blocks (no copy) until it has written them.
    if (store_) collect_unstored(hashes, refs, false);
    lru_.clear();
    for (auto& [blk, node] : nodes_) blk->drop_cached();
    nodes_.clear();
    entries_.clear();
    idle_nodes_ = idle_entries_ = reclaimable_ = 0;
    emit(kv_prefix_event::kind::cleared, {}, nullptr);
    publish_counts();
  }
  if (store_) put_collected(hashes, refs, values);
}

void prefix_index::publish_counts() noexcept {
  cached_.store(entries_.size(), std::memory_order_relaxed);
  idle_.store(idle_entries_, std::memory_order_relaxed);
  pool_->set_kept({nodes_.size(), idle_nodes_, reclaimable_});
}

void prefix_index::emit(kv_prefix_event::kind what, const kv_block_hash& hash, const kv_block_hash* parent) noexcept {
  if (!handler_) return;
  kv_prefix_event e;
  e.what = what;
  e.sequence = ++event_sequence_;
  e.hash = hash;
  if (parent) e.parent = *parent;
  handler_(e);
}

void prefix_index::set_event_handler(kv_prefix_event_handler handler) {
  std::lock_guard lock(mutex_);
  handler_ = std::move(handler);
  event_sequence_ = 0;
}

kv_prefix_stats prefix_index::stats() const noexcept {
  kv_prefix_stats s;
  s.queries = queries_.load(std::memory_order_relaxed);
  s.query_tokens = query_tokens_.load(std::memory_order_relaxed);
  s.hit_tokens = hit_tokens_.load(std::memory_order_relaxed);
  s.inserted_blocks = inserted_.load(std::memory_order_relaxed);
  s.evicted_blocks = evicted_.load(std::memory_order_relaxed);
  s.cached_entries = s.cached_blocks = cached_.load(std::memory_order_relaxed);
  s.idle_blocks = idle_.load(std::memory_order_relaxed);
  s.store_hit_tokens = store_hit_tokens_.load(std::memory_order_relaxed);
  s.store_puts = store_puts_.load(std::memory_order_relaxed);
  s.store_rejects = store_rejects_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
