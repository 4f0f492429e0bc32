#pragma once
// The sequence part: sequences of 3 layers on one pool with a tight budget,
// each written by one coroutine (appends, truncates, forks, and a second
// operation started while one is in progress), and a prefix cache on the
// pool that the writers insert into, attach from and clear, so that its
// evictions run inside their appends. Two thirds of the sequences have
// windowed layers (seq_world::layout): readers check what they hold, that
// their dropped positions read as outside_window, and that the next
// token's window is always held; truncates that reach back past
// rollback_tokens may be refused. Appends may fail with
// capacity_exhausted: their state is published `pending` and a snapshot
// that shows it is judged once the writer knows the outcome.

#include "layer.hpp"

#include <chrono>
#include <optional>
#include <thread>

namespace stress {

struct seq_target {
  seq_target(std::string name, std::uint64_t gen, sequence_kv_cache seq, std::size_t capacity, state initial,
             std::size_t high_water)
      : name(std::move(name)),
        gen(gen),
        seq(std::move(seq)),
        layout(this->seq.layout()),
        hist(capacity, std::move(initial)),
        high_water(high_water) {}
  const std::string name;
  const std::uint64_t gen;
  sequence_kv_cache seq;
  const kv_model_layout layout;
  history hist;
  /// Writer only: at least the sequence's high-water mark h (the most
  /// tokens it held; a truncate reaching back past rollback_tokens may
  /// lower h, never raise it). A truncate to `n + rollback_tokens >= h`
  /// must succeed.
  std::size_t high_water;

