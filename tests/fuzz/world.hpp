#pragma once
// The fuzzer's world: the real caches, snapshots, sequences and pools side by
// side with their model, the input being decoded, and the one io_context
// everything runs on. Single-threaded, one operation at a time (or one
// burst into one mailbox), so the model knows exactly what each must do.

#include "check.hpp"
#include "model.hpp"

#include <ghostlink/kv_cache.hpp>
#include "testing/hooks.hpp"

#include "common/asio_compat.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace ghostlink::fuzz {

/// The fuzzer's input, read a byte at a time; zeros once it runs out (so
/// every decoded operation is complete).
class input {
 public:
  input(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  bool more() const { return pos_ < size_; }
  std::uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

template <class T>
struct world {
  struct cache_slot {
    basic_layer_kv_cache<T> real;
    std::shared_ptr<mcache> m;
    kv_cache_config config;  // what real.config() must be
  };
  struct snap_slot {
    basic_kv_snapshot<T> real;
    std::shared_ptr<const mepoch> m;  // null: an empty snapshot
    std::size_t shown = 0;
  };
  struct seq_slot {
    basic_sequence_kv_cache<T> real;
    std::shared_ptr<mseq> m;
    kv_cache_config config;
  };
  struct seq_snap_slot {
    basic_sequence_snapshot<T> real;
    std::vector<std::shared_ptr<const mepoch>> m;
    std::size_t shown = 0;
    std::vector<token_id> ids;  // the model's ids when pinned
  };

  // Caps keep every input's run short; a fork past the cap is made, checked
  // and dropped.
  static constexpr std::size_t max_caches = 8, max_snaps = 8, max_seqs = 3, max_seq_snaps = 3;
  // Each pool is checked after every operation (and kept to the end, where it
  // must count no block in use): past this many, new caches use pool 0.
  static constexpr std::size_t max_pools = 6;

  world(asio::io_context& io, input& in, const kv_cache_config& geometry, bool huge)
      : io(io),
        in(in),
        m(geometry),
        geometry(geometry),
        huge(huge),
        tm(geometry.token_width(), geometry.key_scale, geometry.value_scale) {}

  asio::io_context& io;
  input& in;
  model m;
  const kv_cache_config geometry;  // every cache's shape, no budget
  const bool huge;                 // max_tokens_per_seq is huge (see pick_index)
  const token_model<T> tm;         // what a token stores and reads back as
  std::vector<kv_block_pool> pools;  // pools[i] is m.pools[i]
  std::vector<cache_slot> caches;
  std::vector<snap_slot> snaps;
  std::vector<seq_slot> seqs;
  std::vector<seq_snap_slot> seq_snaps;
  std::uint32_t serial = 0;
  bool abandoned = false;  // requests were left queued: the run ends (see abandon_requests)
  std::vector<std::size_t> used_per_pool;  // check_all's blocks in use per pool
  // The prefix cache on pool 0 (of model.prefix_layers layers), made with it.
  std::optional<basic_kv_prefix_cache<T>> prefix;

  std::size_t width() const { return geometry.token_width(); }
  std::size_t max_tokens() const { return geometry.max_tokens_per_seq; }

  /// A fresh token: its serial unique in this run, its flavour from the input.
  recipe next_recipe() { return {++serial, in.byte()}; }

  /// An index, length or range bound: mostly small (past max_tokens too),
  /// sometimes an edge (max_tokens and its neighbours, `size` and its
  /// neighbours, huge values, SIZE_MAX). In huge mode a value between 64 and
  /// 2^36 becomes small: such a write would make a page table of up to 2^26
  /// chunks (512 MiB) that succeeds, too slow for fuzzing; from 2^36 on the
  /// table bound rejects it.
  std::size_t pick_index(std::size_t size) {
    constexpr std::size_t top = std::numeric_limits<std::size_t>::max();
    const std::uint8_t b = in.byte();
    std::size_t v = 0;
    if (b < 200) {
      v = b % (huge ? 64 : 48);
    } else {
      const std::size_t edges[] = {max_tokens() - 1,
                                   max_tokens(),
                                   max_tokens() + 1,
                                   top,
                                   top - 1,
                                   std::size_t{1} << 32,
                                   std::size_t{1} << 36,
                                   std::size_t{1} << 40,
                                   size,
                                   size - 1,
                                   size + 1,
                                   std::size_t{1} << 63,
                                   size + 7,
                                   size / 2};
      v = edges[b % (sizeof edges / sizeof edges[0])];
    }
    if (huge && v >= 64 && v < (std::size_t{1} << 36)) v %= 64;
    return v;
  }

  /// Lengths of a key span and a value span: mostly the token width, else
  /// off by one, empty, or mismatched with each other.
  std::pair<std::size_t, std::size_t> pick_lengths() {
    const std::size_t w = width();
    switch (in.byte() % 16) {
      case 10: return {w, w + 1};
      case 11: return {w + 1, w};
      case 12: return {w - 1, w - 1};
      case 13: return {0, 0};
      case 14: return {w + 1, w + 1};
      case 15: return {w, 0};
      default: return {w, w};
    }
  }

  /// The floats of `r` for `n` lanes.
  static std::vector<float> floats(recipe r, std::size_t n, bool value) {
    std::vector<float> v(n);
    for (std::size_t lane = 0; lane < n; ++lane) v[lane] = token_model<T>::lane_float(r, lane, value);
    return v;
  }

  /// Runs the io_context one handler at a time until `done()` (and not one
  /// handler more); it must get there.
  template <class Done>
  void run_until(Done done, const char* what) {
    for (int i = 0; !done(); ++i) {
      if (i > 100000) fail(str(what, ": not complete after 100000 handlers"));
      if (io.stopped()) io.restart();
      if (io.run_one() == 0 && !done()) fail(str(what, ": never completed (the io_context ran out of work)"));
    }
  }

  /// run_until(), then whatever else is ready: every operation must
  /// complete and leave no outstanding work behind.
  template <class Done>
  void run_to_completion(Done done, const char* what) {
    run_until(done, what);
    if (io.stopped()) io.restart();
    io.poll();
    if (!io.stopped()) fail(str(what, ": outstanding work left after completion"));
  }

  GHOSTLINK_FUZZ_QUIET void check_cache(const cache_slot& s, std::size_t k, const std::vector<std::size_t>& used) {
    const where what{"cache", k};
    if (!s.real.valid()) fail(str(what, ": handle not valid"));
    const mcache& c = *s.m;
    const mepoch& e = *c.current;
    expect_eq(s.real.size(), e.length, what, "size()");
    expect_eq(s.real.empty(), e.length == 0, what, "empty()");
    check_snapshot(s.real.snapshot(), &e, e.length, tm, what);
    const kv_cache_stats st = s.real.stats();
    expect_eq(st.epoch, e.number, what, "stats().epoch");
    expect_eq(st.size, e.length, what, "stats().size");
    expect_eq(st.drains, c.drains, what, "stats().drains");
    expect_eq(st.requests_applied, c.applied, what, "stats().requests_applied");
    expect_eq(st.requests_failed, c.failed, what, "stats().requests_failed");
    expect_eq(st.requests_cancelled, c.cancelled, what, "stats().requests_cancelled");
    expect_eq(st.requests_delayed, c.delayed, what, "stats().requests_delayed");
    expect_eq(st.requests_queued, c.queued, what, "stats().requests_queued");
    expect_eq(st.requests_waiting, c.waiting, what, "stats().requests_waiting");
    expect_eq(st.blocks_in_use, used[c.pool], what, "stats().blocks_in_use");
    expect_eq(st.bytes_in_use, used[c.pool] * pools[c.pool].block_bytes(), what, "stats().bytes_in_use");
    if (!(s.real.config() == s.config)) fail(str(what, ": config() differs from the one it was made with"));
    if (!(s.real.pool() == pools[c.pool])) fail(str(what, ": pool() is not the pool it was made on"));
  }

  GHOSTLINK_FUZZ_QUIET void check_pool(std::size_t i, std::size_t used) {
    const where what{"pool", i};
    const kv_pool_stats st = pools[i].stats();
    // Keys and values of block_tokens tokens, each width / elements_per<T> stored Ts.
    expect_eq(st.block_bytes, 2 * geometry.block_tokens * tm.units() * sizeof(T), what, "block_bytes");
    expect_eq(st.block_bytes, kv_block_pool::block_bytes_for<T>(geometry), what, "block_bytes_for<T>");
    expect_eq(st.max_blocks, m.pools[i].max, what, "max_blocks");
    expect_eq(st.blocks_in_use, used, what, "blocks_in_use");
    expect_eq(st.peak_blocks_in_use, m.pools[i].peak, what, "peak_blocks_in_use");
    expect_eq(st.cow_copies, m.pools[i].cow, what, "cow_copies");
    expect_eq(st.bytes_in_use(), used * st.block_bytes, what, "bytes_in_use()");
  }

  GHOSTLINK_FUZZ_QUIET void check_seq(const seq_slot& s, std::size_t k) {
    const where what{"sequence", k};
    if (!s.real.valid()) fail(str(what, ": handle not valid"));
    const mseq& q = *s.m;
    expect_eq(s.real.size(), q.length, what, "size()");
    expect_eq(s.real.num_layers(), q.layers.size(), what, "num_layers()");
    if (!(s.real.config() == s.config)) fail(str(what, ": config() differs from the one it was made with"));
    if (!(s.real.pool() == pools[q.pool])) fail(str(what, ": pool() is not the pool it was made on"));
    seq_snap_slot snap{s.real.snapshot(), {}, std::numeric_limits<std::size_t>::max(), q.ids};
    for (const auto& l : q.layers) {
      snap.m.push_back(l->current);
      snap.shown = std::min(snap.shown, l->current->length);
    }
    check_seq_snapshot(snap, {"snapshot of sequence", k});
  }

  GHOSTLINK_FUZZ_QUIET void check_seq_snapshot(const seq_snap_slot& s, where what) {
    expect_eq(s.real.num_layers(), s.m.size(), what, "num_layers()");
    expect_eq(s.real.size(), s.shown, what, "size()");
    expect_eq(s.real.empty(), s.shown == 0, what, "empty()");
    const std::vector<token_id> ids = s.real.token_ids();
    for (std::size_t i = 0; i < ids.size(); ++i)
      expect_eq(ids[i], i < s.ids.size() ? s.ids[i] : no_token_id, what, "token_ids()");
    for (std::size_t i = 0; i < s.m.size(); ++i) {
      what.part = "layer";
      what.part_index = i;
      check_snapshot(s.real.layer(i), s.m[i].get(), s.shown, tm, what);
    }
  }

  /// Everything against the model: every cache, held snapshot (which must
  /// never change), sequence and pool.
  GHOSTLINK_FUZZ_QUIET void check_all() {
    used_per_pool.resize(pools.size());
    for (std::size_t i = 0; i < pools.size(); ++i) used_per_pool[i] = m.in_use(i);
    for (std::size_t k = 0; k < caches.size(); ++k) check_cache(caches[k], k, used_per_pool);
    for (std::size_t k = 0; k < snaps.size(); ++k)
      check_snapshot(snaps[k].real, snaps[k].m.get(), snaps[k].shown, tm, {"held snapshot", k});
    for (std::size_t k = 0; k < seqs.size(); ++k) check_seq(seqs[k], k);
    for (std::size_t k = 0; k < seq_snaps.size(); ++k) check_seq_snapshot(seq_snaps[k], {"held sequence snapshot", k});
    for (std::size_t i = 0; i < pools.size(); ++i) check_pool(i, used_per_pool[i]);
    if (prefix) check_prefix();
  }

  /// The prefix cache's counters and the pool's cached blocks against the model.
  GHOSTLINK_FUZZ_QUIET void check_prefix() {
    const where what{"prefix cache", 0};
    const kv_prefix_stats st = prefix->stats();
    expect_eq(st.cached_blocks, m.entries.size(), what, "stats().cached_blocks");
    expect_eq(st.idle_blocks, m.idle_entries(), what, "stats().idle_blocks");
    expect_eq(st.evicted_blocks, m.evicted, what, "stats().evicted_blocks");
    expect_eq(st.window_evictions, m.window_evicted, what, "stats().window_evictions");
    expect_eq(st.evictions_by_priority == m.evicted_by_band, true, what, "stats().evictions_by_priority");
    expect_eq(st.inserted_blocks, m.inserted, what, "stats().inserted_blocks");
    const auto [cached, idle] = m.cached_blocks();
    const kv_pool_stats ps = pools[0].stats();
    expect_eq(ps.blocks_cached, cached, what, "pool blocks_cached");
    expect_eq(ps.blocks_cached_idle, idle, what, "pool blocks_cached_idle");
    const std::size_t used = m.in_use(0), max = m.pools[0].max;
    expect_eq(ps.blocks_available, (used < max ? max - used : 0) + m.reclaimable_blocks(), what,
              "pool blocks_available");
  }

  /// Adds a pool to the model and its handle to the world.
  std::size_t adopt_pool(const kv_block_pool& p, std::size_t max) {
    pools.push_back(p);
    return m.add_pool(max);
  }

  /// A new root layer cache: on pool 0 (shared), or on a private pool with
  /// `budget` blocks.
  void new_cache(bool private_pool, std::size_t budget) {
    if (caches.size() >= max_caches) return;
    if (!private_pool || pools.size() >= max_pools) {
      caches.push_back({basic_layer_kv_cache<T>(io, geometry, pools[0]), m.make_cache(0, false), geometry});
      return;
    }
    kv_cache_config c = geometry;
    c.max_blocks = budget;
    basic_layer_kv_cache<T> real(io, c);
    const std::size_t pool = adopt_pool(real.pool(), budget);
    caches.push_back({std::move(real), m.make_cache(pool, false), c});
  }

  /// A new sequence of `layout`: on pool 0, or on a private pool.
  void new_sequence(const kv_model_layout& layout, bool private_pool, std::size_t budget) {
    if (seqs.size() >= max_seqs) return;
    kv_cache_config c = geometry;
    std::size_t pool = 0;
    basic_sequence_kv_cache<T> real;
    if (private_pool && pools.size() < max_pools) {
      c.max_blocks = budget;
      real = basic_sequence_kv_cache<T>(io, layout, c);
      pool = adopt_pool(real.pool(), budget);
    } else {
      real = basic_sequence_kv_cache<T>(io, layout, c, pools[0]);
    }
    if (!(real.layout() == layout)) fail("layout() differs from the one the sequence was made with");
    auto q = std::make_shared<mseq>();
    q->pool = pool;
    q->rollback = layout.rollback_tokens;
    for (const kv_layer_layout& l : layout.layers)
      q->layers.push_back(m.make_cache(pool, true, l.window, l.sink_tokens));
    seqs.push_back({std::move(real), std::move(q), c});
  }

  /// A layout from the input: `layers` full layers, or (half the time)
  /// windows of 1-8 tokens with 0-3 sinks on every layer or on all but
  /// every second or third, and 0-3 tokens of rollback.
  kv_model_layout pick_layout(std::size_t layers) {
    const std::uint8_t b = in.byte();
    if (b % 2 == 0) return kv_model_layout::full(layers);
    if (b % 4 == 1 && m.prefix_layout.windowed()) {  // the prefix cache's, so that its inserts take it
      kv_model_layout l = m.prefix_layout;
      l.rollback_tokens = b / 4 % 4;
      return l;
    }
    const std::size_t window = 1 + b / 2 % 8, sinks = b / 16 % 4, period = 1 + b / 64 % 3;
    kv_model_layout l = period == 1 ? kv_model_layout::sliding(layers, window, sinks)
                                    : kv_model_layout::interleaved(layers, period, window, sinks);
    l.rollback_tokens = in.byte() % 4;
    return l;
  }
};

}  // namespace ghostlink::fuzz
