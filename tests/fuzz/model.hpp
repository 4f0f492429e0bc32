#pragma once
// The fuzzer's model of ghostlink: what every cache, epoch, snapshot and pool
// must show after each operation. Besides the documented semantics it
// tracks block identities, because capacity_exhausted and the pool's
// counters depend on which blocks exist; for that it mirrors the one policy
// the budget depends on (src/core/working_state.hpp): a write takes a new block
// unless it writes, into a block this cache made, a slot no live epoch
// reads: one no published epoch ever read (a block's `readable` watermark,
// raised to what it holds whenever an epoch is published, a fork taken or
// blocks dropped by a truncate), or one a published truncate cut off, when
// the cache's latest epoch is its only one alive and no other cache holds
// the block (a rewrite after a rollback). Tokens
// are recipes (token_float() makes their floats; check.hpp's token_model what a
// cache of each element type stores and reads back), so the model never stores
// floats and its element type does not matter.

#include <ghostlink/config.hpp>
#include <ghostlink/error.hpp>
#include <ghostlink/layout.hpp>
#include <ghostlink/prefix_cache.hpp>
#include <ghostlink/types.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <ranges>
#include <span>
#include <system_error>
#include <vector>

/// Clang: the model's bookkeeping and the checks carry no coverage
/// instrumentation, so libFuzzer's feedback comes from ghostlink and the
/// decoder, not from compare loops (which also dominated the run time).
#if defined(__clang__)
#define GHOSTLINK_FUZZ_QUIET __attribute__((no_sanitize("coverage")))
#else
#define GHOSTLINK_FUZZ_QUIET
#endif

