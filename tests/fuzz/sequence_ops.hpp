#pragma once
// Sequence operations: append, truncate and fork (one at a time, or a second
// started before the first completes, which must fail with
// operation_in_progress and change nothing), snapshots, and steps (begin,
// write layer by layer in any order, commit, abandon or drop).
// A lone operation may be cancelled through its handler's slot before the
// sequence's actor runs (its one request must then abort, the operation
// complete with operation_aborted and nothing change) or after it completed
// (nothing happens). Each operation is one request to the sequence's actor,
// applied to every layer in one drain, all or nothing.

#include "world.hpp"

#include "common/asio_compat.hpp"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace ghostlink::fuzz {

enum class seq_kind : std::uint8_t { append, truncate, fork, count };

inline const char* name(seq_kind k) {
  constexpr const char* names[] = {"seq_append", "seq_truncate", "seq_fork"};
  return names[static_cast<int>(k)];
}

template <class T>
struct seq_req {
  seq_kind kind{};
  std::size_t n = 0;       // a truncate's length
  std::size_t tokens = 1;  // an append's tokens per layer (more than one: a prefill chunk)
  std::vector<std::vector<float>> bufs;
  std::vector<std::span<const float>> keys, values;  // per layer (their number is arbitrary)
  std::vector<std::vector<recipe>> recipes;          // per layer, per token of its buffers (a part-token too)

  bool cancel_early = false;  // cancelled before any layer's actor runs
  bool cancel_late = false;   // cancelled after the handler ran
  asio::cancellation_type cancel_type = asio::cancellation_type::terminal;
  asio::cancellation_signal signal;  // outlives the operation (this outlives the run)

  bool done = false;
  ghostlink::error_code ec, want;
  std::size_t size_seen = 0;  // the sequence's size() when the handler ran
  std::size_t size_want = 0;  // the model's length once this operation is done
  basic_sequence_kv_cache<T> child;
  std::shared_ptr<mseq> child_model;
};

template <class T>
std::shared_ptr<seq_req<T>> decode_seq_req(world<T>& w, seq_kind kind, const mseq& q) {
  auto r = std::make_shared<seq_req<T>>();
  r->kind = kind;
  if (kind == seq_kind::truncate) r->n = w.pick_index(q.length);
  if (kind == seq_kind::append) {
    const std::size_t layers = q.layers.size();
    std::size_t nk = layers, nv = layers;
    switch (w.in.byte() % 12) {
      case 8: nk = nv = layers + 1; break;
      case 9: nk = nv = layers - 1; break;
      case 10: nv = layers + 1; break;
      case 11: nk = nv = 0; break;
      default: break;
    }
    // Sometimes a prefill chunk of 2-4 tokens: whole tokens in front of the
    // last one, whose lengths are picked as a single token's (maybe bad).
    r->tokens = w.in.byte() % 8 == 7 ? 2 + w.in.byte() % 3 : 1;
    r->bufs.reserve(2 * std::max(nk, nv));
    const std::size_t width = w.width();
    for (std::size_t i = 0; i < std::max(nk, nv); ++i) {
      const auto [k, v] = w.pick_lengths();
      // Every token's worth of floats (and a part-token at the end) gets a
      // recipe of its own: with a width of 1, any length is whole tokens.
      const std::size_t kl = (r->tokens - 1) * width + k, vl = (r->tokens - 1) * width + v;
      std::vector<float> kb, vb;
      r->recipes.emplace_back();
      for (std::size_t at = 0; at < std::max(kl, vl); at += width) {
        r->recipes.back().push_back(w.next_recipe());
        const std::vector<float> kt =
            world<T>::floats(r->recipes.back().back(), std::min(width, kl - std::min(kl, at)), false);
        const std::vector<float> vt =
            world<T>::floats(r->recipes.back().back(), std::min(width, vl - std::min(vl, at)), true);
        kb.insert(kb.end(), kt.begin(), kt.end());
        vb.insert(vb.end(), vt.begin(), vt.end());
      }
      r->bufs.push_back(std::move(kb));
      r->bufs.push_back(std::move(vb));
      if (i < nk) r->keys.push_back(r->bufs[2 * i]);
      if (i < nv) r->values.push_back(r->bufs[2 * i + 1]);
    }
  }
  current_trace().add(name(kind), r->n, r->keys.size(), r->values.size());
  return r;
}

