#pragma once
// The layer-cache part: lineages of caches each owned by one writer
// coroutine (every kind of request, forks that get writers of their own or
// stay frozen), and the arena, one cache written by every lineage writer at
// once, each in its own region. Readers check snapshots of both against the
// writers' models.

#include "ops.hpp"

#include <deque>
#include <functional>

#include "common/asio_compat.hpp"

namespace stress {

/// A cache, its one writer's model and the epochs readers have seen of it.
struct layer_target {
  layer_target(std::string name, std::uint64_t gen, layer_kv_cache cache, std::size_t capacity, state initial)
      : name(std::move(name)), gen(gen), cache(std::move(cache)), hist(capacity, std::move(initial)) {}
  const std::string name;
  const std::uint64_t gen;
  layer_kv_cache cache;
  history hist;
  epoch_registry epochs;
};

/// One cache of `regions * region_tokens` tokens, initialized in full;
/// writer j writes only tokens [j * region_tokens, (j + 1) * region_tokens).
struct arena {
  struct region {
    region(std::uint64_t gen, std::size_t capacity, std::size_t tokens)
        : gen(gen), hist(capacity, state{true, std::vector<std::uint64_t>(tokens, 0)}) {}
    const std::uint64_t gen;
    history hist;
  };
  arena(layer_kv_cache cache, std::size_t regions, std::size_t tokens, std::size_t capacity)
      : cache(std::move(cache)), region_tokens(tokens) {
    for (std::size_t j = 0; j < regions; ++j)
      parts.push_back(std::make_unique<region>(new_generation(), capacity, tokens));
  }
  layer_kv_cache cache;
  const std::size_t region_tokens;
  std::vector<std::unique_ptr<region>> parts;
  epoch_registry epochs;
  std::atomic<bool> rotating{false};
};

/// Caches readers may pick, added and removed by their writers.
template <class Target>
class target_list {
 public:
  void add(std::shared_ptr<Target> t) {
    std::lock_guard lock(mutex_);
    items_.push_back(std::move(t));
  }
  void remove(const std::shared_ptr<Target>& t) {
    std::lock_guard lock(mutex_);
    std::erase(items_, t);
  }
  std::shared_ptr<Target> pick(rng& r) {
    std::lock_guard lock(mutex_);
    return items_.empty() ? nullptr : items_[r.below(items_.size())];
  }
  void clear() {
    std::lock_guard lock(mutex_);
    items_.clear();
  }

 private:
  std::mutex mutex_;
  std::vector<std::shared_ptr<Target>> items_;
};

/// Something that must be running until every writer coroutine has ended.
struct writer_count {
  std::atomic<std::size_t> running{0};
  void enter() { running.fetch_add(1); }
  void leave() {
    std::lock_guard lock(g_verdict.mutex);
    running.fetch_sub(1);
    g_verdict.changed.notify_all();
  }
};
inline writer_count g_writers;

struct layer_world {
  layer_world(asio::thread_pool& io, std::size_t regions, std::uint64_t seed)
      : io(io), pool(kv_block_pool::for_caches(config)), regions(regions), seed(seed) {}
  asio::thread_pool& io;
  const kv_cache_config config{.max_tokens_per_seq = 40, .num_heads = 2, .head_dim = 4, .block_tokens = 4};
  kv_block_pool pool;
  const std::size_t regions;
  const std::uint64_t seed;
  target_list<layer_target> live;
  std::mutex arena_mutex;
  std::shared_ptr<arena> current_arena;
  std::atomic<std::size_t> active_forks{0};
  std::atomic<std::size_t> arenas_made{0};
  static constexpr std::size_t max_active_forks = 4, region_tokens = 6;