namespace ghostlink::fuzz {

/// One token's contents: serial 0 is the all-zeros token (never written).
struct recipe {
  std::uint32_t serial = 0;
  std::uint8_t seed = 0;
};

/// Lane `lane` of a token's keys (or values): mostly plain numbers distinct
/// per token and lane, with `seed`'s top bit the values 16-bit rounding finds
/// hard (overflow, subnormals, ties, NaNs, a signalling NaN).
GHOSTLINK_FUZZ_QUIET inline float token_float(recipe r, std::size_t lane, bool value) {
  if (r.serial == 0) return 0.0f;
  if (r.seed & 0x80) {
    static constexpr std::uint32_t special[] = {0x00000000u,
                                                0x80000000u,
                                                0x3f800000u,
                                                0xc0200000u,
                                                0x477fe000u /*65504*/,
                                                0x477fef00u,
                                                0x477ff000u /*65520: inf in half*/,
                                                0x47c35000u /*1e5*/,
                                                0x33800000u /*2^-24*/,
                                                0x33000000u /*2^-25 tie*/,
                                                0x000116c2u /*float subnormal*/,
                                                0x7f7fffffu,
                                                0xff7fffffu,
                                                0x7f800000u,
                                                0xff800000u,
                                                0x7fc00000u,
                                                0xffc00000u,
                                                0x7f800001u /*sNaN*/,
                                                0x7fc12345u,
                                                0x3eaaaaabu,
                                                0x3f808000u /*bf16 tie*/,
                                                0x3f818000u,
                                                0x45001000u /*2049: half tie*/,
                                                0x387fc000u /*half subnormal edge*/};
    constexpr std::size_t n = sizeof special / sizeof special[0];
    return std::bit_cast<float>(special[(r.seed + lane * 5 + (value ? 3 : 0) + r.serial) % n]);
  }
  const float base = static_cast<float>(r.serial % 251 + 1) + static_cast<float>(lane) / 16.0f;
  return value ? -base - 0.5f : base;
}

/// A page-table entry a window dropped (a null block in the real table).
inline constexpr std::uint32_t dropped_block = std::numeric_limits<std::uint32_t>::max();

/// One entry of a write as the model sees it: the lengths of the key and
/// value spans (arbitrary: they may mismatch the width or each other).
struct mwrite {
  std::size_t index = 0, keys = 0, values = 0;
  recipe r;
};

/// A published epoch: what a snapshot pinning it shows.
struct mepoch {
  std::uint64_t owner = 0;  // the cache that published it
  std::uint64_t number = 0;
  std::size_t length = 0, stored = 0;
  std::vector<recipe> data;           // tokens [0, stored); the rest are zeros
  std::vector<std::uint32_t> blocks;  // its page table: block ids, 0 for the zero block, dropped_block
  std::size_t window = 0, sinks = 0, kept_from = 0;  // a windowed layer's: [sinks, kept_from) dropped
  GHOSTLINK_FUZZ_QUIET recipe token(std::size_t i) const { return i < stored ? data[i] : recipe{}; }
};

/// A counted block: the pool it belongs to, the cache that made it (alone
/// writes it), and the owner's position counters (see src/memory/block.hpp's block).
struct mblock {
  std::size_t pool = 0;
  std::uint64_t owner = 0;
  std::size_t readable = 0, materialized = 0;
  std::uint64_t rewound = 0;  // the first epoch published after the last truncate that cut into it
};

struct mpool {
  std::size_t max = 0;  // the budget in blocks
  std::size_t peak = 0;
  std::uint64_t cow = 0;
  std::size_t refuse = 0;  // requests for block memory still to refuse (fail_next_allocations)
};

/// One layer cache (one actor): its working state (what the drain under way
/// has applied) and its latest published epoch.
struct mcache {
  std::size_t pool = 0;
  std::uint64_t owner = 0;
  bool initialized = false;
  bool has_zero = false;  // its block of zeros exists (made on first need, shared with forks made after)
  std::size_t length = 0, stored = 0;
  std::vector<recipe> data;            // [0, stored)
  std::vector<std::uint32_t> table;    // ceil(stored / block_tokens) block ids
  std::vector<std::uint32_t> touched;  // owned blocks written since the last seal
  std::vector<std::uint32_t> set_aside;  // fresh blocks set aside for the next write (a sequence step's)
  // A sequence's windowed layer (window > 0): the first `sinks` positions
  // kept, blocks [ceil(sinks / B), dropped_to) dropped, positions
  // [sinks, kept_from) gone (working_state's fields of those names).
  std::size_t window = 0, sinks = 0, kept_from = 0, dropped_to = 0;
  bool changed = false;
  std::uint64_t next_epoch = 0;
  std::shared_ptr<const mepoch> current;
  std::uint64_t drains = 0, applied = 0, failed = 0, cancelled = 0, delayed = 0;
  std::size_t queued = 0, waiting = 0;  // requests in the mailbox, and waiting for room (after an abandon)
};

/// One sequence: its layers, its length and its tokens' ids.
struct mseq {
  std::vector<std::shared_ptr<mcache>> layers;
  std::size_t length = 0;
  std::vector<token_id> ids;  // one per token, [0, length)
  std::size_t pool = 0;
  std::size_t high_water = 0, rollback = 0;  // the actor's h and rollback_tokens
  bool windowed() const {
    return std::any_of(layers.begin(), layers.end(), [](const auto& l) { return l->window != 0; });
  }
};

inline std::size_t ceil_div(std::size_t n, std::size_t d) { return n / d + (n % d != 0); }

/// One entry of the prefix cache (on pool 0): the blocks of every layer it
/// references and what they hold, keyed by the real cache's block hash.
struct mentry {
  kv_block_hash hash;
  std::optional<kv_block_hash> parent;
  std::vector<std::uint32_t> blocks;      // one per layer; dropped_block: a windowed layer holds none
  std::vector<std::vector<recipe>> data;  // per layer, block_tokens tokens (none where no block)
  std::uint64_t tick = 0;                 // last attached or inserted
  std::uint64_t wtick = 0;                // its windowed blocks': last inserted, or read by an attach's window
  int priority = 35;                      // its retention priority (kv_retention)
  int after = 35;                         // its priority once `deadline` has passed
  std::optional<std::int64_t> deadline;   // in the model's milliseconds
};

/// An insert's retention as the model reads it: block `b`'s priority and
/// duration (ms, 0: none) from the last range holding its last token.
struct mretention {
  struct range {
    std::size_t first, last;
    int priority;
    std::int64_t duration;
  };
  std::vector<range> ranges;
  int default_priority = 35;
  std::pair<int, std::int64_t> at(std::size_t b, std::size_t bt) const {
    const std::size_t last_token = (b + 1) * bt - 1;
    for (std::size_t i = ranges.size(); i-- > 0;)
      if (ranges[i].first <= last_token && last_token < ranges[i].last) return {ranges[i].priority, ranges[i].duration};
    return {default_priority, 0};
  }
};

class model {
 public:
  /// working_state.cpp's bound on a block table (chunks of 32 blocks): a
  /// write needing more fails with capacity_exhausted.
  static constexpr std::size_t max_table_chunks = std::size_t{1} << 26;

  explicit model(const kv_cache_config& geometry) : geometry_(geometry) {}

  std::vector<mpool> pools;

  // The prefix cache on pool 0: its entries (the contract's eviction order
  // by tick), and its counters.
  std::vector<mentry> entries;
  std::uint64_t clock = 0, evicted = 0, inserted = 0, window_evicted = 0;
  std::int64_t now_ms = 0;  // the retention clock (the real cache's, through detail::set_retention_clock)
  std::array<std::uint64_t, 4> evicted_by_band{};
  std::size_t prefix_layers = 0;
  kv_model_layout prefix_layout;  // prefix_layers layers