/// The checks an append makes before it starts (for every layer): each
/// layer's keys and values of one length, a whole non-zero number of
/// tokens, layer 0's number.
template <class T>
ghostlink::error_code check_append(const world<T>& w, const seq_req<T>& r, std::size_t layers) {
  if (r.keys.size() != layers || r.values.size() != layers) return kv_errc::layer_mismatch;
  for (std::size_t i = 0; i < layers; ++i) {
    if (r.keys[i].size() != r.values[i].size()) return kv_errc::length_mismatch;
    if (r.keys[i].size() != r.keys[0].size() || r.keys[i].empty() || r.keys[i].size() % w.width() != 0)
      return kv_errc::width_mismatch;
  }
  return {};
}

/// The tokens a well-formed append carries per layer.
template <class T>
std::size_t append_tokens(const world<T>& w, const seq_req<T>& r) {
  return r.keys[0].size() / w.width();
}

/// Whether `r`, started on `q`, holds the sequence busy until it completes.
template <class T>
bool starts_busy(const world<T>& w, const seq_req<T>& r, const mseq& q) {
  switch (r.kind) {
    case seq_kind::append:
      return !check_append(w, r, q.layers.size()) && append_tokens(w, r) <= w.max_tokens() - q.length;
    case seq_kind::truncate: return r.n < q.length;
    default: return true;
  }
}

/// An operation cancelled before the actor ran: its request is drained
/// unapplied, and the operation fails with operation_aborted.
inline ghostlink::error_code model_cancelled(model& m, const mseq& q) {
  for (const auto& l : q.layers) m.end_drain(*l, 1, 0, 1);
  return asio::error::operation_aborted;
}

/// Every layer's drain of one sequence request, `failed` or not.
inline void end_group_drain(model& m, const mseq& q, bool failed) {
  for (const auto& l : q.layers) m.end_drain(*l, 1, failed ? 1 : 0);
}

/// Step 1 of a request adding tokens (an append, a begin): every layer sets
/// aside the blocks `tokens` tokens from its end take; if one cannot, those
/// before it let theirs go.
inline ghostlink::error_code set_aside_all(model& m, const mseq& q, std::size_t tokens) {
  for (std::size_t i = 0; i < q.layers.size(); ++i) {
    if (ghostlink::error_code ec = m.reserve(*q.layers[i], q.length, tokens)) {
      for (std::size_t k = 0; k < i; ++k) q.layers[k]->set_aside.clear();
      return ec;
    }
  }
  return {};
}

/// actor::advance: the sequence now holds `size` tokens; the high-water
/// mark rises, and each windowed layer drops what no later token attends.
inline void advance(model& m, mseq& q, std::size_t size) {
  q.high_water = std::max(q.high_water, size);
  for (const auto& l : q.layers) {
    const std::size_t reach = l->window + q.rollback;
    if (q.high_water + 1 > reach) m.drop_before(*l, q.high_water + 1 - reach);
  }
}

/// working_state::can_truncate: whether layer `c`, cut to `n`, still holds
/// every position past its sinks that a token at `n` attends.
inline bool can_truncate(const mcache& c, std::size_t n) {
  if (c.window == 0) return true;
  const std::size_t need = std::max(c.sinks, n + 1 > c.window ? n + 1 - c.window : 0);
  return need >= n || c.kept_from <= need;
}

/// actor::least_high_water: `size`, or more where a window dropped a
/// position a truncate within rollback_tokens of a lower mark would need.
inline std::size_t least_high_water(const mseq& q, std::size_t size) {
  std::size_t h = size;
  for (const auto& l : q.layers)
    if (l->kept_from > l->sinks) h = std::max(h, l->kept_from + l->window + q.rollback - 1);
  return h;
}

