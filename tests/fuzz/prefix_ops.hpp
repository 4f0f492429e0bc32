#pragma once
// Prefix-cache operations on pool 0's cache: insert (the ids a sequence
// stores, ids given with it, or ids that are not its own: the caller's
// promise broken, which the model mirrors), insert from a sequence of
// another layer count (layer_mismatch, nothing inserted) or of another
// layout (invalid_config), attach of a
// sequence's ids (whole, cut, or with other ids after them) as a new
// sequence that the other operations then write, and clear. Eviction runs
// inside the other operations' writes whenever pool 0's budget is spent.
// An insert's byte also picks its retention (none, a priority for every
// token, overlapping ranges, or a duration), and an attach's moves the
// retention clock on by 0-3 ms: the model's clock, which the real cache
// reads through detail::set_retention_clock.

#include "world.hpp"

#include <array>
#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace ghostlink::fuzz {

/// Ids for a prompt or an insert from sequence `q`'s ids: as they are, cut
/// to a length, or with ids from the input after them.
template <class T>
std::vector<token_id> pick_ids(world<T>& w, const mseq& q) {
  std::vector<token_id> ids = q.ids;
  const std::uint8_t b = w.in.byte();
  if (b % 4 == 1) ids.resize(std::min(ids.size(), w.pick_index(ids.size())));
  if (b % 4 == 2)
    for (std::size_t n = w.in.byte() % 9; n > 0; --n) ids.push_back(static_cast<token_id>(w.in.byte() % 5));
  return ids;
}

/// The retention clock of the run: the model's now_ms, as the real cache
/// reads it (a copy, which outlives the model if a run is abandoned).
inline std::atomic<std::int64_t>& clock_ms() {
  static std::atomic<std::int64_t> ms{0};
  return ms;
}
inline std::chrono::steady_clock::time_point model_now() {
  return std::chrono::steady_clock::time_point{} + std::chrono::milliseconds(clock_ms().load());
}

/// An insert's retention from the high bits `r` (0-31) of its byte: none
/// (r % 4 == 0), or priority p for every token, for blocks 0-1 with block
/// 1's last token in a later range at 100 - p (the last-token rule over
/// overlapping ranges), or for every token for 1-3 ms; `real` gets the
/// same as `modelled`.
inline std::optional<kv_retention> pick_retention(unsigned r, std::size_t bt, mretention& modelled) {
  static constexpr std::array<std::uint8_t, 8> priorities{0, 10, 50, 90, 100, 35, 20, 70};
  if (r % 4 == 0) return std::nullopt;
  const std::uint8_t p = priorities[(r >> 2) % 8];
  kv_retention real;
  switch (r % 4) {
    case 1: real.default_priority = p; break;
    case 2:
      real.ranges = {{.first = 0, .last = 2 * bt, .priority = p},
                     {.first = 2 * bt - 1, .last = 3 * bt - 1, .priority = static_cast<std::uint8_t>(100 - p)}};
      break;
    default:
      real.ranges = {{.priority = p, .duration = std::chrono::milliseconds(1 + (r >> 2) % 3)}};
      real.default_priority = static_cast<std::uint8_t>(100 - p);
      break;
  }
  modelled.default_priority = real.default_priority;
  for (const kv_retention::range& g : real.ranges)
    modelled.ranges.push_back({g.first, g.last, g.priority, g.duration.count()});
  return real;
}

template <class T>
void prefix_op(world<T>& w, std::size_t seq) {
  if (!w.prefix) return;
  const std::uint8_t byte = w.in.byte();
  const std::uint8_t what = byte % 8;
  const std::size_t bt = w.geometry.block_tokens;
  if (what == 0) {
    current_trace().add("prefix_clear");
    w.prefix->clear();
    w.m.entries.clear();
    return;
  }
  if (what <= 3) {  // insert
    if (w.seqs.empty()) return;
    const auto& s = w.seqs[seq % w.seqs.size()];
    const mseq& q = *s.m;
    const bool stored = what == 1;
    std::vector<token_id> ids = stored ? q.ids : (what == 2 ? q.ids : pick_ids(w, q));
    if (stored) ids.resize(static_cast<std::size_t>(std::find(ids.begin(), ids.end(), no_token_id) - ids.begin()));
    current_trace().add(stored ? "prefix_insert_stored" : "prefix_insert", seq % w.seqs.size(), ids.size());
    bool same_layout = q.layers.size() == w.m.prefix_layers;
    for (std::size_t l = 0; same_layout && l < q.layers.size(); ++l)
      same_layout = q.layers[l]->window == w.m.prefix_layout.layers[l].window &&
                    q.layers[l]->sinks == w.m.prefix_layout.layers[l].sink_tokens;
    if (!same_layout || q.pool != 0) {
      try {
        (void)(stored ? w.prefix->insert_stored_tokens(s.real) : w.prefix->insert(s.real, ids));
        fail("prefix insert from a sequence of another layout or pool did not throw");
      } catch (const std::system_error& e) {
        expect_ec(e.code(), q.layers.size() != w.m.prefix_layers ? kv_errc::layer_mismatch : kv_errc::invalid_config,
                  "prefix insert");
      }
      return;
    }
    const std::size_t n = std::min(ids.size(), q.length) / bt * bt;
    const std::vector<kv_block_hash> hashes = w.prefix->block_hashes(std::span(ids).first(n));
    mretention modelled;
    const std::optional<kv_retention> r = pick_retention(byte >> 3, bt, modelled);
    if (r) current_trace().add("retention", byte >> 3);
    const std::size_t want = w.m.insert(q, hashes, modelled);
    const std::size_t got =
        r ? (stored ? w.prefix->insert_stored_tokens(s.real, "", *r) : w.prefix->insert(s.real, ids, "", *r))
          : (stored ? w.prefix->insert_stored_tokens(s.real) : w.prefix->insert(s.real, ids));
    expect_eq(got, want, "prefix insert: entries added");
    return;
  }
  // attach, as a new sequence (when there is room) or looked at and dropped
  w.m.now_ms += (byte >> 3) % 4;
  clock_ms() = w.m.now_ms;
  std::vector<token_id> prompt;
  if (!w.seqs.empty()) prompt = pick_ids(w, *w.seqs[seq % w.seqs.size()].m);
  current_trace().add("prefix_attach", prompt.size());
  const std::vector<kv_block_hash> hashes = w.prefix->block_hashes(prompt);
  expect_eq(w.prefix->match(prompt) / bt, w.m.match(hashes), "prefix match: blocks");
  basic_sequence_kv_cache<T> real = w.prefix->attach(w.io, prompt);
  auto q = std::make_shared<mseq>();
  q->pool = 0;
  q->layers = w.m.attach(hashes);
  q->length = q->layers.empty() ? 0 : q->layers[0]->length;
  q->high_water = q->length;  // the match's length (the cache's layout has no rollback)
  q->ids.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(q->length));
  typename world<T>::seq_slot slot{std::move(real), std::move(q), w.geometry};
  w.check_seq(slot, w.seqs.size());
  if (w.seqs.size() < world<T>::max_seqs && what % 2 == 0) w.seqs.push_back(std::move(slot));
}

}  // namespace ghostlink::fuzz
