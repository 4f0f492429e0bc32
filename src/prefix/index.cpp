// The prefix cache's index: its entries, which of them are idle and
// evictable, and their eviction (invariants in index.hpp).

#include <algorithm>
#include <iterator>
#include <ranges>
#include <system_error>
#include <thread>
#include <utility>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/error.hpp"
#include "prefix/index.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

prefix_index::prefix_index(const kv_model_layout& layout, const kv_cache_config& config, element_codec codec,
                           ref_ptr<block_pool> pool, std::string model, std::shared_ptr<kv_block_store> store,
                           kv_store_policy policy)
    : rule_(layout, config.block_tokens),
      num_layers_(layout.num_layers()),
      config_(config),
      codec_(codec),
      pool_(std::move(pool)),
      model_(std::move(model)),
      unsalted_root_(root_hash(model_, {}, layout, config_, codec_.code)),
      store_(std::move(store)),
      policy_(policy),
      geometry_(layout, config_, codec_),
      link_(std::make_shared<store_link>(this)),
      halves_(2 * num_layers_) {
  if (!pool_->attach_reclaimer(this)) throw std::system_error(make_error_code(kv_errc::invalid_config));
  if (store_) store_->limit_value_size(geometry_.entry_bytes(num_layers_));
}

prefix_index::~prefix_index() {
  link_->cut();  // a store's receipts call it no more
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

std::size_t prefix_index::valid_run(std::span<const kv_block_hash> hashes, std::vector<prefix_entry*>& chain) const {
  const std::size_t run = cached_run(hashes);
  chain.resize(run);
  // The run's last entry, then its parents: one lookup in all.
  prefix_entry* e = run == 0 ? nullptr : entries_.find(hashes[run - 1])->second.get();
  for (std::size_t i = run; i-- > 0; e = e->parent) chain[i] = e;
  return rule_.longest(run, [&](std::size_t l, std::size_t j) { return chain[j]->nodes[l] != nullptr; });
}

std::size_t prefix_index::match(std::span<const kv_block_hash> hashes) const {
  std::size_t found = 0;
  std::vector<prefix_entry*> chain;
  if (rule_.windowed()) chain.reserve(hashes.size());  // a full layout's run needs none
  {
    std::lock_guard lock(mutex_);
    found = rule_.windowed() ? valid_run(hashes, chain) : cached_run(hashes);
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
  const std::size_t k = valid_run(hashes, matched);  // may throw: nothing changed yet
  matched.resize(k);
  // Later blocks count as used first, so a child is older than its parent.
  for (prefix_entry* e : std::views::reverse(matched)) touch(*e);
  const bool windowed = rule_.windowed();  // else every layer needs every block
  for (std::size_t j = 0; j < k; ++j) {
    prefix_entry* e = matched[j];
    bool window_read = false;
    for (std::size_t l = 0; l < num_layers_; ++l) {
      if (windowed && !rule_.needs(l, j, k)) {
        out[l].emplace_back();
        continue;
      }
      prefix_node& n = *e->nodes[l];  // the rule found it
      window_read = window_read || n.windowed;
      // The attached layer never writes into it (another owner's), only refers to it.
      out[l].push_back(ref_ptr<block>::share(const_cast<block*>(n.blk)));
      if (!n.in_use) node_in_use(n);
    }
    if (window_read) touch_window(*e);
  }
  publish_counts();
  queries_.fetch_add(1, std::memory_order_relaxed);
  query_tokens_.fetch_add(hashes.size() * config_.block_tokens, std::memory_order_relaxed);
  hit_tokens_.fetch_add(matched.size() * config_.block_tokens, std::memory_order_relaxed);
  return matched.size();
}

std::size_t prefix_index::insert(std::span<const kv_block_hash> chain, std::span<const token_id> tokens,
                                 std::size_t first, std::span<const std::vector<const block*>> blocks,
                                 const retention_rule* retention, std::vector<std::size_t>* added, bool in_store) {
  const std::size_t n = blocks.size();
  const bool timed = retention && retention->timed();
  const std::chrono::steady_clock::time_point now = timed ? retention_now() : std::chrono::steady_clock::time_point{};
  std::vector<prefix_entry*> at(n, nullptr);  // the entry of blocks[i]
  std::vector<bool> is_new(n, false);
  std::vector<kv_block_hash> created;
  std::vector<prefix_node*> created_nodes;
  created_nodes.reserve(n * num_layers_);
  struct fill {
    prefix_entry* e;
    std::size_t layer;
    prefix_node* node;
  };
  std::vector<fill> fills;  // blocks an existing entry lacked
  std::vector<prefix_entry*> revived;
  std::lock_guard lock(mutex_);
  // Ancestors evicted meanwhile (a tracked sequence's, whose windows let go
  // of them) come back holding nothing, so the index stays prefix-closed.
  // Only where every layer is windowed: a full layer's block is never null,
  // and only the caller could give it (its entry went with clear(), say).
  std::size_t start = first;
  while (start > 0 && !entries_.contains(chain[start - 1])) --start;
  if (start < first && !rule_.all_windowed()) return 0;
  prefix_entry* const parent = start == 0 ? nullptr : entries_.find(chain[start - 1])->second.get();
  created.reserve(first - start + n);
  revived.reserve(first - start);
  // Phase 1, undone if anything cannot be allocated: the entries and nodes.
  auto node_of = [&](const block* b, std::size_t l) -> prefix_node& {
    auto [pos, new_node] = nodes_.try_emplace(b);
    prefix_node& nd = pos->second;
    if (new_node) {
      nd.blk = b;
      nd.windowed = rule_.layer_windowed(l);
      created_nodes.push_back(&nd);
    }
    return nd;
  };
  const std::size_t bt = config_.block_tokens;
  auto new_entry = [&](std::size_t i) -> prefix_entry& {
    const kv_block_hash& h = chain[i];
    auto it = entries_.try_emplace(h).first;
    created.push_back(h);
    it->second = std::make_unique<prefix_entry>();
    prefix_entry& e = *it->second;
    e.hash = h;
    if (tokens.size() >= (i + 1) * bt) {
      e.tokens = std::make_unique_for_overwrite<token_id[]>(bt);
      std::ranges::copy(tokens.subspan(i * bt, bt), e.tokens.get());
    }
    e.nodes.reserve(num_layers_);
    e.lru_node = lru_.extract(lru_.emplace(0, &e).first);
    e.window_node = window_lru_.extract(window_lru_.emplace(0, &e).first);
    return e;
  };
  // The expiry node of chain[i]'s entry `e`, if its retention has a duration.
  auto timed_at = [&](prefix_entry& e, std::size_t i) {
    if (!timed || e.deadline || retention->at(i).duration.count() == 0) return;  // a deadline keeps its node
    expiry_set::node_type node = expiry_.extract(expiry_.emplace(std::chrono::steady_clock::time_point{}, &e).first);
    e.deadline = std::make_unique<entry_deadline>();
    e.deadline->node = std::move(node);
  };
  try {
    for (std::size_t i = start; i < first; ++i) {
      prefix_entry& e = new_entry(i);
      e.nodes.assign(num_layers_, nullptr);
      revived.push_back(&e);
      timed_at(e, i);
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (auto it = entries_.find(chain[first + i]); it != entries_.end()) {
        prefix_entry& e = *it->second;
        at[i] = &e;
        timed_at(e, first + i);  // a spare node if a throw follows: kept for later
        for (std::size_t l = 0; l < num_layers_; ++l) {
          if (e.nodes[l] || !blocks[i][l]) continue;
          prefix_node& nd = node_of(blocks[i][l], l);
          fills.push_back({&e, l, &nd});
          nd.entries.push_back(&e);
        }
        continue;
      }
      prefix_entry& e = new_entry(first + i);
      at[i] = &e;
      is_new[i] = true;
      timed_at(e, first + i);
      for (std::size_t l = 0; l < num_layers_; ++l) {
        if (!blocks[i][l]) {
          e.nodes.push_back(nullptr);
          continue;
        }
        prefix_node& nd = node_of(blocks[i][l], l);
        nd.entries.push_back(&e);
        e.nodes.push_back(&nd);
      }
    }
  } catch (const std::bad_alloc&) {
    for (const fill& f : fills) std::erase(f.node->entries, f.e);
    for (const kv_block_hash& h : created) {
      auto it = entries_.find(h);
      if (it->second)
        for (prefix_node* nd : it->second->nodes)
          if (nd) std::erase(nd->entries, it->second.get());
      entries_.erase(it);
    }
    for (prefix_node* nd : created_nodes)
      if (nd->entries.empty()) nodes_.erase(nd->blk);
    throw;
  }
  // Phase 2 allocates nothing.
  for (prefix_node* nd : created_nodes) nd->blk->set_cached();
  // The caller holds every block it passes, so every node of them is in use
  // (an idle node's block has no outside reference, and only an attach
  // gives one out).
  auto link = [&](prefix_entry& e, prefix_entry* p, std::size_t i) {
    if (retention) retain(e, retention->at(i), now);  // before it enters an eviction set
    e.in_store = in_store;
    e.parent = p;
    if (p && p->children++ == 0 && p->in_lru()) lru_remove(*p);
    for (const prefix_node* nd : e.nodes) {
      if (!nd) continue;
      ++e.in_use;
      if (nd->windowed) ++e.windowed_held;
    }
    e.w_in_use = e.windowed_held;
    if (e.in_use == 0) entry_idle(e);  // hollow: its child follows at once
    refresh_pin(&e);
    emit(kv_prefix_event::kind::stored, e.hash, p ? &p->hash : nullptr, e.priority, e.tokens.get());
  };
  prefix_entry* prev = parent;
  for (std::size_t i = start; i < first; ++i) {
    link(*revived[i - start], prev, i);
    prev = revived[i - start];
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (is_new[i]) {
      link(*at[i], i == 0 ? prev : at[i - 1], first + i);
      if (added) added->push_back(i);  // room reserved by the caller
    } else if (retention) {
      retain(*at[i], retention->at(first + i), now);  // a re-insert takes the new priority
    }
  }
  for (const fill& f : fills) {  // a windowed layer's block (a full layer's is never null)
    prefix_entry& e = *f.e;
    e.nodes[f.layer] = f.node;
    ++e.windowed_held;
    if (e.in_use++ == 0) entry_in_use(e);
    ++e.w_in_use;
    window_use_changed(e);
    refresh_pin(&e);
  }
  // A windowed part is used again only where the caller holds it too (an
  // attached sequence's windowed layers hold the blocks its window read).
  for (std::size_t i = n; i-- > 0;) {
    touch(*at[i]);
    const bool window_held = std::ranges::any_of(std::views::iota(std::size_t{0}, num_layers_), [&](std::size_t l) {
      return blocks[i][l] && rule_.layer_windowed(l);
    });
    if (window_held && at[i]->windowed_held != 0) touch_window(*at[i]);
  }
  for (prefix_entry* e : std::views::reverse(revived)) touch(*e);
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

void prefix_index::touch_window(prefix_entry& e) noexcept {
  const bool was = e.in_window_lru();
  if (was) e.window_node = window_lru_.extract(std::pair{e.window_key(), &e});
  e.wtick = ++clock_;
  if (was) refresh_window(e);
}

void prefix_index::set_priority(prefix_entry& e, std::uint8_t p) noexcept {
  if (p == e.priority) return;
  const bool entry = e.in_lru(), window = e.in_window_lru();
  if (entry) lru_remove(e);
  if (window) e.window_node = window_lru_.extract(std::pair{e.window_key(), &e});
  e.priority = p;
  if (entry) lru_add(e);
  if (window) refresh_window(e);
}

void prefix_index::retain(prefix_entry& e, const block_retention& r,
                          std::chrono::steady_clock::time_point now) noexcept {
  if (e.expires()) e.deadline->node = expiry_.extract(std::pair{e.deadline->at, &e});
  set_priority(e, r.priority);
  if (r.duration.count() == 0) return;
  entry_deadline& d = *e.deadline;  // allocated by the insert's first phase, with its node
  d.after = r.after;
  d.at = now + r.duration;
  d.node.value() = {d.at, &e};
  expiry_.insert(std::move(d.node));
}

void prefix_index::expire() noexcept {
  if (expiry_.empty()) return;
  const std::chrono::steady_clock::time_point now = retention_now();
  while (!expiry_.empty() && expiry_.begin()->first <= now) {
    prefix_entry& e = *expiry_.begin()->second;
    e.deadline->node = expiry_.extract(expiry_.begin());
    set_priority(e, e.deadline->after);
  }
}

void prefix_index::refresh_window(prefix_entry& e) noexcept {
  const bool evictable = e.windowed_held != 0 && e.w_in_use == 0;
  if (evictable == e.in_window_lru()) return;
  if (evictable) {
    e.window_node.value() = {e.window_key(), &e};
    window_lru_.insert(std::move(e.window_node));
  } else {
    e.window_node = window_lru_.extract(std::pair{e.window_key(), &e});
  }
}

void prefix_index::node_in_use(prefix_node& n) noexcept {
  n.in_use = true;
  --idle_nodes_;
  for (prefix_entry* e : n.entries) {
    if (e->in_use++ == 0) entry_in_use(*e);
    if (n.windowed && e->w_in_use++ == 0) window_use_changed(*e);
    refresh_pin(e);
  }
  refresh_node(n);
}

void prefix_index::refresh_pin(prefix_entry* e) noexcept {
  while (e) {
    const bool pinned = e->in_use > 0 || e->pinned_children > 0;
    if (pinned == e->pinned) return;
    e->pinned = pinned;
    for (prefix_node* n : e->nodes)
      if (n) refresh_node(*n);
    if (e->parent) {
      if (pinned)
        ++e->parent->pinned_children;
      else
        --e->parent->pinned_children;
    }
    e = e->parent;
  }
}

void prefix_index::window_use_changed(prefix_entry& e) noexcept {
  refresh_window(e);
  for (prefix_node* n : e.nodes)
    if (n && n->windowed) refresh_node(*n);
}

void prefix_index::refresh_node(prefix_node& n) noexcept {
  // A windowed node goes with its entries' windowed parts, a full one only
  // with its entries.
  const bool reclaimable = !n.in_use && std::none_of(n.entries.begin(), n.entries.end(), [&](const prefix_entry* e) {
    return n.windowed ? e->w_in_use != 0 : e->pinned;
  });
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
  e.lru_node.value() = {e.lru_key(), &e};
  lru_.insert(std::move(e.lru_node));
}

void prefix_index::lru_remove(prefix_entry& e) noexcept { e.lru_node = lru_.extract(std::pair{e.lru_key(), &e}); }

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
    if (n.windowed && --e->w_in_use == 0) window_use_changed(*e);
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
    expire();
    // The first in (priority, recency) of the evictable entries and the
    // evictable windowed parts (docs/API.md, "Eviction"): a windowed part
    // ages only when no attach's window reads it, so one that no match
    // ends near goes before the full layers' blocks that every longer
    // match needs.
    const bool entry = !lru_.empty();
    const bool window = !window_lru_.empty();
    if (!entry && !window) return false;
    if (window && (!entry || window_lru_.begin()->first <= lru_.begin()->first)) {
      drop_window(*window_lru_.begin()->second);
      window_evicted_.fetch_add(1, std::memory_order_relaxed);
      publish_counts();
      return true;
    }
    prefix_entry& e = *lru_.begin()->second;
    if (writes_back() && !e.in_store) {
      // The copy is made here, as the blocks are about to be freed; memory
      // refused only loses the write-back.
      for (std::size_t l = 0; l < num_layers_; ++l) {
        const prefix_node* n = e.nodes[l];
        halves_[2 * l] = n ? n->blk->keys() : nullptr;
        halves_[2 * l + 1] = n ? n->blk->values() : nullptr;
      }
      written_back = copied_entry::make(geometry_, e.hash, halves_, receipt(e.hash, parent_of(e), tokens_of(e)));
    }
    remove(e);
    publish_counts();
  }
  if (written_back) {
    store_->put(std::move(written_back));
    store_puts_.fetch_add(1, std::memory_order_relaxed);
  }
  return true;
}

void prefix_index::detach_node(prefix_entry& e, std::size_t l) noexcept {
  prefix_node* n = std::exchange(e.nodes[l], nullptr);
  if (n->windowed) --e.windowed_held;
  std::erase(n->entries, &e);
  if (!n->entries.empty()) {
    refresh_node(*n);
    return;
  }
  const block* blk = n->blk;
  if (!n->in_use) --idle_nodes_;
  if (n->reclaimable) --reclaimable_;
  nodes_.erase(blk);
  blk->drop_cached();  // frees it when idle
}

void prefix_index::drop_window(prefix_entry& e) noexcept {
  // None of its windowed nodes is in use (w_in_use == 0): dropping them
  // changes no use count.
  e.window_node = window_lru_.extract(std::pair{e.window_key(), &e});
  for (std::size_t l = 0; l < num_layers_; ++l)
    if (e.nodes[l] && e.nodes[l]->windowed) detach_node(e, l);
  if (e.children == 0 && e.hollow()) remove(e);
}

void prefix_index::remove(prefix_entry& e) noexcept {
  prefix_entry* const parent = e.parent;
  const kv_block_hash hash = e.hash;
  const std::uint8_t priority = e.priority;
  if (e.in_lru()) lru_remove(e);
  if (e.in_use == 0) --idle_entries_;
  if (e.in_window_lru()) e.window_node = window_lru_.extract(std::pair{e.window_key(), &e});
  if (e.expires()) expiry_.erase(std::pair{e.deadline->at, &e});
  for (std::size_t l = 0; l < num_layers_; ++l)
    if (e.nodes[l]) detach_node(e, l);
  entries_.erase(hash);  // destroys e
  evicted_.fetch_add(1, std::memory_order_relaxed);
  evicted_by_band_[kv_priority_band(priority)].fetch_add(1, std::memory_order_relaxed);
  emit(kv_prefix_event::kind::removed, hash, nullptr, priority);  // before its parent's
  if (!parent || --parent->children != 0) return;
  if (parent->hollow()) {
    remove(*parent);  // childless now: it matches nothing any more
  } else if (parent->in_use == 0) {
    lru_add(*parent);
  }
}

bool prefix_index::collect_unstored(collected& out, bool pin) noexcept {
  try {
    out.hashes.reserve(entries_.size());
    out.refs.reserve(entries_.size());
    out.receipts.reserve(entries_.size());
    for (auto& [hash, entry] : entries_) {
      prefix_entry& e = *entry;
      if (e.in_store) continue;
      std::vector<ref_ptr<block>> held;
      held.reserve(num_layers_);  // the last allocation: a throw leaves nothing held
      for (prefix_node* n : e.nodes) {
        if (!n) {
          held.emplace_back();
          continue;
        }
        // As an attach's: the block never changes while cached.
        held.push_back(ref_ptr<block>::share(const_cast<block*>(n->blk)));
        if (pin && !n->in_use) node_in_use(*n);
      }
      e.in_store = true;
      out.hashes.push_back(hash);  // reserved: cannot throw
      out.refs.push_back(std::move(held));
      out.receipts.push_back(receipt(hash, parent_of(e), tokens_of(e)));  // null if refused
    }
    return true;
  } catch (const std::bad_alloc&) {
    return false;
  }
}

std::size_t prefix_index::put_collected(const collected& in,
                                        std::vector<std::shared_ptr<const kv_store_value>>& values) noexcept {
  std::size_t put = 0;
  try {
    values.reserve(in.hashes.size());
    for (; put < in.hashes.size(); ++put) {
      // A copy of the references: `in` lets go of its own outside the locks.
      values.push_back(std::make_shared<held_entry>(geometry_, in.hashes[put], in.refs[put], in.receipts[put]));
      store_->put(values.back());
    }
  } catch (const std::bad_alloc&) {
  }
  store_puts_.fetch_add(put, std::memory_order_relaxed);
  return put;
}

bool prefix_index::flush() noexcept {
  if (!store_) return true;
  collected c;  // its blocks let go of last, outside the lock
  std::vector<std::shared_ptr<const kv_store_value>> values;
  bool whole = false;
  std::size_t put = 0;
  {
    const auto handoff = handing();
    {
      std::lock_guard lock(mutex_);
      whole = collect_unstored(c, true);
      publish_counts();
    }
    put = put_collected(c, values);
  }
  if (put < c.hashes.size()) {
    whole = false;
    mark_unstored(std::span(c.hashes).subspan(put));
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
  collected c;  // its blocks let go of last, outside the lock
  std::vector<std::shared_ptr<const kv_store_value>> values;
  handoff_tracker::ticket handoff;
  if (store_) handoff = handing();
  {
    std::lock_guard lock(mutex_);
    // Every entry leaves RAM here: those not in the store yet go to it,
    // holding their blocks (no copy) until it has written them.
    if (store_) collect_unstored(c, false);
    lru_.clear();
    window_lru_.clear();
    expiry_.clear();
    for (auto& [blk, node] : nodes_) blk->drop_cached();
    nodes_.clear();
    entries_.clear();
    stored_.clear();  // the store keeps them, but a cleared mirror forgets both tiers
    idle_nodes_ = idle_entries_ = reclaimable_ = 0;
    emit(kv_prefix_event::kind::cleared, {}, nullptr);
    publish_counts();
  }
  if (store_) put_collected(c, values);
}

void prefix_index::publish_counts() noexcept {
  cached_.store(entries_.size(), std::memory_order_relaxed);
  idle_.store(idle_entries_, std::memory_order_relaxed);
  pool_->set_kept({nodes_.size(), idle_nodes_, reclaimable_});
}

void prefix_index::emit(kv_prefix_event::kind what, const kv_block_hash& hash, const kv_block_hash* parent,
                        std::uint8_t priority, const token_id* tokens, kv_prefix_tier tier) noexcept {
  if (!handler_) return;
  kv_prefix_event e;
  e.what = what;
  e.tier = tier;
  e.priority = priority;
  e.sequence = ++event_sequence_;
  e.hash = hash;
  if (parent) e.parent = *parent;
  if (tokens) e.token_ids = std::span(tokens, config_.block_tokens);
  handler_(e);
}

namespace {

/// Appends `out`'s copy of every element of `map` (under `mutex`): a few
/// buckets at a time, each under one hold of the lock, so that an insert
/// waits for one chunk at most. An element's bucket does not change until a
/// rehash: one kept throughout is copied once, from the bucket it stays
/// in; one that an event changes meanwhile is copied or not, as of some
/// moment after the dump's sequence, and that event (after it) settles it.
/// A rehash moves elements between buckets: the copy of `map` starts over.
/// Nothing but the chunk's own copies is allocated under the lock.
template <class Map, class Copy>
void copy_chunked(std::mutex& mutex, const Map& map, std::vector<kv_prefix_dump::entry>& out, Copy copy) {
  constexpr std::size_t chunk_entries = 256;
  const std::size_t start = out.size();
  std::size_t buckets = 0;
  {
    std::lock_guard lock(mutex);
    buckets = map.bucket_count();
  }
  std::vector<kv_prefix_dump::entry> chunk;
  chunk.reserve(2 * chunk_entries);
  for (std::size_t b = 0; b < buckets;) {
    chunk.clear();
    {
      std::lock_guard lock(mutex);
      if (map.bucket_count() != buckets) {
        buckets = map.bucket_count();
        b = 0;
        out.resize(start);
      }
      for (; b < buckets && chunk.size() < chunk_entries; ++b)
        for (auto it = map.begin(b); it != map.end(b); ++it) copy(*it, chunk.emplace_back());
    }
    std::ranges::move(chunk, std::back_inserter(out));
    // std::mutex is not fair: relocked at once, it keeps a waiting insert
    // (woken, not yet running) waiting for many chunks (with a yield
    // alone, 48 ms at most behind a 100k-entry dump). A pause longer than
    // a wakeup lets it in: a dump takes longer, an insert waits one chunk.
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace

kv_prefix_dump prefix_index::dump() const {
  // The sequence first: every entry copied after it is as of a later
  // moment (copy_chunked). The store tier's entries after RAM's.
  kv_prefix_dump d;
  std::size_t size = 0;
  {
    std::lock_guard lock(mutex_);
    d.sequence = event_sequence_;
    size = entries_.size() + stored_.size();
  }
  d.entries.reserve(size + 512);  // outside the lock
  copy_chunked(mutex_, entries_, d.entries, [&](const auto& kv, kv_prefix_dump::entry& out) {
    const prefix_entry& e = *kv.second;
    const std::span<const token_id> tokens = tokens_of(e);
    out.hash = e.hash;
    out.parent = parent_of(e);
    out.token_ids.assign(tokens.begin(), tokens.end());
    out.priority = e.priority;
  });
  copy_chunked(mutex_, stored_, d.entries, [&](const auto& kv, kv_prefix_dump::entry& out) {
    out.hash = kv.first;
    out.tier = kv_prefix_tier::store;
    out.parent = kv.second.parent;
    out.token_ids = kv.second.tokens;
  });
  return d;
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
  s.window_evictions = window_evicted_.load(std::memory_order_relaxed);
  for (std::size_t b = 0; b < s.evictions_by_priority.size(); ++b)
    s.evictions_by_priority[b] = evicted_by_band_[b].load(std::memory_order_relaxed);
  s.cached_entries = s.cached_blocks = cached_.load(std::memory_order_relaxed);
  s.idle_blocks = idle_.load(std::memory_order_relaxed);
  s.store_hit_tokens = store_hit_tokens_.load(std::memory_order_relaxed);
  s.store_puts = store_puts_.load(std::memory_order_relaxed);
  s.store_rejects = store_rejects_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