/// Applies `r` to the model; `busy`: another operation holds the sequence.
/// It is one request to the sequence's actor: one drain, every layer.
template <class T>
ghostlink::error_code model_seq(world<T>& w, seq_req<T>& r, mseq& q, bool busy) {
  if (r.kind == seq_kind::append)
    if (ghostlink::error_code ec = check_append(w, r, q.layers.size())) return ec;
  if (busy) return kv_errc::operation_in_progress;
  // An append to a full sequence and a truncate to no shorter one end
  // before the actor is asked, so a cancellation cannot reach them.
  if (!starts_busy(w, r, q)) return r.kind == seq_kind::append ? kv_errc::index_out_of_range : ghostlink::error_code();
  if (r.cancel_early) return model_cancelled(w.m, q);
  switch (r.kind) {
    case seq_kind::append: {
      const std::size_t index = q.length, tokens = append_tokens(w, r);
      // Every layer sets its blocks aside, then takes the tokens (each
      // token a recipe of its own); a write that fails anyway is cut back
      // on the layers before it.
      ghostlink::error_code first = set_aside_all(w.m, q, tokens);
      std::vector<mwrite> writes(tokens);
      for (std::size_t i = 0; !first && i < q.layers.size(); ++i) {
        for (std::size_t t = 0; t < tokens; ++t) writes[t] = {index + t, w.width(), w.width(), r.recipes[i][t]};
        first = w.m.write(*q.layers[i], writes);
        if (!first) continue;
        for (std::size_t k = 0; k < i; ++k) w.m.truncate(*q.layers[k], index);
        for (std::size_t k = i; k < q.layers.size(); ++k) q.layers[k]->set_aside.clear();
      }
      if (!first) advance(w.m, q, index + tokens);
      end_group_drain(w.m, q, bool(first));
      if (first) return first;
      q.length = index + tokens;
      q.ids.resize(q.length, no_token_id);  // appends here carry no ids
      return {};
    }
    case seq_kind::truncate: {
      // Below h - rollback_tokens, a window may have dropped what the next
      // token needs: then refused, whole.
      const bool rewinds = q.high_water > q.rollback && r.n < q.high_water - q.rollback;
      if (rewinds &&
          !std::all_of(q.layers.begin(), q.layers.end(), [&](const auto& l) { return can_truncate(*l, r.n); })) {
        end_group_drain(w.m, q, true);
        return kv_errc::outside_window;
      }
      for (const auto& l : q.layers) w.m.truncate(*l, r.n);
      if (rewinds) q.high_water = least_high_water(q, r.n);
      end_group_drain(w.m, q, false);
      q.length = r.n;
      q.ids.resize(r.n);
      return {};
    }
    default: {
      r.child_model = std::make_shared<mseq>();
      r.child_model->pool = q.pool;
      r.child_model->length = q.length;
      r.child_model->ids = q.ids;
      r.child_model->high_water = q.high_water;
      r.child_model->rollback = q.rollback;
      for (const auto& l : q.layers) r.child_model->layers.push_back(w.m.fork(*l));
      end_group_drain(w.m, q, false);
      return {};
    }
  }
}

/// Starts `r` on `s` with handlers made by `bind(handler)`.
template <class T, class Bind>
void start_seq(basic_sequence_kv_cache<T>& s, const std::shared_ptr<seq_req<T>>& r, Bind bind) {
  auto completed = bind([r, s](ghostlink::error_code ec) {
    r->ec = ec;
    r->size_seen = s.size();
    r->done = true;
  });
  switch (r->kind) {
    case seq_kind::append:
      s.async_append(std::span<const std::span<const float>>(r->keys),
                     std::span<const std::span<const float>>(r->values), std::move(completed));
      break;
    case seq_kind::truncate: s.async_truncate(r->n, std::move(completed)); break;
    default:
      s.async_fork(bind([r, s](ghostlink::error_code ec, basic_sequence_kv_cache<T> child) {
        r->ec = ec;
        r->size_seen = s.size();
        r->child = std::move(child);
        r->done = true;
      }));
      break;
  }
}