  /// Whether the prefix cache's layer `l` has a window.
  bool windowed_layer(std::size_t l) const { return prefix_layout.layers[l].window != 0; }
  /// The prefix layout's kept_from for a match of `k` blocks (src/prefix/window_rule.hpp).
  std::size_t kept_from(std::size_t l, std::size_t k) const {
    const kv_layer_layout& w = prefix_layout.layers[l];
    const std::size_t bt = geometry_.block_tokens, end = k * bt;
    const std::size_t first = end + 1 > w.window ? end + 1 - w.window : 0;
    return std::max(w.sink_tokens, first / bt * bt);
  }
  /// Whether layer `l` needs block `j` for a match of `k` blocks.
  bool needs(std::size_t l, std::size_t j, std::size_t k) const {
    const kv_layer_layout& w = prefix_layout.layers[l];
    const std::size_t bt = geometry_.block_tokens;
    return w.window == 0 || j * bt < w.sink_tokens || (j + 1) * bt > kept_from(l, k);
  }
  /// The longest k <= run.size() whose needs `run`'s entries meet.
  std::size_t longest(const std::vector<mentry*>& run) const {
    for (std::size_t k = run.size(); k > 0; --k) {
      bool ok = true;
      for (std::size_t j = 0; j < k && ok; ++j)
        for (std::size_t l = 0; l < prefix_layers && ok; ++l)
          ok = !needs(l, j, k) || run[j]->blocks[l] != dropped_block;
      if (ok) return k;
    }
    return 0;
  }
  /// The cached run of `hashes` from block 0.
  std::vector<mentry*> run_of(const std::vector<kv_block_hash>& hashes) {
    std::vector<mentry*> run;
    for (const kv_block_hash& h : hashes) {
      mentry* e = find(h);
      if (!e) break;
      run.push_back(e);
    }
    return run;
  }
  /// match(): the blocks of the longest valid match.
  std::size_t match(const std::vector<kv_block_hash>& hashes) { return longest(run_of(hashes)); }

  std::size_t add_pool(std::size_t max) {
    pools.push_back({max, 0, 0, 0});
    return pools.size() - 1;
  }

  /// A new cache (a sequence's layer with a window of `window` and `sinks`).
  std::shared_ptr<mcache> make_cache(std::size_t pool, bool initialized, std::size_t window = 0,
                                     std::size_t sinks = 0) {
    auto c = std::make_shared<mcache>();
    c->pool = pool;
    c->owner = ++owners_;
    c->initialized = initialized;
    use_window(*c, window, sinks);
    c->changed = true;
    publish(*c);
    caches_.push_back(c);
    return c;
  }

  /// Counted blocks of `pool` some live cache's table or live epoch holds.
  GHOSTLINK_FUZZ_QUIET std::size_t in_use(std::size_t pool) {
    std::erase_if(caches_, [](const auto& w) { return w.expired(); });
    std::erase_if(epochs_, [](const auto& w) { return w.expired(); });
    mark_.assign(blocks_.size() + 1, 0);
    std::size_t n = 0;
    auto visit = [&](const std::vector<std::uint32_t>& ids) GHOSTLINK_FUZZ_QUIET {
      for (std::uint32_t id : ids)
        if (id != 0 && id != dropped_block && !mark_[id] && blocks_[id - 1].pool == pool) mark_[id] = 1, ++n;
    };
    for (const auto& w : caches_) {
      visit(w.lock()->table);
      visit(w.lock()->set_aside);
    }
    for (const auto& w : epochs_) visit(w.lock()->blocks);
    for (const mentry& e : entries) visit(e.blocks);
    return n;
  }