  /// Whether a truncate to `n` may fail with outside_window.
  bool window_may_refuse(std::size_t n) const { return layout.windowed() && n + layout.rollback_tokens < high_water; }
  /// The shortest length a truncate surely reaches, at most `size`.
  std::size_t surely_truncatable(std::size_t size) const {
    if (!layout.windowed() || high_water <= layout.rollback_tokens) return 0;
    return std::min(size, high_water - layout.rollback_tokens);
  }
};

/// A snapshot's matching states that were still pending when it was checked.
struct claim {
  std::shared_ptr<seq_target> target;
  std::vector<std::size_t> found;
  std::string what;
};

/// 1 if one of `found` succeeded, -1 if all failed, 0 if it is not known yet.
inline int judge(const history& h, const std::vector<std::size_t>& found) {
  bool pending = false;
  for (std::size_t p : found) {
    const outcome o = h.outcome_of(p);
    if (o == outcome::ok) return 1;
    pending = pending || o == outcome::pending;
  }
  return pending ? 0 : -1;
}

inline std::string failed_claim(const claim& c) {
  return str(c.what, ": shows state ", c.found.front(), " of a request that failed (its token must never be seen)");
}

struct seq_world {
  seq_world(asio::thread_pool& io, std::size_t sequences) : io(io) {
    for (std::size_t k = 0; k < 3; ++k) {
      pools.push_back(kv_block_pool::for_caches(config, {.max_blocks = 12 * (sequences + 2)}));
      prefixes.emplace_back(layout(k), config, pools.back());
    }
  }
  asio::thread_pool& io;
  const kv_cache_config config{.max_tokens_per_seq = 24, .num_heads = 2, .head_dim = 4, .block_tokens = 4};
  static constexpr std::size_t layers = 3, max_active_forks = 3;
  /// pools[k] holds the sequences of layout(k), and prefixes[k], a prefix
  /// cache of that layout.
  std::vector<kv_block_pool> pools;
  std::vector<kv_prefix_cache> prefixes;
  kv_prefix_cache& prefix_for(const kv_model_layout& l) {
    for (std::size_t k = 0; k < 3; ++k)
      if (layout(k) == l) return prefixes[k];
    return prefixes[0];
  }
  /// A new sequence's layout, by `pick % 3`: full; two windowed layers
  /// beside a full one, with a sink and 2 tokens of rollback; or every
  /// layer windowed, with 2 sinks and 1 token of rollback.
  static kv_model_layout layout(std::size_t pick) {
    kv_model_layout l = kv_model_layout::full(layers);
    if (pick % 3 == 1) l = kv_model_layout::interleaved(layers, 3, 5, 1), l.rollback_tokens = 2;
    if (pick % 3 == 2) l = kv_model_layout::sliding(layers, 3, 2), l.rollback_tokens = 1;
    return l;
  }
  target_list<seq_target> live;
  std::atomic<std::size_t> active_forks{0};
  std::mutex claims_mutex;
  std::vector<claim> open_claims;  // readers' unresolved claims at their end
};

/// The token id a step stores with a token of `tag`, and the prefix cache
/// hashes: a mix of the whole tag (31 bits, never no_token_id), so that
/// equal ids at a position mean, but for a 2^-31 chance per token, the same
/// tag and so the same keys and values.
inline token_id id_of(std::uint64_t tag) {
  std::uint64_t z = tag + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return static_cast<token_id>((z ^ (z >> 31)) & 0x7fffffff);
}

/// The ids of a state's tokens.
inline std::vector<token_id> ids_of(const std::vector<std::uint64_t>& tags) {
  std::vector<token_id> ids(tags.size());
  for (std::size_t i = 0; i < tags.size(); ++i) ids[i] = id_of(tags[i]);
  return ids;
}

/// A layer's snapshot against its layout: its window and sinks, and every
/// position the next token attends held (a window drops only what no later
/// token attends, and a truncate is refused rather than cut into a dropped
/// window). "" or what is wrong.
inline std::string window_held(const kv_snapshot& layer, const kv_layer_layout& want) {
  if (layer.window() != want.window || layer.sink_tokens() != want.sink_tokens)
    return str("window ", layer.window(), " with ", layer.sink_tokens(), " sinks, the layout's ", want.window, " with ",
               want.sink_tokens);
  const std::size_t n = layer.size(), w = layer.window();
  const std::size_t need = std::max(layer.sink_tokens(), w > 0 && n + 1 > w ? n + 1 - w : 0);
  if (w == 0 ? layer.kept_from() != 0 : layer.kept_from() > need)
    return str("kept_from() ", layer.kept_from(), " of ", n, " tokens (window ", w, ", ", layer.sink_tokens(),
               " sinks): the next token attends from ", need);
  return {};
}

/// Pins the sequence and checks every layer shows the same tokens, each
/// from one append, equal to a state at least as new as every completed
/// operation. "" or what differed; `found` gets the matching states.
inline std::string verify(seq_target& t, rng& r, sequence_kv_cache::snapshot_type& snap,
                          std::vector<std::uint64_t>& tags, std::vector<std::size_t>& found) {
  const std::size_t lo = t.hist.completed();
  snap = t.seq.snapshot();
  const std::size_t hi = t.hist.count() - 1;
  std::string error;
  if (snap.num_layers() != seq_world::layers) error = str(snap.num_layers(), " layers");
  std::vector<std::uint64_t> other;
  for (std::size_t l = 0; l < snap.num_layers() && error.empty(); ++l) {
    if (snap.layer(l).size() != snap.size()) {
      error = str("layer ", l, " shows ", snap.layer(l).size(), " tokens, the snapshot ", snap.size());
      break;
    }
    error = window_held(snap.layer(l), t.layout.layers[l]);
    if (error.empty()) error = decode_all(snap.layer(l), l, l == 0 ? tags : other);
    // `tags`: every layer's tokens where it holds them (unheld where none does).
    for (std::size_t i = 0; l > 0 && error.empty() && i < tags.size(); ++i) {
      if (tags[i] != unheld && other[i] != unheld && other[i] != tags[i])
        error = str("token ", i, ": layer 0 shows ", tag_name(tags[i]), ", layer ", l, " ", tag_name(other[i]));
      if (tags[i] == unheld) tags[i] = other[i];
    }
  }
  if (error.empty() && snap.num_layers() > 0) {
    const std::size_t l = r.below(snap.num_layers());
    if (l > 0) error = decode_all(snap.layer(l), l, other);  // spot_reads checks against this layer's own tags
    if (error.empty()) error = spot_reads(snap.layer(l), l, l == 0 ? tags : other, r);
  }
  // A token's id (given only by steps, see step_append) belongs to its tag.
  const std::vector<token_id> ids = snap.token_ids();
  for (std::size_t i = 0; error.empty() && i < ids.size() && i < tags.size(); ++i)
    if (ids[i] != no_token_id && tags[i] != unheld && ids[i] != id_of(tags[i]))
      error = str("token ", i, " (", tag_name(tags[i]), ") has id ", ids[i], ", not ", id_of(tags[i]));
  if (error.empty()) error = match(t.hist, lo, hi, tags, found);
  return error.empty() ? error : str(t.name, " snapshot of ", snap.size(), " tokens: ", error);
}

/// Pins `t` `times` times in a row and checks only that every layer shows
/// the same tag at every token (read from lanes 0, 1 and 3, unverified): a
/// cheap loop, so most of a reader's time is spent pinning, where a removal
/// and a new append landing between two layers' pins would mix tokens.
inline std::string hot_pins(const seq_target& t, std::size_t times) {
  std::vector<std::uint64_t> first, other;
  auto tags_of = [](const kv_snapshot& s, std::vector<std::uint64_t>& out) {
    out.assign(s.size(), unheld);
    const std::size_t w = s.token_width();
    for (const auto& [b, e] : held_ranges(s))
      (void)s.for_each_block(b, e, [&](std::size_t at, std::size_t count, auto keys, auto) {
        for (std::size_t i = 0; i < count; ++i) {
          const auto gen = static_cast<std::uint64_t>(keys[i * w]) | (static_cast<std::uint64_t>(keys[i * w + 3]) >> 4)
                                                                         << 24;
          out[at + i] = make_tag(gen, static_cast<std::uint64_t>(keys[i * w + 1]));
        }
      });
  };
  for (std::size_t n = 0; n < times; ++n) {
    const sequence_kv_cache::snapshot_type snap = t.seq.snapshot();
    for (std::size_t l = 0; l < snap.num_layers(); ++l) {
      tags_of(snap.layer(l), l == 0 ? first : other);
      for (std::size_t i = 0; l > 0 && i < first.size(); ++i)
        if (first[i] != other[i] && first[i] != unheld && other[i] != unheld)
          return str(t.name, " snapshot of ", snap.size(), " tokens (pinned in a tight loop): token ", i,
                     ": layer 0 shows ", tag_name(first[i]), ", layer ", l, " ", tag_name(other[i]));
    }
  }
  bump(g_figures.hot_pins, times);
  return {};
}

/// The writer's read-your-writes check once its operation has settled:
/// everything is resolved, so the snapshot is judged at once.
inline void verify_settled(seq_target& t, rng& r) {
  sequence_kv_cache::snapshot_type snap;
  std::vector<std::uint64_t> tags;
  std::vector<std::size_t> found;
  std::string error = verify(t, r, snap, tags, found);
  if (error.empty() && judge(t.hist, found) != 1) error = failed_claim({nullptr, found, t.name});
  if (error.empty() && t.seq.size() != t.hist.last().tags.size())
    error = str(t.name, ": size() is ", t.seq.size(), " after the last operation completed, the model says ",
                t.hist.last().tags.size());
  if (!error.empty()) fail("after completion: " + error);
  bump(g_figures.writer_checks);
}

/// `count` tokens for every layer (one, or a prefill chunk), token `index +
/// t` encoded with `tag`, each layer's tokens back to back.
struct step_buffers {
  std::vector<std::vector<float>> layer_keys, layer_values;
  std::vector<std::span<const float>> keys, values;
  step_buffers(std::size_t layers, std::size_t width, std::uint64_t tag, std::size_t index, std::size_t count = 1)
      : layer_keys(layers), layer_values(layers) {
    for (std::size_t l = 0; l < layers; ++l)
      for (std::size_t t = 0; t < count; ++t) {
        const token_buffer b(width, tag, index + t, l);
        layer_keys[l].insert(layer_keys[l].end(), b.keys.begin(), b.keys.end());
        layer_values[l].insert(layer_values[l].end(), b.values.begin(), b.values.end());
      }
    for (std::size_t l = 0; l < layers; ++l) keys.emplace_back(layer_keys[l]), values.emplace_back(layer_values[l]);
  }
};

/// Records how an operation that may fail ended: `p` succeeded, or failed
/// with one of the errors allowed (then the state before it is published
/// again); anything else fails the run.
inline void settle(seq_target& t, std::size_t p, ghostlink::error_code ec, const std::vector<kv_errc>& allowed,
                   const char* what) {
  if (!ec) {
    t.hist.resolve(p, outcome::ok);
    t.hist.complete(p);
    t.high_water = std::max(t.high_water, t.hist.at(p).tags.size());
    return;
  }
  if (std::find(allowed.begin(), allowed.end(), static_cast<kv_errc>(ec.value())) == allowed.end() ||
      ec.category() != kv_category())
    return fail(str(t.name, ": ", what, " (request ", p, ") failed: ", ec.message()));
  if (ec == kv_errc::capacity_exhausted) bump(g_figures.append_capacity_failures);
  if (ec == kv_errc::outside_window) bump(g_figures.window_truncates_refused);
  t.hist.resolve(p, outcome::failed);
  t.hist.complete(t.hist.publish(t.hist.at(p - 1)));
}

inline asio::awaitable<void> seq_drive(seq_world& w, std::shared_ptr<seq_target> t, rng r);

/// The errors a truncate of `t` to `n` may fail with.
inline std::vector<kv_errc> truncate_errors(const seq_target& t, std::size_t n) {
  if (t.window_may_refuse(n)) return {kv_errc::outside_window};
  return {};
}

/// `high_water`: at least the child's own (an attached windowed sequence's
/// is the match's length plus rollback_tokens).
inline void adopt_child(seq_world& w, seq_target& parent, sequence_kv_cache child, const state& at, rng& r,
                        std::deque<std::shared_ptr<seq_target>>& frozen, std::size_t high_water = 0) {
  bump(g_figures.seq_forks);
  if (!child.valid()) return fail(parent.name + ": fork succeeded with an empty handle");
  bool active = false;
  if (!stopping() && r.percent(50)) {
    active = w.active_forks.fetch_add(1) < seq_world::max_active_forks;
    if (!active) w.active_forks.fetch_sub(1);
  }
  const std::uint64_t gen = new_generation();
  high_water = std::max(high_water, child.layout().windowed() ? parent.high_water : at.tags.size());
  auto c = std::make_shared<seq_target>(str("sequence fork g", gen, " of ", parent.name), gen, std::move(child),
                                        active ? r.between(16, 200) : 1, at, high_water);
  verify_settled(*c, r);
  if (!active) {
    w.live.add(c);
    frozen.push_back(std::move(c));
    if (frozen.size() > 2) w.live.remove(frozen.front()), frozen.pop_front();
    return;
  }
  g_writers.enter();
  asio::co_spawn(w.io, seq_drive(w, std::move(c), rng(r.next())), [&w](const std::exception_ptr& e) {
    w.active_forks.fetch_sub(1);
    if (e) fail("a sequence fork's writer threw");
    g_writers.leave();
  });
}

/// Starts an append of `count` tokens from `s.tags.size()` on (state
/// published pending).
inline std::size_t publish_append(seq_target& t, const state& s, std::uint64_t& tag, std::size_t count = 1) {
  state next = s;
  tag = make_tag(t.gen, t.hist.count());
  next.tags.insert(next.tags.end(), count, tag);
  return t.hist.publish(std::move(next), outcome::pending);
}

/// A truncate, then a second operation at once (an append or a truncate):
/// the second fails with operation_in_progress unless the first has
/// already completed, in which case it runs after it.
inline asio::awaitable<void> conflict(seq_world& w, seq_target& t, rng& r) {
  const state& s = t.hist.last();
  state after_a = s;
  // Never refused: the second operation is built on it.
  after_a.tags.resize(
      std::max(t.surely_truncatable(s.tags.size()), std::min(s.tags.size(), r.below(s.tags.size() + 1))));
  const std::size_t pa = t.hist.publish(after_a);
  const bool append = after_a.tags.size() < w.config.max_tokens_per_seq && r.percent(60);
  std::uint64_t tag = 0;
  std::size_t pb = 0;
  std::unique_ptr<step_buffers> step;
  if (append) {
    pb = publish_append(t, after_a, tag);
    step = std::make_unique<step_buffers>(seq_world::layers, w.config.token_width(), tag, after_a.tags.size());
  } else {
    state after_b = after_a;
    after_b.tags.resize(std::min(after_a.tags.size(), r.below(after_a.tags.size() + 1)));
    pb = t.hist.publish(std::move(after_b), outcome::pending);
  }
  auto channel = std::make_shared<completion_channel>(co_await asio::this_coro::executor, 2);
  ghostlink::error_code ecs[2];
  auto handler = [channel, &ecs](std::size_t i) {
    return [channel, &ecs, i](ghostlink::error_code ec) {
      ecs[i] = ec;
      if (!channel->try_send(asio::error_code(), i)) fail("completion channel full");
    };
  };
  t.seq.async_truncate(after_a.tags.size(), handler(0));
  if (append)
    t.seq.async_append(step->keys, step->values, handler(1));
  else
    t.seq.async_truncate(t.hist.at(pb).tags.size(), handler(1));
  for (int i = 0; i < 2; ++i) co_await channel->async_receive(as_tuple(asio::use_awaitable));
  bump(g_figures.conflicts);
  if (ecs[1] == kv_errc::operation_in_progress) bump(g_figures.conflicts_rejected);
  settle(t, pa, ecs[0], {}, "the first operation of a conflict, a truncate");
  if (append)
    settle(t, pb, ecs[1], {kv_errc::operation_in_progress, kv_errc::capacity_exhausted}, "conflicting append");
  else {
    std::vector<kv_errc> allowed = truncate_errors(t, t.hist.at(pb).tags.size());
    allowed.push_back(kv_errc::operation_in_progress);
    settle(t, pb, ecs[1], allowed, "conflicting truncate");
  }
}

/// An append of `step`'s `count` tokens through a step, with their ids
/// (id_of(tag)): begin, each layer
/// written in a random order and its own snapshot checked (the sequence's
/// readers must not see the tokens: nothing is published yet), then the
/// state published pending and committed; a tenth of the time abandoned
/// instead (nothing is published: no reader may ever see its tokens). Three
/// times in ten the layers are written from two threads at once instead.
inline asio::awaitable<void> step_append(seq_target& t, const state& s, std::uint64_t tag, const step_buffers& step,
                                         std::size_t count, rng& r) {
  bump(g_figures.steps);
  const std::vector<token_id> ids(count, id_of(tag));
  auto [ec, open] = co_await t.seq.async_begin_step(std::span<const token_id>(ids), as_tuple(asio::use_awaitable));
  if (ec == kv_errc::capacity_exhausted) {
    bump(g_figures.append_capacity_failures);
    co_return;
  }
  if (ec) co_return fail(str(t.name, ": step begin of ", count, ": ", ec.message()));
  std::vector<std::size_t> order(seq_world::layers);
  for (std::size_t l = 0; l < order.size(); ++l) order[l] = l;
  for (std::size_t l = 0; l + 1 < order.size(); ++l) std::swap(order[l], order[l + r.below(order.size() - l)]);
  std::vector<std::uint64_t> want = s.tags, seen;
  want.insert(want.end(), count, tag);
  if (r.percent(30)) {
    // A forward pass split over two threads: every other layer written by
    // a thread of its own while this one writes the rest, at once.
    bump(g_figures.steps_two_threads);
    ghostlink::error_code other_ec;
    std::thread other([&] {
      for (std::size_t i = 1; i < order.size(); i += 2)
        if (ghostlink::error_code e = open.write(order[i], step.keys[order[i]], step.values[order[i]])) other_ec = e;
    });
    ghostlink::error_code mine;
    for (std::size_t i = 0; i < order.size(); i += 2)
      if (ghostlink::error_code e = open.write(order[i], step.keys[order[i]], step.values[order[i]])) mine = e;
    other.join();
    if (mine || other_ec)
      co_return fail(str(t.name, ": step write on two threads: ", (mine ? mine : other_ec).message()));
    std::uint64_t published_tag = 0;
    const std::size_t p = publish_append(t, s, published_tag, count);
    if (published_tag != tag) co_return fail(str(t.name, ": step tag ", tag_name(tag), " is not the next state's"));
    auto [cec] = co_await open.async_commit(as_tuple(asio::use_awaitable));
    settle(t, p, cec, {}, "step commit after writes on two threads");
    for (std::size_t l = 0; l < seq_world::layers && !cec; ++l) {
      const std::string error = decode_all(open.snapshot(l), l, seen);
      if (!error.empty() || !shows(seen, want))
        co_return fail(str(t.name, ": layer ", l, " after the commit of writes on two threads: ", error, seen.size(),
                           " tokens, ", want.size(), " expected"));
    }
    co_return;
  }
  for (std::size_t l : order) {
    if (ghostlink::error_code wec = open.write(l, step.keys[l], step.values[l]))
      co_return fail(str(t.name, ": step write of layer ", l, ": ", wec.message()));
    const std::string error = decode_all(open.snapshot(l), l, seen);
    if (!error.empty() || !shows(seen, want))
      co_return fail(str(t.name, ": step snapshot of layer ", l, " after its write: ", error.empty() ? "" : error,
                         seen.size(), " tokens, ", want.size(), " expected"));
  }
  if (r.percent(10)) {
    bump(g_figures.steps_abandoned);
    auto [aec] = co_await open.async_abandon(as_tuple(asio::use_awaitable));
    if (aec) fail(str(t.name, ": step abandon: ", aec.message()));
    co_return;
  }
  std::uint64_t published_tag = 0;
  const std::size_t p = publish_append(t, s, published_tag, count);
  if (published_tag != tag) co_return fail(str(t.name, ": step tag ", tag_name(tag), " is not the next state's"));
  auto [cec] = co_await open.async_commit(as_tuple(asio::use_awaitable));
  settle(t, p, cec, {}, "step commit");
}

/// A retention of up to 3 ranges over the first 64 tokens at priorities
/// 0-100, some for a few milliseconds (durations end during the run).
inline kv_retention some_retention(rng& r) {
  kv_retention k;
  k.default_priority = static_cast<std::uint8_t>(r.below(101));
  for (std::size_t n = r.below(4); n > 0; --n) {
    const std::size_t first = r.below(64);
    k.ranges.push_back({.first = first,
                        .last = r.between(first, 64),
                        .priority = static_cast<std::uint8_t>(r.below(101)),
                        .duration = std::chrono::milliseconds(r.percent(30) ? r.between(1, 20) : 0)});
  }
  return k;
}

/// A prefix-cache operation on `t`'s settled state `s`: insert its tokens
/// (their ids, or the ids it stores), or attach a prompt (this state's
/// tokens, an earlier state's, or either with tokens no one wrote after
/// them) and check every attached token against the prompt's tags; half
/// the attached sequences become writers' sequences (appends into shared
/// blocks copy them). Rarely a clear.
inline void prefix_op(seq_world& w, seq_target& t, const state& s, rng& r,
                      std::deque<std::shared_ptr<seq_target>>& frozen) {
  const std::size_t roll = r.below(100);
  kv_prefix_cache& prefix = w.prefix_for(t.layout);
  if (roll < 2) {
    bump(g_figures.prefix_clears);
    prefix.clear();
    return;
  }
  if (roll < 10) {
    // Its blocks cached as they fill (those whose tokens carry ids), or no more.
    bump(g_figures.prefix_tracks);
    if (r.percent(40))
      prefix.track(t.seq);
    else if (r.percent(70))
      prefix.track(t.seq, "", some_retention(r));
    else
      prefix.untrack(t.seq);
    return;
  }
  if (roll < 45) {
    bump(g_figures.prefix_inserts);
    // Half of them at priorities, so that evictions take them in that order.
    const std::optional<kv_retention> keep = r.percent(50) ? std::optional(some_retention(r)) : std::nullopt;
    const std::size_t added =
        r.percent(20) ? (keep ? prefix.insert_stored_tokens(t.seq, "", *keep) : prefix.insert_stored_tokens(t.seq))
                      : (keep ? prefix.insert(t.seq, ids_of(s.tags), "", *keep) : prefix.insert(t.seq, ids_of(s.tags)));
    bump(g_figures.prefix_added, added);
    return;
  }
  // A prompt: a state this sequence held (an ok one), maybe with a suffix
  // of ids no token carries.
  std::size_t p = t.hist.count() - 1;
  if (r.percent(40)) p = r.below(t.hist.count());
  if (t.hist.outcome_of(p) != outcome::ok) p = t.hist.count() - 1;
  const std::vector<std::uint64_t> tags = t.hist.at(p).tags;
  std::vector<token_id> prompt = ids_of(tags);
  if (r.percent(30)) prompt.insert(prompt.end(), r.between(1, 6), no_token_id);
  sequence_kv_cache attached = prefix.attach(w.io, prompt);
  bump(g_figures.prefix_attaches);
  const std::size_t n = attached.size();
  bump(g_figures.prefix_attached_tokens, n);
  if (n % w.config.block_tokens != 0 || n > tags.size())
    return fail(str(t.name, ": attached ", n, " tokens of a prompt of ", tags.size(), " (blocks of ",
                    w.config.block_tokens, ")"));
  const std::vector<std::uint64_t> want(tags.begin(), tags.begin() + static_cast<std::ptrdiff_t>(n));
  const auto snap = attached.snapshot();
  std::vector<std::uint64_t> seen;
  for (std::size_t l = 0; l < seq_world::layers; ++l) {
    // A windowed layer holds the window at n and its sinks alone.
    std::string error = decode_all(snap.layer(l), l, seen);
    if (error.empty()) error = window_held(snap.layer(l), t.layout.layers[l]);
    if (!error.empty() || !shows(seen, want))
      return fail(
          str(t.name, ": attached layer ", l, " of ", n, " tokens: ", error, error.empty() ? "tags differ" : ""));
  }
  if (snap.token_ids() != std::vector<token_id>(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(n)))
    return fail(str(t.name, ": attached ", n, " tokens whose ids are not the prompt's"));
  if (n > 0 && r.percent(50)) {
    bump(g_figures.prefix_adopted);
    adopt_child(w, t, std::move(attached), state{true, want}, r, frozen, n + t.layout.rollback_tokens);
  }
}

inline asio::awaitable<void> seq_drive(seq_world& w, std::shared_ptr<seq_target> t, rng r) {
  w.live.add(t);
  std::deque<std::shared_ptr<seq_target>> frozen;
  while (!stopping() && t->hist.has_room(4)) {
    const state s = t->hist.last();
    const std::size_t roll = r.below(100);
    if (roll < 62) {
      bump(g_figures.appends);
      // One token mostly; a prefill chunk of 2-9 tokens a quarter of the time.
      const std::size_t count = r.percent(25) ? r.between(2, 9) : 1;
      const bool full = s.tags.size() + count > w.config.max_tokens_per_seq;
      std::uint64_t tag = make_tag(t->gen, t->hist.count());
      const step_buffers step(seq_world::layers, w.config.token_width(), tag, s.tags.size(), count);
      if (count > 1) bump(g_figures.chunk_appends);
      if (!full && r.percent(30)) {
        co_await step_append(*t, s, tag, step, count, r);
        verify_settled(*t, r);
        continue;
      }
      const std::size_t p = full ? t->hist.publish(s) : publish_append(*t, s, tag, count);
      auto [ec] = co_await t->seq.async_append(step.keys, step.values, as_tuple(asio::use_awaitable));
      if (full) {
        if (ec != kv_errc::index_out_of_range)
          fail(str(t->name, ": append of ", count, " past max_tokens_per_seq: ", ec.message()));
        t->hist.complete(p);
      } else {
        settle(*t, p, ec, {kv_errc::capacity_exhausted}, "append");
      }
    } else if (roll < 78) {
      bump(g_figures.seq_truncates);
      state next = s;
      next.tags.resize(std::min(s.tags.size(), r.below(s.tags.size() + 2)));
      const std::size_t p = t->hist.publish(next, outcome::pending);
      auto [ec] = co_await t->seq.async_truncate(next.tags.size(), as_tuple(asio::use_awaitable));
      settle(*t, p, ec, truncate_errors(*t, next.tags.size()), "truncate");
    } else if (roll < 86) {
      const std::size_t p = t->hist.publish(s);
      auto [ec, child] = co_await t->seq.async_fork(as_tuple(asio::use_awaitable));
      if (ec) fail(str(t->name, ": fork: ", ec.message()));
      t->hist.complete(p);
      if (!ec) adopt_child(w, *t, std::move(child), s, r, frozen);
    } else if (roll < 93) {
      prefix_op(w, *t, s, r, frozen);
    } else {
      co_await conflict(w, *t, r);
    }
    verify_settled(*t, r);
  }
  for (const auto& f : frozen) w.live.remove(f);
  w.live.remove(t);
}

/// Sequence lineage `j`: sequence after sequence until the run stops.
inline asio::awaitable<void> seq_lineage(seq_world& w, std::size_t j, rng r) {
  while (!stopping()) {
    const std::uint64_t gen = new_generation();
    const kv_model_layout layout = seq_world::layout(j + gen);
    if (layout.windowed()) bump(g_figures.windowed_sequences);
    auto t = std::make_shared<seq_target>(str("sequence g", gen, " (lineage ", j, ", ", layout, ")"), gen,
                                          sequence_kv_cache(w.io, layout, w.config, w.pools[(j + gen) % 3]),
                                          r.between(32, 600), state{true, {}}, 0);
    co_await seq_drive(w, std::move(t), rng(r.next()));
  }
}

}  // namespace stress
