// The prefix cache: the block hash (OpenSSL's SHA-256), the index of
// entries (prefix_index.hpp), and the untyped interface of
// ghostlink/prefix_cache.hpp.

#include <openssl/evp.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <new>
#include <ranges>
#include <system_error>
#include <utility>

#include "actor.hpp"
#include "ghostlink/error.hpp"
#include "prefix_index.hpp"
#include "sequence.hpp"

namespace ghostlink {

std::string kv_block_hash::hex() const {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s(2 * bytes.size(), '0');
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    s[2 * i] = digits[bytes[i] >> 4];
    s[2 * i + 1] = digits[bytes[i] & 0xf];
  }
  return s;
}

}  // namespace ghostlink

namespace ghostlink::detail {
namespace {

[[noreturn]] void throw_errc(kv_errc e) { throw std::system_error(make_error_code(e)); }

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

kv_block_hash root_hash(std::string_view model, std::string_view salt, std::size_t num_layers, const kv_cache_config& c,
                        std::uint8_t element) {
  static constexpr std::string_view tag = "ghostlink-prefix-v1";
  sha256& h = sha256::for_this_thread();
  h.begin();
  h.add(tag.data(), tag.size());
  add_u64(h, model.size());
  h.add(model.data(), model.size());
  add_u64(h, salt.size());
  h.add(salt.data(), salt.size());
  add_u64(h, num_layers);
  add_u64(h, c.num_heads);
  add_u64(h, c.head_dim);
  add_u64(h, c.block_tokens);
  h.add(&element, 1);
  return h.end();
}

}  // namespace

prefix_index::prefix_index(std::size_t num_layers, const kv_cache_config& config, element_codec codec,
                           std::uint8_t element, ref_ptr<block_pool> pool, std::string model)
    : num_layers_(num_layers),
      config_(config),
      codec_(codec),
      element_(element),
      pool_(std::move(pool)),
      model_(std::move(model)),
      unsalted_root_(root_hash(model_, {}, num_layers_, config_, element_)) {
  if (!pool_->attach_index(this)) throw_errc(kv_errc::invalid_config);
}

prefix_index::~prefix_index() {
  pool_->detach_index();  // waits for an eviction or idle report in progress
  std::lock_guard lock(mutex_);
  for (auto& [hash, e] : entries_) e->nodes.clear();
  for (auto& [blk, node] : nodes_) blk->drop_cached();
  nodes_.clear();
  pool_->set_cached_counts(0, 0, 0);
}

kv_block_hash prefix_index::root(std::string_view salt) const {
  return salt.empty() ? unsalted_root_ : root_hash(model_, salt, num_layers_, config_, element_);
}

std::vector<kv_block_hash> prefix_index::hashes(std::span<const token_id> tokens, std::string_view salt) const {
  const std::size_t bt = config_.block_tokens;
  const std::size_t n = tokens.size() / bt;
  std::vector<kv_block_hash> out;
  out.reserve(n);
  if (n == 0) return out;
  // One buffer per block: the previous hash, then the block's tokens as
  // little-endian i32.
  std::vector<std::uint8_t> buffer(32 + 4 * bt);
  kv_block_hash prev = root(salt);
  sha256& h = sha256::for_this_thread();
  for (std::size_t b = 0; b < n; ++b) {
    std::memcpy(buffer.data(), prev.bytes.data(), 32);
    const token_id* t = tokens.data() + b * bt;
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(buffer.data() + 32, t, 4 * bt);
    } else {
      for (std::size_t i = 0; i < bt; ++i) {
        const auto v = static_cast<std::uint32_t>(t[i]);
        for (std::size_t k = 0; k < 4; ++k) buffer[32 + 4 * i + k] = static_cast<std::uint8_t>(v >> (8 * k));
      }
    }
    h.begin();
    h.add(buffer.data(), buffer.size());
    prev = h.end();
    out.push_back(prev);
  }
  return out;
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
      if (!n.busy) node_busy(n);
    }
  publish_counts();
  queries_.fetch_add(1, std::memory_order_relaxed);
  query_tokens_.fetch_add(hashes.size() * config_.block_tokens, std::memory_order_relaxed);
  hit_tokens_.fetch_add(matched.size() * config_.block_tokens, std::memory_order_relaxed);
  return matched.size();
}