/// Starts `r` on `s`, through its cancellation slot if it is to be cancelled.
template <class T>
void start_seq(basic_sequence_kv_cache<T>& s, const std::shared_ptr<seq_req<T>>& r) {
  if (r->cancel_early || r->cancel_late)
    start_seq(s, r, [&r](auto handler) { return asio::bind_cancellation_slot(r->signal.slot(), std::move(handler)); });
  else
    start_seq(s, r, [](auto handler) { return handler; });
}

/// Runs one sequence operation on sequence `k`, or (`second`) two, the
/// second started right after the first.
template <class T>
void run_seq(world<T>& w, std::size_t k, bool second) {
  const basic_sequence_kv_cache<T> seq = w.seqs[k].real;  // copies: w.seqs grows with forks
  const std::shared_ptr<mseq> q = w.seqs[k].m;
  const kv_cache_config config = w.seqs[k].config;
  std::vector<std::shared_ptr<seq_req<T>>> reqs;
  // The first byte: the kind (% 3) and, for a lone operation, whether it
  // is cancelled (/ 3 % 4: 2 after it completed, 3 before any layer ran)
  // and how (/ 12 % 4).
  const std::uint8_t b = w.in.byte();
  reqs.push_back(decode_seq_req(w, static_cast<seq_kind>(b % 3), *q));
  if (second) reqs.push_back(decode_seq_req(w, static_cast<seq_kind>(w.in.byte() % 3), *q));
  if (!second && b / 3 % 4 >= 2) {
    constexpr asio::cancellation_type types[] = {asio::cancellation_type::terminal, asio::cancellation_type::partial,
                                                 asio::cancellation_type::total, asio::cancellation_type::all};
    reqs[0]->cancel_early = b / 3 % 4 == 3;
    reqs[0]->cancel_late = !reqs[0]->cancel_early;
    reqs[0]->cancel_type = types[b / 12 % 4];
    current_trace().add(reqs[0]->cancel_early ? "  cancelled before the layers ran" : "  cancelled after completing",
                        b / 12 % 4);
  }

  basic_sequence_kv_cache<T> handle = seq;
  for (const auto& r : reqs) start_seq(handle, r);
  for (const auto& r : reqs)
    if (r->done) fail(str(name(r->kind), ": completed inside the initiating call"));
  for (const auto& r : reqs)
    if (r->cancel_early) r->signal.emit(r->cancel_type);
  if (second && starts_busy(w, *reqs[0], *q)) {
    reqs[1]->want = model_seq(w, *reqs[1], *q, true);
    reqs[0]->want = model_seq(w, *reqs[0], *q, false);
  } else {
    for (const auto& r : reqs) r->want = model_seq(w, *r, *q, false);
  }
  // A lone operation's handler runs after it has settled the length (of a
  // pair, the refused one may run while the other is under way).
  reqs.back()->size_want = q->length;
  w.run_to_completion([&] { return reqs.front()->done && reqs.back()->done; }, "sequence operation");
  for (const auto& r : reqs)
    if (r->cancel_late) r->signal.emit(r->cancel_type);  // the handler ran: nothing to cancel

  for (const auto& r : reqs) {
    const std::string what = str(name(r->kind), " on sequence ", k);
    if (trace::verbose()) std::fprintf(stderr, "  %s: %s\n", what.c_str(), ec_name(r->want).c_str());
    expect_ec(r->ec, r->want, what);
    if (r == reqs.back() && !second) expect_eq(r->size_seen, r->size_want, what + ": size() in the handler");
    if (r->kind != seq_kind::fork) continue;
    if (r->child.valid() != !r->want) fail(what + (r->want ? ": failed but handed out a sequence" : ": empty handle"));
    if (r->child.valid() && w.seqs.size() < world<T>::max_seqs)
      w.seqs.push_back({std::move(r->child), r->child_model, config});
  }
}

/// Pins sequence `k` (held, checked after every later operation).
template <class T>
void hold_seq_snapshot(world<T>& w, std::size_t k) {
  if (w.seq_snaps.size() >= world<T>::max_seq_snaps) w.seq_snaps.erase(w.seq_snaps.begin());
  typename world<T>::seq_snap_slot s{
      w.seqs[k].real.snapshot(), {}, std::numeric_limits<std::size_t>::max(), w.seqs[k].m->ids};
  for (const auto& l : w.seqs[k].m->layers) {
    s.m.push_back(l->current);
    s.shown = std::min(s.shown, l->current->length);
  }
  w.seq_snaps.push_back(std::move(s));
}

