#pragma once
// Reader threads: pin snapshots of random caches, arenas and sequences and
// check each against its writer's model; keep a few and check them again
// later (a snapshot never changes, whatever is written, truncated or forked
// meanwhile); read through the cache's own async reads too.

#include "sequence.hpp"

#include "common/asio_compat.hpp"

namespace stress {

class reader {
 public:
  reader(layer_world& lw, seq_world& sw, std::uint64_t seed) : lw_(lw), sw_(sw), r_(seed) {}

  void run() {
    while (!stopping()) {
      const std::size_t roll = r_.below(100);
      if (roll < 45)
        check_layer();
      else if (roll < 60)
        check_arena();
      else if (roll < 85)
        check_sequence();
      else if (roll < 90)
        async_read();
      else
        recheck();
      settle_claims();
    }
    kept_layers_.clear();
    kept_seqs_.clear();
    std::lock_guard lock(sw_.claims_mutex);
    for (claim& c : claims_) sw_.open_claims.push_back(std::move(c));
  }

 private:
  struct kept_layer {
    kv_snapshot snap;
    std::uint64_t epoch;
    std::vector<std::uint64_t> tags;
    std::string what;
  };
  struct kept_seq {
    sequence_kv_cache::snapshot_type snap;
    std::vector<std::uint64_t> tags;
    std::string what;
  };
  static constexpr std::size_t max_kept = 6;

  void keep(kv_snapshot& snap, const std::vector<std::uint64_t>& tags, const std::string& what) {
    if (kept_layers_.size() >= max_kept)
      kept_layers_.erase(kept_layers_.begin() + static_cast<std::ptrdiff_t>(r_.below(max_kept)));
    const std::uint64_t epoch = snap.epoch();
    kept_layers_.push_back({std::move(snap), epoch, tags, what});
  }

  void check_layer() {
    std::shared_ptr<layer_target> t = lw_.live.pick(r_);
    if (!t) return;
    kv_snapshot snap;
    if (std::string e = verify(*t, r_, snap, tags_); !e.empty()) return fail(e);
    bump(g_figures.layer_snapshots);
    if (r_.percent(10)) keep(snap, tags_, t->name);
  }

  void check_arena() {
    std::shared_ptr<arena> a = lw_.get_arena();
    kv_snapshot snap;
    if (std::string e = verify(*a, r_, snap, tags_); !e.empty()) return fail(e);
    bump(g_figures.arena_snapshots);
    if (r_.percent(5)) keep(snap, tags_, "arena");
  }

  void check_sequence() {
    std::shared_ptr<seq_target> t = sw_.live.pick(r_);
    if (!t) return;
    sequence_kv_cache::snapshot_type snap;
    std::vector<std::size_t> found;
    if (std::string e = verify(*t, r_, snap, tags_, found); !e.empty()) return fail(e);
    bump(g_figures.seq_snapshots);
    claim c{t, found, t->name};
    const int j = judge(t->hist, found);
    if (j < 0) return fail(failed_claim(c));
    if (j == 0) claims_.push_back(std::move(c));
    if (r_.percent(20))
      if (std::string e = hot_pins(*t, 64); !e.empty()) return fail(e);
    if (r_.percent(10)) {
      if (kept_seqs_.size() >= max_kept)
        kept_seqs_.erase(kept_seqs_.begin() + static_cast<std::ptrdiff_t>(r_.below(max_kept)));
      kept_seqs_.push_back({std::move(snap), tags_, t->name});
    }
  }

  /// async_read_range through the cache (not a snapshot): it reads the
  /// latest epoch, so it must equal a state at least as new as every
  /// request completed before it started.
  void async_read() {
    std::shared_ptr<layer_target> t = lw_.live.pick(r_);
    if (!t) return;
    const std::size_t lo = t->hist.completed();
    const std::size_t n = t->hist.at(lo).tags.size();
    const std::size_t b = r_.below(n + 1), e = r_.between(b, n);
    ghostlink::error_code ec;
    kv_range range;
    try {
      range = layer_kv_cache(t->cache).async_read_range(b, e, asio::use_future).get();
    } catch (const ghostlink::test::async_error& err) {
      ec = err.code();
    }
    const std::size_t hi = t->hist.count() - 1;
    bump(g_figures.async_reads);
    bool ok = false;
    std::string error;
    std::vector<std::uint64_t> seen;
    const std::size_t w = lw_.config.token_width();
    for (std::size_t i = b; !ec && i < e && error.empty(); ++i)
      seen.push_back(decode(std::span<const float>(range.keys).subspan((i - b) * w, w),
                            std::span<const float>(range.values).subspan((i - b) * w, w), i, 0, error));
    for (std::size_t p = lo; p <= hi && !ok && error.empty(); ++p) {
      const std::vector<std::uint64_t>& tags = t->hist.at(p).tags;
      if (ec)
        ok = ec == kv_errc::range_out_of_bounds && tags.size() < e;
      else
        ok = tags.size() >= e && std::equal(seen.begin(), seen.end(), tags.begin() + static_cast<std::ptrdiff_t>(b));
    }
    if (!ok)
      fail(str(t->name, ": async_read_range(", b, ", ", e, ") ", ec ? "failed: " + ec.message() : "read " + error,
               " - matches no state in [", lo, ", ", hi, "]"));
  }

  void recheck() {
    if (r_.percent(50) && !kept_layers_.empty()) {
      const std::size_t i = r_.below(kept_layers_.size());
      kept_layer& k = kept_layers_[i];
      std::vector<std::uint64_t> now;
      std::string e = k.snap.epoch() == k.epoch ? decode_all(k.snap, 0, now) : "its epoch number changed";
      if (e.empty() && now != k.tags) e = describe_diff(now, state{true, k.tags});
      if (e.empty()) e = spot_reads(k.snap, 0, k.tags, r_);
      if (!e.empty()) return fail(str("kept snapshot of ", k.what, " (epoch ", k.epoch, ") changed: ", e));
      bump(g_figures.retained_checks);
      if (r_.percent(30)) kept_layers_.erase(kept_layers_.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (!kept_seqs_.empty()) {
      const std::size_t i = r_.below(kept_seqs_.size());
      kept_seq& k = kept_seqs_[i];
      std::vector<std::uint64_t> now;
      std::string e = k.snap.size() == k.tags.size() ? "" : str("size ", k.snap.size(), ", was ", k.tags.size());
      for (std::size_t l = 0; l < k.snap.num_layers() && e.empty(); ++l) {
        e = decode_all(k.snap.layer(l), l, now);
        if (e.empty() && !shows(now, k.tags)) e = str("layer ", l, ": ", describe_diff(now, state{true, k.tags}));
      }
      if (!e.empty()) return fail(str("kept snapshot of ", k.what, " changed: ", e));
      bump(g_figures.retained_checks);
      if (r_.percent(30)) kept_seqs_.erase(kept_seqs_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }

  void settle_claims() {
    std::erase_if(claims_, [](const claim& c) {
      const int j = judge(c.target->hist, c.found);
      if (j < 0) fail(failed_claim(c));
      return j != 0;
    });
  }

  layer_world& lw_;
  seq_world& sw_;
  rng r_;
  std::vector<std::uint64_t> tags_;
  std::vector<kept_layer> kept_layers_;
  std::vector<kept_seq> kept_seqs_;
  std::vector<claim> claims_;
};

}  // namespace stress