std::size_t prefix_index::insert(std::span<const kv_block_hash> hashes,
                                 std::span<const std::vector<const block*>> blocks) {
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
    e.parent = i == 0 ? nullptr : chain[i - 1];
    if (e.parent && e.parent->children++ == 0 && e.parent->in_lru) lru_remove(*e.parent);
    // The caller holds every block, so every node is busy (an idle node's
    // block has no outside reference, and only an attach gives one out).
    e.busy = e.nodes.size();
    refresh_pin(&e);
    emit(kv_prefix_event::kind::stored, e.hash, e.parent ? &e.parent->hash : nullptr);
  }
  for (std::size_t i = hashes.size(); i-- > 0;) touch(*chain[i]);
  inserted_.fetch_add(created.size(), std::memory_order_relaxed);
  publish_counts();
  return created.size();
}

void prefix_index::touch(prefix_entry& e) noexcept {
  const bool was = e.in_lru;
  if (was) lru_remove(e);
  e.tick = ++clock_;
  if (was) lru_add(e);
}

void prefix_index::node_busy(prefix_node& n) noexcept {
  n.busy = true;
  --idle_nodes_;
  for (prefix_entry* e : n.entries) {
    if (e->busy++ == 0) entry_busy(*e);
    refresh_pin(e);
  }
  refresh_node(n);
}