/// The model of a step's begin on `q`: one request in which every layer
/// sets aside the step's blocks (if one cannot, those before it let theirs
/// go) and opens the step's positions, and the epoch of each is staged
/// into `staged`.
template <class T>
ghostlink::error_code model_begin_step(world<T>& w, mseq& q, std::size_t tokens,
                                       std::vector<std::shared_ptr<mepoch>>& staged) {
  if (tokens == 0) return kv_errc::zero_length;
  if (tokens > w.max_tokens() - q.length) return kv_errc::index_out_of_range;
  const ghostlink::error_code ec = set_aside_all(w.m, q, tokens);
  for (std::size_t i = 0; !ec && i < q.layers.size(); ++i) {
    if (w.m.open(*q.layers[i], q.length, tokens)) fail("a step's positions the model could not open after set_aside");
    staged.push_back(w.m.stage(*q.layers[i]));
  }
  end_group_drain(w.m, q, bool(ec));
  return ec;
}

/// Runs `start(handler)` for an operation completing with an error code
/// alone, to completion, and checks its result against `want`.
template <class T, class Start>
void expect_completion(world<T>& w, Start start, ghostlink::error_code want, const std::string& what) {
  std::optional<ghostlink::error_code> got;
  start([&got](ghostlink::error_code ec) { got = ec; });
  if (got) fail(what + ": completed inside the initiating call");
  w.run_to_completion([&] { return got.has_value(); }, what.c_str());
  expect_ec(*got, want, what);
}