  /// Marks (mark_) the blocks some live cache, reservation or epoch holds:
  /// what is in use outside the prefix cache.
  GHOSTLINK_FUZZ_QUIET void mark_outside() {
    std::erase_if(caches_, [](const auto& w) { return w.expired(); });
    std::erase_if(epochs_, [](const auto& w) { return w.expired(); });
    mark_.assign(blocks_.size() + 1, 0);
    auto visit = [&](const std::vector<std::uint32_t>& ids) GHOSTLINK_FUZZ_QUIET {
      for (std::uint32_t id : ids)
        if (id != dropped_block) mark_[id] = 1;
    };
    for (const auto& w : caches_) {
      visit(w.lock()->table);
      visit(w.lock()->set_aside);
    }
    for (const auto& w : epochs_) visit(w.lock()->blocks);
  }
  /// After mark_outside(): nothing but the cache references `e`'s blocks.
  GHOSTLINK_FUZZ_QUIET bool idle(const mentry& e) const {
    return std::none_of(e.blocks.begin(), e.blocks.end(),
                        [&](std::uint32_t id) { return id != dropped_block && mark_[id] != 0; });
  }
  /// After mark_outside(): whether `e` holds a windowed block, and one in use.
  GHOSTLINK_FUZZ_QUIET bool holds_window(const mentry& e) const {
    for (std::size_t l = 0; l < prefix_layers; ++l)
      if (windowed_layer(l) && e.blocks[l] != dropped_block) return true;
    return false;
  }
  GHOSTLINK_FUZZ_QUIET bool window_busy(const mentry& e) const {
    for (std::size_t l = 0; l < prefix_layers; ++l)
      if (windowed_layer(l) && e.blocks[l] != dropped_block && mark_[e.blocks[l]]) return true;
    return false;
  }
  GHOSTLINK_FUZZ_QUIET bool has_child(const mentry& e) const {
    return std::any_of(entries.begin(), entries.end(), [&](const mentry& c) { return c.parent == e.hash; });
  }
  /// Entries idle now, and the distinct blocks cached and idle.
  GHOSTLINK_FUZZ_QUIET std::size_t idle_entries() {
    mark_outside();
    return static_cast<std::size_t>(
        std::count_if(entries.begin(), entries.end(), [&](const mentry& e) { return idle(e); }));
  }
  GHOSTLINK_FUZZ_QUIET std::pair<std::size_t, std::size_t> cached_blocks() {
    mark_outside();
    std::vector<std::uint32_t> all;
    for (const mentry& e : entries)
      for (std::uint32_t id : e.blocks)
        if (id != dropped_block) all.push_back(id);
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    const auto idle_n = std::count_if(all.begin(), all.end(), [&](std::uint32_t id) { return mark_[id] == 0; });
    return {all.size(), static_cast<std::size_t>(idle_n)};
  }
  /// Blocks that evicting would free: not held outside, and every entry
  /// holding it unpinned (idle, with no descendant in use).
  GHOSTLINK_FUZZ_QUIET std::size_t reclaimable_blocks() {
    mark_outside();
    std::vector<char> pinned(entries.size(), 0);
    // Children come after their parents in block order, not in entries:
    // repeat until nothing changes (the model is small).
    for (bool changed = true; changed;) {
      changed = false;
      for (std::size_t i = 0; i < entries.size(); ++i) {
        if (pinned[i]) continue;
        bool p = !idle(entries[i]);
        for (std::size_t j = 0; j < entries.size() && !p; ++j) p = pinned[j] && entries[j].parent == entries[i].hash;
        if (p) pinned[i] = 1, changed = true;
      }
    }
    // A windowed block goes with its entries' windowed parts (none of their
    // windowed blocks in use), a full one only with its unpinned entries.
    std::vector<std::uint32_t> all, blocked;
    for (std::size_t i = 0; i < entries.size(); ++i)
      for (std::size_t l = 0; l < prefix_layers; ++l) {
        const std::uint32_t id = entries[i].blocks[l];
        if (id == dropped_block) continue;
        const bool held = windowed_layer(l) ? window_busy(entries[i]) : pinned[i] != 0;
        (held || mark_[id] ? blocked : all).push_back(id);
      }
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    return static_cast<std::size_t>(std::count_if(all.begin(), all.end(), [&](std::uint32_t id) {
      return std::find(blocked.begin(), blocked.end(), id) == blocked.end();
    }));
  }
  /// The first in (priority, tick) of the idle entries with no cached
  /// child and in (priority, wtick) of the windowed parts no sequence uses
  /// (first at a tie) evicted, once the durations due have ended; false if
  /// none. Only pool 0 has a prefix cache.
  GHOSTLINK_FUZZ_QUIET bool evict(std::size_t pool) {
    if (pool != 0 || entries.empty()) return false;
    for (mentry& e : entries)
      if (e.deadline && *e.deadline <= now_ms) e.priority = e.after, e.deadline.reset();
    mark_outside();
    using key = std::pair<int, std::uint64_t>;
    std::size_t best = entries.size(), part = entries.size();
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const mentry& e = entries[i];
      if (idle(e) && !has_child(e) &&
          (best == entries.size() || key{e.priority, e.tick} < key{entries[best].priority, entries[best].tick}))
        best = i;
      if (holds_window(e) && !window_busy(e) &&
          (part == entries.size() || key{e.priority, e.wtick} < key{entries[part].priority, entries[part].wtick}))
        part = i;
    }
    if (part != entries.size() && (best == entries.size() || key{entries[part].priority, entries[part].wtick} <=
                                                                 key{entries[best].priority, entries[best].tick})) {
      mentry& e = entries[part];
      for (std::size_t l = 0; l < prefix_layers; ++l)
        if (windowed_layer(l)) e.blocks[l] = dropped_block, e.data[l].clear();
      ++window_evicted;
      if (!holds_any(e) && !has_child(e)) remove(part);
      return true;
    }
    if (best == entries.size()) return false;
    remove(best);
    return true;
  }
  /// Whether `e` holds some block.
  GHOSTLINK_FUZZ_QUIET static bool holds_any(const mentry& e) {
    return std::any_of(e.blocks.begin(), e.blocks.end(), [](std::uint32_t id) { return id != dropped_block; });
  }
  /// Evicts entry `i`, then its parent while that is left holding nothing
  /// and without children.
  GHOSTLINK_FUZZ_QUIET void remove(std::size_t i) {
    std::optional<kv_block_hash> parent = entries[i].parent;
    count_eviction(entries[i]);
    entries.erase(entries.begin() + static_cast<std::ptrdiff_t>(i));
    while (parent) {
      mentry* p = find(*parent);
      if (!p || holds_any(*p) || has_child(*p)) return;
      parent = p->parent;
      count_eviction(*p);
      entries.erase(entries.begin() + (p - entries.data()));
    }
  }
  void count_eviction(const mentry& e) {
    ++evicted;
    ++evicted_by_band[e.priority >= 75 ? 3 : static_cast<std::size_t>(e.priority / 25)];
  }
  GHOSTLINK_FUZZ_QUIET mentry* find(const kv_block_hash& h) {
    for (mentry& e : entries)
      if (e.hash == h) return &e;
    return nullptr;
  }
  /// attach(): the longest valid match of `hashes` from block 0, touched
  /// (later blocks first; then the windowed parts its windows read, in
  /// block order), as a new sequence's layers (a windowed layer holding
  /// only what the match needs); its ids are the caller's.
  std::vector<std::shared_ptr<mcache>> attach(const std::vector<kv_block_hash>& hashes) {
    std::vector<mentry*> run = run_of(hashes);
    const std::size_t k = longest(run);
    run.resize(k);
    for (mentry* e : std::views::reverse(run)) e->tick = ++clock;
    for (std::size_t j = 0; j < k; ++j) {
      bool read = false;
      for (std::size_t l = 0; l < prefix_layers; ++l) read = read || (windowed_layer(l) && needs(l, j, k));
      if (read) run[j]->wtick = ++clock;
    }
    std::vector<std::shared_ptr<mcache>> layers;
    const std::size_t bt = geometry_.block_tokens;
    for (std::size_t l = 0; l < prefix_layers; ++l) {
      auto c = std::make_shared<mcache>();
      c->pool = 0;
      c->owner = ++owners_;
      c->initialized = true;
      const kv_layer_layout& w = prefix_layout.layers[l];
      use_window(*c, w.window, w.sink_tokens);
      for (std::size_t j = 0; j < k; ++j) {
        const bool held = needs(l, j, k);
        c->table.push_back(held ? run[j]->blocks[l] : dropped_block);
        if (held)
          c->data.insert(c->data.end(), run[j]->data[l].begin(), run[j]->data[l].end());
        else
          c->data.insert(c->data.end(), bt, recipe{});
      }
      if (w.window != 0 && kept_from(l, k) > w.sink_tokens) {  // working_state::restore_kept_from
        c->kept_from = kept_from(l, k);
        c->dropped_to = std::max(ceil_div(w.sink_tokens, bt), c->kept_from / bt);
      }
      c->length = c->stored = k * bt;
      c->changed = true;
      publish(*c);
      caches_.push_back(c);
      layers.push_back(std::move(c));
    }
    return layers;
  }
  /// insert(): entries for the full blocks of the first `hashes.size()`
  /// blocks that every full layer's latest epoch holds as blocks of its
  /// own, and each windowed layer's where it holds all of the block (less
  /// those at the end holding no block at all); an existing entry takes the
  /// windowed blocks it lacks. Returns the entries added.
  std::size_t insert(const mseq& q, const std::vector<kv_block_hash>& hashes, const mretention& retention = {}) {
    const std::size_t bt = geometry_.block_tokens;
    std::vector<std::vector<std::uint32_t>> blocks;
    for (std::size_t b = 0; b < hashes.size(); ++b) {
      std::vector<std::uint32_t> per_layer;
      for (const auto& layer : q.layers) {
        const mepoch& e = *layer->current;
        std::uint32_t id = e.stored >= (b + 1) * bt ? e.blocks[b] : 0;
        if (id == dropped_block) id = 0;
        if (id != 0 && e.window != 0 && (b + 1) * bt > e.sinks && std::max(b * bt, e.sinks) < e.kept_from) id = 0;
        if (id == 0 && e.window == 0) break;  // a full layer's block is never missing
        per_layer.push_back(id == 0 ? dropped_block : id);
      }
      if (per_layer.size() != q.layers.size()) break;
      blocks.push_back(std::move(per_layer));
    }
    const auto none = [](const std::vector<std::uint32_t>& v) {
      return std::all_of(v.begin(), v.end(), [](std::uint32_t id) { return id == dropped_block; });
    };
    while (!blocks.empty() && none(blocks.back())) blocks.pop_back();
    const auto data_of = [&](std::size_t l, std::size_t b) {
      const mepoch& e = *q.layers[l]->current;
      return std::vector<recipe>(e.data.begin() + static_cast<std::ptrdiff_t>(b * bt),
                                 e.data.begin() + static_cast<std::ptrdiff_t>((b + 1) * bt));
    };
    std::size_t added = 0;
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      if (mentry* e = find(hashes[b])) {
        for (std::size_t l = 0; l < prefix_layers; ++l)
          if (e->blocks[l] == dropped_block && blocks[b][l] != dropped_block)
            e->blocks[l] = blocks[b][l], e->data[l] = data_of(l, b);
        continue;
      }
      mentry fresh{hashes[b], b == 0 ? std::nullopt : std::optional(hashes[b - 1]), {}, {}, 0, 0, 35, 35, {}};
      for (std::size_t l = 0; l < prefix_layers; ++l) {
        fresh.blocks.push_back(blocks[b][l]);
        fresh.data.push_back(blocks[b][l] == dropped_block ? std::vector<recipe>{} : data_of(l, b));
      }
      entries.push_back(std::move(fresh));
      ++added;
    }
    for (std::size_t b = 0; b < blocks.size(); ++b) {  // added or not, each takes its block's retention
      mentry& e = *find(hashes[b]);
      const auto [priority, duration] = retention.at(b, bt);
      e.priority = priority;
      e.after = retention.default_priority;
      e.deadline.reset();
      if (duration != 0) e.deadline = now_ms + duration;
    }
    for (std::size_t b = blocks.size(); b-- > 0;) {
      mentry& e = *find(hashes[b]);
      e.tick = ++clock;
      bool window_given = false;
      for (std::size_t l = 0; l < prefix_layers; ++l)
        window_given = window_given || (windowed_layer(l) && blocks[b][l] != dropped_block);
      if (window_given && holds_window(e)) e.wtick = ++clock;
    }
    inserted += added;
    return added;
  }

  ghostlink::error_code initialize(mcache& c, std::size_t n) {
    if (n == 0) return kv_errc::zero_length;
    const std::size_t length = std::min(n, geometry_.max_tokens_per_seq);
    if (length > c.length) {
      if (!zero_block(c)) return kv_errc::capacity_exhausted;
      c.length = length;
      c.changed = true;
    }
    if (!c.initialized) c.initialized = c.changed = true;
    return {};
  }

  /// The checks in the documented order, then the page-writer's block policy.
  ghostlink::error_code write(mcache& c, std::span<const mwrite> entries) {
    const std::size_t width = geometry_.token_width(), bt = geometry_.block_tokens;
    for (const mwrite& w : entries) {
      if (w.keys != w.values) return kv_errc::length_mismatch;
      if (w.keys != width) return kv_errc::width_mismatch;
      if (w.index >= geometry_.max_tokens_per_seq) return kv_errc::index_out_of_range;
    }
    if (entries.empty()) return {};
    if (!c.initialized) return kv_errc::not_initialized;

    std::size_t stored = c.stored;
    for (const mwrite& w : entries) stored = std::max(stored, w.index + 1);
    const std::size_t nblocks = ceil_div(stored, bt), old_blocks = c.table.size();
    if (ceil_div(nblocks, 32) > max_table_chunks) return kv_errc::capacity_exhausted;
    // New chunks of the table start as a chunk of zero blocks.
    if (ceil_div(nblocks, 32) > ceil_div(old_blocks, 32) && !zero_block(c)) return kv_errc::capacity_exhausted;

    // Blocks made writable, in working_state::prepare's order: the old last
    // block (zeros go past the old end) unless it is the zero block, then
    // each entry's.
    struct call {
      std::size_t block, slot;
    };
    std::vector<call> calls;
    if (stored > c.stored && c.stored % bt != 0 && c.table[(c.stored - 1) / bt] != 0)
      calls.push_back({(c.stored - 1) / bt, c.stored % bt});
    for (const mwrite& w : entries) calls.push_back({w.index / bt, w.index % bt});

    std::vector<std::uint32_t> table = c.table;
    table.resize(nblocks, 0);
    std::vector<std::size_t> fresh, in_place;
    mpool& p = pools[c.pool];
    std::size_t used = in_use(c.pool), taken = 0;
    for (const call& k : calls) {
      if (std::find(fresh.begin(), fresh.end(), k.block) != fresh.end()) continue;  // new this write: ours
      const std::uint32_t id = table[k.block];
      if (id != 0 && id != dropped_block && blocks_[id - 1].owner == c.owner &&
          (k.slot >= blocks_[id - 1].readable || rewritable(c, id, k.slot))) {
        in_place.push_back(k.block);
        continue;
      }
      // A block set aside by set_aside() first (counted already). Blocks
      // taken before a failure stay counted in peak and cow_copies; the
      // budget is charged (peak counted) before the memory is asked for.
      if (!c.set_aside.empty()) {
        c.set_aside.pop_back();  // a fresh id stands for it below
      } else {
        while (used >= p.max) {  // evicting prefix-cache entries, least recently used first
          if (!evict(c.pool)) return kv_errc::capacity_exhausted;
          used = in_use(c.pool) + taken;
        }
        ++taken;
        p.peak = std::max(p.peak, ++used);
        if (!take_memory(c.pool)) return kv_errc::capacity_exhausted;
      }
      if (id != 0 && id != dropped_block) ++p.cow;  // a dropped block: a new one, zero-filled
      fresh.push_back(k.block);
    }
    // Entries past the old end in its last chunk that the write does not
    // set become the zero block.
    const std::size_t old_chunk_end = std::min(nblocks, ceil_div(old_blocks, 32) * 32);
    for (std::size_t b = old_blocks; b < old_chunk_end && !c.has_zero; ++b)
      if (std::find(fresh.begin(), fresh.end(), b) == fresh.end() && !zero_block(c)) return kv_errc::capacity_exhausted;
    for (std::size_t b : fresh) {
      blocks_.push_back({c.pool, c.owner, 0, 0, 0});
      table[b] = static_cast<std::uint32_t>(blocks_.size());
    }
    in_place.insert(in_place.end(), fresh.begin(), fresh.end());
    for (std::size_t b : in_place) {
      mblock& blk = blocks_[table[b] - 1];
      blk.materialized = std::max(blk.materialized, std::min(bt, stored - b * bt));
      c.touched.push_back(table[b]);
    }
    c.data.resize(stored);
    for (const mwrite& w : entries) c.data[w.index] = w.r;
    c.set_aside.clear();  // a set-aside serves one write
    c.table = std::move(table);
    c.stored = stored;
    c.length = std::max(c.length, stored);
    c.changed = true;
    return {};
  }

  /// working_state::set_aside: drop the tokens from `index` on, free what
  /// was set aside, and set aside the fresh blocks a write of `tokens`
  /// tokens from `index` on takes (none for a block written in place).
  ghostlink::error_code reserve(mcache& c, std::size_t index, std::size_t tokens) {
    c.set_aside.clear();
    const std::size_t bt = geometry_.block_tokens;
    std::size_t first = index / bt;
    const std::size_t last = (index + tokens - 1) / bt;
    const std::size_t kept = std::min(c.stored, index);
    if (index % bt != 0 && first < ceil_div(kept, bt) && c.length <= index) {
      const std::uint32_t id = c.table[first];
      if (id != 0 && id != dropped_block && blocks_[id - 1].owner == c.owner &&
          (index % bt >= blocks_[id - 1].readable || rewritable(c, id, index % bt)))
        ++first;
    }
    const bool gap = kept < index && kept % bt != 0;
    const std::size_t needed = last + 1 - first + (gap ? 1 : 0);
    if (!zero_block(c)) return kv_errc::capacity_exhausted;
    mpool& p = pools[c.pool];
    std::size_t used = in_use(c.pool);
    for (std::size_t i = 0; i < needed; ++i) {
      while (used >= p.max) {  // evicting prefix-cache entries, least recently used first
        if (!evict(c.pool)) return kv_errc::capacity_exhausted;
        used = in_use(c.pool) + i;
      }
      p.peak = std::max(p.peak, ++used);
      if (!take_memory(c.pool)) return kv_errc::capacity_exhausted;
    }
    truncate(c, index);
    for (std::size_t i = 0; i < needed; ++i) {
      blocks_.push_back({c.pool, c.owner, 0, 0, 0});
      c.set_aside.push_back(static_cast<std::uint32_t>(blocks_.size()));
    }
    return {};
  }

  ghostlink::error_code truncate(mcache& c, std::size_t n) {
    if (n >= c.length) return {};
    const std::size_t bt = geometry_.block_tokens;
    const std::size_t stored = std::min(c.stored, n);
    const std::size_t nblocks = ceil_div(stored, bt);
    if (nblocks < c.table.size()) {
      seal(c);
      c.table.resize(nblocks);
    }
    if (stored % bt != 0) {
      const std::uint32_t id = c.table[nblocks - 1];
      if (id != 0 && id != dropped_block && blocks_[id - 1].owner == c.owner &&
          blocks_[id - 1].materialized > stored % bt) {
        blocks_[id - 1].materialized = stored % bt;
        blocks_[id - 1].rewound = c.next_epoch;
      }
    }
    if (c.window != 0 && c.kept_from > n) {
      // Cut inside what the window dropped (or into the sinks).
      c.dropped_to = std::min(c.dropped_to, n / bt);
      c.kept_from = std::max(n, c.sinks);
      if (n <= c.sinks) c.dropped_to = ceil_div(c.sinks, bt), c.kept_from = c.sinks;
    }
    c.data.resize(stored);
    c.stored = stored;
    c.length = n;
    c.changed = true;
    return {};
  }

  /// working_state::open, after reserve(): a sequence step's positions
  /// `[index, index + tokens)`, in blocks writable in place, counted as
  /// held; their recipes come with the step's writes (step_write).
  ghostlink::error_code open(mcache& c, std::size_t index, std::size_t tokens) {
    std::vector<mwrite> entries;
    for (std::size_t t = 0; t < tokens; ++t)
      entries.push_back({index + t, geometry_.token_width(), geometry_.token_width(), recipe{}});
    return write(c, entries);
  }

  /// The epoch publish() would make, not made the cache's current one: a
  /// sequence step's, which its commit publishes.
  std::shared_ptr<mepoch> stage(mcache& c) {
    seal(c);
    auto e = std::make_shared<mepoch>();
    e->owner = c.owner;
    e->number = c.next_epoch++;
    e->length = c.length;
    e->stored = c.stored;
    e->data = c.data;
    e->blocks = c.table;
    e->window = c.window;
    e->sinks = c.sinks;
    e->kept_from = c.kept_from;
    epochs_.push_back(e);
    c.changed = false;
    return e;
  }

  /// A step's write of layer `c`: `recipes` at `index` on, into the working
  /// state and into `staged` (the epoch its begin staged, which only the
  /// step reads until then).
  static void step_write(mcache& c, mepoch& staged, std::size_t index, const std::vector<recipe>& recipes) {
    for (std::size_t t = 0; t < recipes.size(); ++t) staged.data[index + t] = c.data[index + t] = recipes[t];
  }

  /// A fork inside a drain of `parent`: the child starts from the working
  /// state, published as the epoch `parent` will publish next.
  std::shared_ptr<mcache> fork(mcache& parent) {
    seal(parent);
    auto c = std::make_shared<mcache>();
    c->pool = parent.pool;
    c->owner = ++owners_;
    c->initialized = parent.initialized;
    c->has_zero = parent.has_zero;
    c->length = parent.length;
    c->stored = parent.stored;
    c->data = parent.data;
    c->table = parent.table;
    c->window = parent.window;
    c->sinks = parent.sinks;
    c->kept_from = parent.kept_from;
    c->dropped_to = parent.dropped_to;
    c->next_epoch = parent.next_epoch;
    c->changed = true;
    publish(*c);
    caches_.push_back(c);
    return c;
  }

  /// working_state::use_layer_layout: `c` becomes a windowed layer (a
  /// window of 0: a full one).
  void use_window(mcache& c, std::size_t window, std::size_t sinks) const {
    c.window = window;
    c.sinks = window != 0 ? sinks : 0;
    c.kept_from = c.sinks;
    c.dropped_to = ceil_div(c.sinks, geometry_.block_tokens);
  }

  /// working_state::drop_before: a windowed layer drops every block wholly
  /// below position `keep` but the sinks'.
  void drop_before(mcache& c, std::size_t keep) {
    if (c.window == 0) return;
    const std::size_t bt = geometry_.block_tokens;
    const std::size_t end = std::min(keep / bt, c.table.size());
    const std::size_t b = std::max(c.dropped_to, ceil_div(c.sinks, bt));
    if (b >= end) return;
    seal(c);
    std::fill(c.table.begin() + static_cast<std::ptrdiff_t>(b), c.table.begin() + static_cast<std::ptrdiff_t>(end),
              dropped_block);
    c.dropped_to = end;
    c.kept_from = std::max(c.kept_from, end * bt);
    c.changed = true;
  }

  /// The end of a drain of `n` requests, all mailed at once into an empty
  /// mailbox: `failed` of them failed, `cancelled` were cancelled before it
  /// took them.
  void end_drain(mcache& c, std::uint64_t n, std::uint64_t failed, std::uint64_t cancelled = 0) {
    if (c.changed) publish(c);
    c.delayed += past_bound(n);
    ++c.drains;
    c.applied += n - failed - cancelled;
    c.failed += failed;
    c.cancelled += cancelled;
  }

  /// `n` requests mailed at once into an empty mailbox and not drained.
  void leave_queued(mcache& c, std::size_t n) {
    c.waiting = past_bound(n);
    c.queued = n - c.waiting;
    c.delayed += c.waiting;
  }

 private:
  /// A rewrite after a rollback: `slot` of block `id` (owned by `c`) was
  /// cut off by a truncate since published, `c` has no epoch alive but its
  /// latest, and no other cache's table or epoch holds the block.
  GHOSTLINK_FUZZ_QUIET bool rewritable(const mcache& c, std::uint32_t id, std::size_t slot) {
    const mblock& b = blocks_[id - 1];
    if (slot < b.materialized || b.rewound >= c.next_epoch) return false;
    std::erase_if(caches_, [](const auto& w) { return w.expired(); });
    std::erase_if(epochs_, [](const auto& w) { return w.expired(); });
    const auto holds = [id](const std::vector<std::uint32_t>& ids) {
      return std::find(ids.begin(), ids.end(), id) != ids.end();
    };
    std::size_t own_epochs = 0;
    for (const auto& w : epochs_) {
      const auto e = w.lock();
      if (e->owner == c.owner)
        ++own_epochs;
      else if (holds(e->blocks))
        return false;
    }
    if (own_epochs != 1) return false;
    for (const mentry& e : entries)
      if (holds(e.blocks)) return false;  // the prefix cache's hold counts
    for (const auto& w : caches_) {
      const auto other = w.lock();
      if (other.get() != &c && holds(other->table)) return false;
    }
    return true;
  }

  /// Of `n` requests mailed at once into an empty mailbox, how many wait for
  /// room (past max_pending).
  std::size_t past_bound(std::size_t n) const { return n > geometry_.max_pending ? n - geometry_.max_pending : 0; }

  /// A request for a block's memory: refused while injected failures remain.
  bool take_memory(std::size_t pool) {
    if (pools[pool].refuse == 0) return true;
    --pools[pool].refuse;
    return false;
  }

  /// The cache's block of zeros, made (outside the budget) on first need.
  bool zero_block(mcache& c) {
    if (!c.has_zero) c.has_zero = take_memory(c.pool);
    return c.has_zero;
  }

  void seal(mcache& c) {
    for (std::uint32_t id : c.touched) {
      mblock& b = blocks_[id - 1];
      b.readable = std::max(b.readable, b.materialized);
    }
    c.touched.clear();
  }

  void publish(mcache& c) { c.current = stage(c); }

  kv_cache_config geometry_;
  std::vector<mblock> blocks_;  // block id i is blocks_[i - 1]
  std::vector<std::weak_ptr<mcache>> caches_;
  std::vector<std::weak_ptr<const mepoch>> epochs_;
  std::vector<char> mark_;
  std::uint64_t owners_ = 0;
};

}  // namespace ghostlink::fuzz