void prefix_index::refresh_pin(prefix_entry* e) noexcept {
  while (e) {
    const bool pinned = e->busy > 0 || e->pinned_children > 0;
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
      !n.busy && std::none_of(n.entries.begin(), n.entries.end(), [](const prefix_entry* e) { return e->pinned; });
  if (reclaimable == n.reclaimable) return;
  n.reclaimable = reclaimable;
  if (reclaimable)
    ++reclaimable_;
  else
    --reclaimable_;
}

void prefix_index::entry_busy(prefix_entry& e) noexcept {
  --idle_entries_;
  if (e.in_lru) lru_remove(e);
}

void prefix_index::entry_idle(prefix_entry& e) noexcept {
  ++idle_entries_;
  if (e.children == 0) lru_add(e);
}

void prefix_index::lru_add(prefix_entry& e) noexcept {
  e.lru_node.value() = {e.tick, &e};
  lru_.insert(std::move(e.lru_node));
  e.in_lru = true;
}

void prefix_index::lru_remove(prefix_entry& e) noexcept {
  e.lru_node = lru_.extract(std::pair{e.tick, &e});
  e.in_lru = false;
}

void prefix_index::block_idle(const block* b) noexcept {
  std::lock_guard lock(mutex_);
  auto it = nodes_.find(b);
  if (it == nodes_.end()) return;  // dropped meanwhile
  prefix_node& n = it->second;
  // A late report: the block may be busy again (an attach since).
  if (!n.busy || n.blk->outside_references() != 0) return;
  n.busy = false;
  ++idle_nodes_;
  for (prefix_entry* e : n.entries) {
    if (--e->busy == 0) entry_idle(*e);
    refresh_pin(e);
  }
  refresh_node(n);
  publish_counts();
}

bool prefix_index::evict_one() noexcept {
  std::lock_guard lock(mutex_);
  if (lru_.empty()) return false;
  prefix_entry& e = *lru_.begin()->second;
  lru_remove(e);
  const kv_block_hash hash = e.hash;
  remove(e);
  evicted_.fetch_add(1, std::memory_order_relaxed);
  emit(kv_prefix_event::kind::removed, hash, nullptr);
  publish_counts();
  return true;
}

void prefix_index::remove(prefix_entry& e) noexcept {
  if (e.parent && --e.parent->children == 0 && e.parent->busy == 0) lru_add(*e.parent);
  if (e.busy == 0) --idle_entries_;
  for (prefix_node* n : e.nodes) {
    std::erase(n->entries, &e);
    if (!n->entries.empty()) {
      refresh_node(*n);
      continue;
    }
    const block* blk = n->blk;
    if (!n->busy) --idle_nodes_;
    if (n->reclaimable) --reclaimable_;
    nodes_.erase(blk);
    blk->drop_cached();  // frees it when idle
  }
  entries_.erase(e.hash);  // destroys e
}

void prefix_index::clear() noexcept {
  std::lock_guard lock(mutex_);
  lru_.clear();
  for (auto& [blk, node] : nodes_) blk->drop_cached();
  nodes_.clear();
  entries_.clear();
  idle_nodes_ = idle_entries_ = reclaimable_ = 0;
  emit(kv_prefix_event::kind::cleared, {}, nullptr);
  publish_counts();
}

void prefix_index::publish_counts() noexcept {
  cached_.store(entries_.size(), std::memory_order_relaxed);
  idle_.store(idle_entries_, std::memory_order_relaxed);
  pool_->set_cached_counts(nodes_.size(), idle_nodes_, reclaimable_);
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
  s.cached_blocks = cached_.load(std::memory_order_relaxed);
  s.idle_blocks = idle_.load(std::memory_order_relaxed);
  return s;
}

// The untyped interface of ghostlink/prefix_cache.hpp.

std::shared_ptr<prefix_index> make_prefix_index(std::size_t num_layers, const kv_cache_config& config,
                                                element_codec codec, std::uint8_t element, const kv_block_pool& pool,
                                                kv_prefix_options options) {
  validate(config, codec.size);
  if (num_layers == 0 || config.max_blocks != kv_cache_config{}.max_blocks ||
      2 * config.block_tokens * config.token_width() * codec.size != pool.block_bytes())
    throw_errc(kv_errc::invalid_config);
  return std::make_shared<prefix_index>(num_layers, config, codec, element, pool_access::state(pool),
                                        std::move(options.model));
}

namespace {

/// The tokens an attached sequence can hold: at most `max_tokens_per_seq`
/// (entries inserted from sequences of a larger bound may be longer).
std::span<const token_id> within_max(const prefix_index& p, std::span<const token_id> tokens) noexcept {
  return tokens.first(std::min(tokens.size(), p.config().max_tokens_per_seq));
}

}  // namespace

std::size_t num_layers(const prefix_index& p) noexcept { return p.num_layers(); }
const kv_cache_config& config_of(const prefix_index& p) noexcept { return p.config(); }
kv_block_pool pool_of(const prefix_index& p) noexcept { return pool_access::handle(p.pool()); }

std::vector<kv_block_hash> block_hashes(const prefix_index& p, std::span<const token_id> tokens,
                                        std::string_view salt) {
  return p.hashes(tokens, salt);
}

std::size_t prefix_match(const prefix_index& p, std::span<const token_id> tokens, std::string_view salt) {
  const std::vector<kv_block_hash> h = p.hashes(within_max(p, tokens), salt);
  return p.match(h) * p.config().block_tokens;
}

std::shared_ptr<sequence_core> prefix_attach(prefix_index& p, asio::any_io_executor ex,
                                             std::span<const token_id> tokens, std::string_view salt) {
  const std::vector<kv_block_hash> h = p.hashes(within_max(p, tokens), salt);
  std::vector<std::vector<ref_ptr<block>>> blocks;
  const std::size_t n = p.take(h, blocks);
  return make_attached_sequence(std::move(ex), p.config(), p.codec(), p.pool(), std::move(blocks),
                                tokens.first(n * p.config().block_tokens));
}

namespace {

/// A sequence's layers and token ids pinned as its snapshot() pins them
/// (narrowed to one length), with that length.
struct pinned_sequence {
  std::vector<ref_ptr<epoch>> layers;
  ref_ptr<epoch> ids;
  std::size_t size = 0;
};

pinned_sequence pin_sequence(const sequence_core& seq) {
  pinned_sequence p;
  const std::size_t n = seq.model_layers();
  p.layers.reserve(n);
  for (std::uint64_t removals = seq.drops.load(std::memory_order_acquire);;) {
    for (std::size_t i = 0; i < n; ++i) p.layers.push_back(seq.layers[i]->pin());
    p.ids = seq.layers[seq.ids_layer()]->pin();
    p.size = std::min(seq.bound.load(std::memory_order_acquire), p.ids->size);
    const std::uint64_t now = seq.drops.load(std::memory_order_acquire);
    if (now == removals) break;
    removals = now;
    p.layers.clear();
  }
  for (const ref_ptr<epoch>& e : p.layers) p.size = std::min(p.size, e->size);
  return p;
}

token_id stored_id(const epoch& ids, std::size_t i) {
  if (i >= ids.stored) return no_token_id;
  float bits = 0;
  std::memcpy(&bits, ids.layout->keys(ids.block_of(i), i % ids.layout->block_tokens), sizeof bits);
  return std::bit_cast<token_id>(bits);
}

}  // namespace

std::size_t prefix_insert(prefix_index& p, const sequence_core* seq, const std::span<const token_id>* tokens,
                          std::string_view salt) {
  if (!seq) throw_errc(kv_errc::invalid_config);
  if (seq->model_layers() != p.num_layers()) throw_errc(kv_errc::layer_mismatch);
  const kv_cache_config& c = seq->config;
  if (&seq->layers[0]->pool() != p.pool().get() || c.num_heads != p.config().num_heads ||
      c.head_dim != p.config().head_dim || c.block_tokens != p.config().block_tokens)
    throw_errc(kv_errc::invalid_config);

  const pinned_sequence pinned = pin_sequence(*seq);  // held until the entries hold the blocks
  const std::size_t bt = c.block_tokens;
  std::size_t full = pinned.size;
  std::vector<token_id> stored;
  if (tokens) {
    full = std::min(full, tokens->size());
  } else {
    stored.reserve(full);
    for (std::size_t i = 0; i < full; ++i) {
      const token_id id = stored_id(*pinned.ids, i);
      if (id == no_token_id) break;
      stored.push_back(id);
    }
    full = stored.size();
  }
  // Whole blocks that every layer holds as blocks of its own data.
  std::vector<std::vector<const block*>> blocks;
  blocks.reserve(full / bt);
  for (std::size_t b = 0; b < full / bt; ++b) {
    std::vector<const block*> per_layer;
    per_layer.reserve(p.num_layers());
    for (const ref_ptr<epoch>& e : pinned.layers) {
      if (e->stored < (b + 1) * bt) break;
      const block& blk = *e->table->entry(b);
      if (!blk.counted()) break;  // the zero block
      per_layer.push_back(&blk);
    }
    if (per_layer.size() != p.num_layers()) break;
    blocks.push_back(std::move(per_layer));
  }
  const std::span<const token_id> used =
      tokens ? tokens->first(blocks.size() * bt) : std::span<const token_id>(stored).first(blocks.size() * bt);
  const std::vector<kv_block_hash> h = p.hashes(used, salt);
  return p.insert(h, blocks);
}

void prefix_clear(prefix_index& p) noexcept { p.clear(); }
kv_prefix_stats prefix_stats(const prefix_index& p) noexcept { return p.stats(); }
void prefix_set_event_handler(prefix_index& p, kv_prefix_event_handler handler) {
  p.set_event_handler(std::move(handler));
}

}  // namespace ghostlink::detail