/// A step on sequence `k`: a begin of 1-3 tokens (sometimes 0, or past the
/// end), then each layer written in an order the input picks (a bad write,
/// an early commit or another operation of the sequence sometimes in
/// between, each failing and changing nothing), each layer's snapshot
/// checked after its write, and the sequence's checked to show none of it;
/// then a commit, an `async_abandon` or the handle dropped.
template <class T>
void run_step(world<T>& w, std::size_t k) {
  const basic_sequence_kv_cache<T> seq = w.seqs[k].real;
  const std::shared_ptr<mseq> q = w.seqs[k].m;
  const std::uint8_t b = w.in.byte();
  std::size_t tokens = b % 8 == 7 ? 0 : 1 + b % 3;  // with ids, 0 tokens is an empty span of ids
  if (b / 8 % 8 == 7) tokens = w.max_tokens() - q->length + 1;
  const unsigned ending = b / 64;  // 0, 3: commit; 1: async_abandon; 2: the handle dropped
  current_trace().add("seq_step", k, tokens, ending);
  const std::string what = str("step on sequence ", k);

  // Half the time with token ids (as many as the tokens, but for a 0-token
  // begin: none), from the input.
  std::vector<token_id> ids;
  const bool with_ids = tokens <= 3 && w.in.byte() % 2 == 1;
  for (std::size_t t = 0; with_ids && t < tokens; ++t) ids.push_back(static_cast<token_id>(w.in.byte()) - 1);
  std::optional<ghostlink::error_code> begun;
  basic_sequence_step<T> step;
  auto on_begun = [&](ghostlink::error_code ec, basic_sequence_step<T> s) {
    begun = ec;
    step = std::move(s);
  };
  if (with_ids)
    seq.async_begin_step(std::span<const token_id>(ids), on_begun);
  else
    seq.async_begin_step(tokens, on_begun);
  if (begun) fail(what + ": begin completed inside the initiating call");
  std::vector<std::shared_ptr<mepoch>> staged;
  const ghostlink::error_code want = model_begin_step(w, *q, tokens, staged);
  w.run_to_completion([&] { return begun.has_value(); }, "step begin");
  expect_ec(*begun, want, what + ": begin");
  if (step.valid() != !want) fail(what + (want ? ": failed begin handed out a step" : ": begin gave no step"));
  if (want) return;

  const std::size_t index = q->length, width = w.width(), layers = q->layers.size();
  std::vector<std::size_t> order(layers);
  for (std::size_t i = 0; i < layers; ++i) order[i] = i;
  for (std::size_t i = 0; i + 1 < layers; ++i) std::swap(order[i], order[i + w.in.byte() % (layers - i)]);
  const auto write = [&](std::size_t l, std::span<const float> keys, std::span<const float> values) {
    return [&step, l, keys, values](auto handler) { step.async_write(l, keys, values, std::move(handler)); };
  };
  for (std::size_t l : order) {
    std::vector<recipe> recipes;
    std::vector<float> keys, values;
    for (std::size_t t = 0; t < tokens; ++t) {
      recipes.push_back(w.next_recipe());
      const auto kt = world<T>::floats(recipes.back(), width, false),
                 vt = world<T>::floats(recipes.back(), width, true);
      keys.insert(keys.end(), kt.begin(), kt.end());
      values.insert(values.end(), vt.begin(), vt.end());
    }
    switch (w.in.byte() % 16) {  // sometimes something that must fail first
      case 0: expect_completion(w, write(layers, keys, values), kv_errc::layer_mismatch, what + ": write"); break;
      case 5:
        expect_ec(step.write(l, keys, std::span(values).first(0)), kv_errc::length_mismatch, what + ": write");
        break;
      case 1:
        expect_completion(w, write(l, std::span(keys).first(keys.size() - 1), values), kv_errc::length_mismatch,
                          what + ": write");
        break;
      case 2:
        expect_completion(
            w, write(l, std::span(keys).first(width * (tokens - 1)), std::span(values).first(width * (tokens - 1))),
            kv_errc::width_mismatch, what + ": write");
        break;
      case 3:
        expect_completion(
            w, [&](auto h) { step.async_commit(std::move(h)); }, kv_errc::step_incomplete, what + ": early commit");
        break;
      case 4:
        expect_completion(
            w, [&](auto h) { seq.async_truncate(0, std::move(h)); }, kv_errc::operation_in_progress,
            what + ": truncate while open");
        break;
      default: break;
    }
    // Odd layers through write() on this thread, even ones through
    // async_write (which completes with write()'s result).
    if (l % 2 == 1)
      expect_ec(step.write(l, keys, values), {}, str(what, ": write of layer ", l));
    else
      expect_completion(w, write(l, keys, values), {}, str(what, ": write of layer ", l));
    mcache& c = *q->layers[l];
    w.m.step_write(c, *staged[l], index, recipes);
    check_snapshot(step.snapshot(l), staged[l].get(), staged[l]->length, w.tm, {"step snapshot of layer", l});
    check_snapshot(seq.layer(l).snapshot(), c.current.get(), c.current->length, w.tm, {"layer view while open", l});
    expect_eq(seq.size(), index, what + ": size() while open");
    if (seq.snapshot().size() > index) fail(what + ": the sequence's snapshot shows the open step");
  }
  // An end is one request cutting the step's tokens off every layer; a
  // commit, one publishing the staged epochs.
  const auto cut = [&] {
    for (const auto& l : q->layers) w.m.truncate(*l, index);
    end_group_drain(w.m, *q, false);
  };
  switch (ending) {
    case 1:
      cut();
      expect_completion(
          w, [&](auto h) { step.async_abandon(std::move(h)); }, {}, what + ": abandon");
      break;
    case 2:
      cut();
      step = {};
      w.run_to_completion([] { return true; }, "dropped step");
      break;
    default:
      expect_completion(
          w, [&](auto h) { step.async_commit(std::move(h)); }, {}, what + ": commit");
      // The staged epochs, then (in an epoch after them) what the windows drop.
      for (std::size_t l = 0; l < layers; ++l) q->layers[l]->current = staged[l];
      advance(w.m, *q, index + tokens);
      for (std::size_t l = 0; l < layers; ++l) w.m.end_drain(*q->layers[l], 1, 0);
      q->length = index + tokens;
      q->ids.insert(q->ids.end(), ids.begin(), ids.end());
      if (ids.empty()) q->ids.resize(q->length, no_token_id);
      break;
  }
}

}  // namespace ghostlink::fuzz