  std::shared_ptr<arena> get_arena() {
    std::lock_guard lock(arena_mutex);
    return current_arena;
  }
  /// A cache for an arena: as `config`, sized to hold every region; every
  /// other one with backpressure, so its writers wait for room.
  layer_kv_cache make_arena_cache() {
    kv_cache_config c = config;
    c.max_tokens_per_seq = regions * region_tokens;
    if (arenas_made.fetch_add(1) % 2 == 1) c.max_pending = 3;
    return layer_kv_cache(io, c, pool);
  }
  /// The first arena (later ones are made by the writers).
  void make_arena() {
    auto a = std::make_shared<arena>(make_arena_cache(), regions, region_tokens, 512);
    a->cache.async_initialize(regions * region_tokens, asio::use_future).get();
    current_arena = std::move(a);
  }
  geometry full() const { return {config.token_width(), config.max_tokens_per_seq, 0, config.max_tokens_per_seq}; }
};

// ---- Checks ---------------------------------------------------------------

/// Pins `t`'s latest epoch and checks it against the model: it must equal a
/// state at least as new as every completed request, and agree with what
/// other snapshots of its epoch showed. "" or what differed. The snapshot
/// and its tags are left in `snap`/`tags` (for a reader to keep).
inline std::string verify(layer_target& t, rng& r, kv_snapshot& snap, std::vector<std::uint64_t>& tags) {
  const std::size_t lo = t.hist.completed();
  snap = t.cache.snapshot();
  const std::size_t hi = t.hist.count() - 1;
  std::string error = decode_all(snap, 0, tags);
  if (const kv_snapshot again = t.cache.snapshot(); again.epoch() < snap.epoch())
    error = str("pinned epoch ", snap.epoch(), ", then epoch ", again.epoch());
  std::vector<std::size_t> found;
  if (error.empty()) error = match(t.hist, lo, hi, tags, found);
  if (error.empty()) error = t.epochs.record(snap.epoch(), content_hash(tags), found.front(), found.back());
  if (error.empty()) error = spot_reads(snap, 0, tags, r);
  return error.empty() ? error : str(t.name, " snapshot epoch ", snap.epoch(), ": ", error);
}

/// As verify() for the arena: its size never changes, each region must equal
/// a state of its writer's at least as new as the writer's completed ones.
inline std::string verify(arena& a, rng& r, kv_snapshot& snap, std::vector<std::uint64_t>& tags) {
  std::vector<std::size_t> lo;
  for (const auto& part : a.parts) lo.push_back(part->hist.completed());
  snap = a.cache.snapshot();
  const std::size_t total = a.parts.size() * a.region_tokens;
  std::string error = snap.size() == total ? decode_all(snap, 0, tags) : str("size ", snap.size(), ", not ", total);
  if (const kv_snapshot again = a.cache.snapshot(); again.epoch() < snap.epoch())
    error = str("pinned epoch ", snap.epoch(), ", then epoch ", again.epoch());
  std::vector<std::size_t> found;
  for (std::size_t j = 0; j < a.parts.size() && error.empty(); ++j) {
    const auto seen = std::span<const std::uint64_t>(tags).subspan(j * a.region_tokens, a.region_tokens);
    error = match(a.parts[j]->hist, lo[j], a.parts[j]->hist.count() - 1, seen, found);
    if (!error.empty()) error = str("region ", j, " (g", a.parts[j]->gen, ") ", error);
  }
  if (error.empty()) error = a.epochs.record(snap.epoch(), content_hash(tags), 0, SIZE_MAX);
  if (error.empty()) error = spot_reads(snap, 0, tags, r);
  return error.empty() ? error : str("arena snapshot epoch ", snap.epoch(), ": ", error);
}

template <class Target>
void verify_now(Target& t, std::uint64_t seed) {
  rng r(seed);
  kv_snapshot snap;
  std::vector<std::uint64_t> tags;
  if (std::string e = verify(t, r, snap, tags); !e.empty()) fail("after completion: " + e);
  bump(g_figures.writer_checks);
}

/// Called as each request's handler has run: the result must be the one
/// the model predicted, and (read-your-writes) a snapshot pinned now must
/// include it.
template <class Target>
void on_done(Target& t, history& h, const std::string& name, const planned& op) {
  if (op.ec != op.expected)
    fail(str(name, ": ", op.what(), " completed with \"", op.ec.message(), "\", expected \"", op.expected.message(),
             "\""));
  h.complete(op.p);
  verify_now(t, op.p * 0x9e3779b97f4a7c15ULL ^ h.count());
}

// ---- Writers --------------------------------------------------------------

inline asio::awaitable<void> drive(layer_world& w, std::shared_ptr<layer_target> t, rng r, std::size_t region);

/// A fork's child: a writer of its own (while there are few) or frozen.
inline void adopt_child(layer_world& w, layer_target& parent, planned& op, rng& r,
                        std::deque<std::shared_ptr<layer_target>>& frozen) {
  bump(g_figures.forks);
  if (!op.child.valid()) return fail(str(parent.name, ": fork succeeded with an empty handle"));
  bool active = false;
  if (!stopping() && r.percent(50)) {
    active = w.active_forks.fetch_add(1) < layer_world::max_active_forks;
    if (!active) w.active_forks.fetch_sub(1);
  }
  const std::uint64_t gen = new_generation();
  auto child = std::make_shared<layer_target>(str("fork g", gen, " of ", parent.name), gen, op.child,
                                              active ? r.between(32, 400) : 1, op.fork_state);
  op.child = {};
  verify_now(*child, gen);  // nothing else writes it yet: it must be the fork point
  if (!active) {
    w.live.add(child);
    frozen.push_back(std::move(child));
    if (frozen.size() > 2) w.live.remove(frozen.front()), frozen.pop_front();
    return;
  }
  g_writers.enter();
  asio::co_spawn(w.io, drive(w, std::move(child), rng(r.next()), SIZE_MAX), [&w](const std::exception_ptr& e) {
    w.active_forks.fetch_sub(1);
    if (e) fail("a fork's writer threw");
    g_writers.leave();
  });
}

/// A few requests (1, or a burst of 2..6) on region `j` of the arena; or, if
/// its history is full, a new arena (one writer makes it, the rest go on).
inline asio::awaitable<void> arena_step(layer_world& w, std::size_t j, rng& r) {
  std::shared_ptr<arena> a = w.get_arena();
  arena::region& part = *a->parts[j];
  if (!part.hist.has_room(7)) {
    if (a->rotating.exchange(true)) co_return;
    auto next =
        std::make_shared<arena>(w.make_arena_cache(), w.regions, layer_world::region_tokens, r.between(64, 512));
    auto [ec] =
        co_await next->cache.async_initialize(w.regions * layer_world::region_tokens, as_tuple(asio::use_awaitable));
    if (ec) fail("arena initialize: " + ec.message());
    std::lock_guard lock(w.arena_mutex);
    bump(g_figures.delayed, w.current_arena->cache.stats().requests_delayed);
    w.current_arena = std::move(next);
    bump(g_figures.arena_rotations);
    co_return;
  }
  const geometry g{w.config.token_width(), w.regions * layer_world::region_tokens, j * layer_world::region_tokens,
                   layer_world::region_tokens};
  std::vector<std::unique_ptr<planned>> ops;
  state s = part.hist.last();
  for (std::size_t i = 0, n = r.percent(50) ? 1 : r.between(2, 6); i < n; ++i) {
    ops.push_back(plan(s, g, part.gen, part.hist.count(), r, false, false));
    part.hist.publish(s);
  }
  const std::string name = str("arena region ", j, " (g", part.gen, ")");
  // Named, not a temporary in the co_await: GCC 12 destroys such a
  // temporary's captures twice.
  const auto done = [a, &part, name](const planned& op) { on_done(*a, part.hist, name, op); };
  co_await run_ops(a->cache, ops, done);
  bump(g_figures.arena_requests, ops.size());
}

/// Writes `t` until its history is full or the run stops, then checks it
/// holds exactly the last state. `region`: the arena region this writer
/// also writes (SIZE_MAX for a fork's writer).
inline asio::awaitable<void> drive(layer_world& w, std::shared_ptr<layer_target> t, rng r, std::size_t region) {
  w.live.add(t);
  std::deque<std::shared_ptr<layer_target>> frozen;
  while (!stopping() && t->hist.has_room(7)) {
    if (region != SIZE_MAX && r.percent(25)) {
      co_await arena_step(w, region, r);
      continue;
    }
    std::vector<std::unique_ptr<planned>> ops;
    state s = t->hist.last();
    for (std::size_t i = 0, n = r.percent(50) ? 1 : r.between(2, 6); i < n; ++i) {
      ops.push_back(plan(s, w.full(), t->gen, t->hist.count(), r, true, true));
      t->hist.publish(s);
    }
    const auto done = [t](const planned& op) { on_done(*t, t->hist, t->name, op); };  // named: see arena_step
    co_await run_ops(t->cache, ops, done);
    if (t->cache.size() != t->hist.last().tags.size())  // every request so far has completed
      fail(str(t->name, ": size() ", t->cache.size(), " once all requests completed, the model says ",
               t->hist.last().tags.size()));
    for (auto& op : ops) {
      bump(g_figures.requests);
      switch (op->op) {
        case planned::kind::write: bump(g_figures.writes); break;
        case planned::kind::batch: bump(g_figures.batches); break;
        case planned::kind::initialize: bump(g_figures.initializes); break;
        case planned::kind::truncate: bump(g_figures.truncates); break;
        case planned::kind::fork: adopt_child(w, *t, *op, r, frozen); break;
      }
    }
  }
  verify_now(*t, r.next());  // everything completed: exactly the last state
  bump(g_figures.delayed, t->cache.stats().requests_delayed);
  for (const auto& f : frozen) w.live.remove(f);
  w.live.remove(t);
}

/// Lineage `j`: cache after cache (each a new generation), until the run stops.
inline asio::awaitable<void> lineage(layer_world& w, std::size_t j, rng r) {
  while (!stopping()) {
    const std::uint64_t gen = new_generation();
    kv_cache_config config = w.config;
    if (r.percent(50)) config.max_pending = r.between(1, 8);  // backpressure
    auto t = std::make_shared<layer_target>(str("cache g", gen, " (lineage ", j, ")"), gen,
                                            layer_kv_cache(w.io, config, w.pool), r.between(64, 1024), state{});
    co_await drive(w, std::move(t), rng(r.next()), j);
  }
}

}  // namespace stress
