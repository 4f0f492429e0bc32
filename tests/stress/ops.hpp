#pragma once
// Requests on a layer cache, planned against the writer's model: what each
// one sends, the error it must complete with, and the state it leads to.
// Also the two ways a writer sends them: one `co_await`ed (the actor may
// apply it inline) or a burst of callbacks kept in flight together (applied
// in the order sent, possibly in one drain, completing on any pool thread).

#include "common.hpp"

#include "common/asio_compat.hpp"

#include <tuple>

namespace stress {

using ghostlink::test::as_tuple;
using completion_channel = asio::experimental::concurrent_channel<void(asio::error_code, std::size_t)>;

/// Which tokens a writer may write: [base, base + span) of a cache of
/// `max_tokens` tokens of `width` floats.
struct geometry {
  std::size_t width, max_tokens, base, span;
};

struct planned {
  enum class kind { write, batch, initialize, truncate, fork } op = kind::write;
  std::size_t p = 0;          // the state it leads to
  ghostlink::error_code expected;   // what it must complete with
  ghostlink::error_code ec;         // what it completed with
  std::size_t n = 0;          // initialize / truncate argument
  std::vector<token_buffer> tokens;
  std::vector<kv_write> entries;
  layer_kv_cache child;       // a fork's result
  state fork_state;           // what the fork must hold
  std::string what() const {
    static const char* const names[] = {"write", "batch", "initialize", "truncate", "fork"};
    return str(names[static_cast<int>(op)], " (request ", p, ", ", entries.size(), " entries, n=", n, ")");
  }
};

/// The error a write of `entries` gets from a cache in state `s`, checked in
/// the documented order: per entry length, width, index; then initialized.
inline ghostlink::error_code expected_write_error(const state& s, std::span<const kv_write> entries,
                                                  const geometry& g) {
  for (const kv_write& e : entries) {
    if (e.keys.size() != e.values.size()) return kv_errc::length_mismatch;
    if (e.keys.size() != g.width) return kv_errc::width_mismatch;
    if (e.index >= g.max_tokens) return kv_errc::index_out_of_range;
  }
  if (!entries.empty() && !s.initialized) return kv_errc::not_initialized;
  return {};
}

namespace detail_ops {

inline std::size_t pick_index(const state& s, const geometry& g, rng& r) {
  if (g.span != g.max_tokens) return g.base + r.below(g.span);  // an arena region
  const std::size_t size = s.tags.size();
  if (r.percent(35)) return r.below(g.max_tokens);
  const std::size_t lo = size > 2 ? size - 2 : 0;
  return std::min(g.max_tokens - 1, r.between(lo, size + 2));
}

/// Tokens for `indices`, tag `tag`; `decoy` entries (layer 7, never a
/// valid token here) go before a later entry for the same index, which must
/// win. `bad` (0 none, 1 width, 2 length) spoils the entry at `bad_at`.
inline void fill(planned& op, std::span<const std::size_t> indices, std::uint64_t tag, std::span<const char> decoy,
                 int bad, std::size_t bad_at, std::size_t width) {
  op.tokens.reserve(indices.size());
  for (std::size_t i = 0; i < indices.size(); ++i) op.tokens.emplace_back(width, tag, indices[i], decoy[i] ? 7 : 0);
  for (std::size_t i = 0; i < indices.size(); ++i) {
    std::span<const float> k = op.tokens[i].keys, v = op.tokens[i].values;
    if (bad == 1 && i == bad_at) k = k.first(width - 1), v = v.first(width - 1);
    if (bad == 2 && i == bad_at) v = v.first(width - 1);
    op.entries.push_back({indices[i], k, v});
  }
}

}  // namespace detail_ops

/// Plans request `p` of generation `gen` on a cache in state `s` and moves
/// `s` to the state after it. `full`: any request (a cache of its own);
/// otherwise writes and batches inside the region only (the arena).
inline std::unique_ptr<planned> plan(state& s, const geometry& g, std::uint64_t gen, std::size_t p, rng& r, bool full,
                                     bool may_fork) {
  auto op = std::make_unique<planned>();
  op->p = p;
  const std::uint64_t tag = make_tag(gen, p);
  const std::size_t roll = full ? r.below(100) : r.below(55);
  std::vector<std::size_t> indices;
  std::vector<char> decoy;
  int bad = 0;
  if (roll < 30 || (roll >= 78 && roll < 83 && !may_fork) || roll >= 90) {
    op->op = planned::kind::write;
    indices.push_back(detail_ops::pick_index(s, g, r));
    decoy.push_back(false);
  } else if (roll < 55) {
    op->op = planned::kind::batch;
    const std::size_t count = r.between(1, 6);
    for (std::size_t i = 0; i < count; ++i) {
      const bool dup = i + 1 < count && r.percent(15);
      indices.push_back(detail_ops::pick_index(s, g, r));
      decoy.push_back(static_cast<char>(dup));
      if (dup) indices.push_back(indices.back()), decoy.push_back(false), ++i;
    }
    if (r.percent(8)) bad = static_cast<int>(r.between(1, 2));
  } else if (roll < 63) {
    op->op = planned::kind::initialize;
    op->n = r.percent(5) ? 0 : r.between(1, g.max_tokens + 3);
  } else if (roll < 78) {
    op->op = planned::kind::truncate;
    op->n = r.below(s.tags.size() + 2);
  } else if (roll < 83) {
    op->op = planned::kind::fork;
    op->fork_state = s;
  } else if (roll < 86) {
    op->op = planned::kind::batch;  // empty: succeeds, changes nothing
  } else {
    op->op = planned::kind::write;  // out of range, or too narrow
    const bool oor = r.percent(50);
    indices.push_back(oor ? g.max_tokens + r.below(3) : detail_ops::pick_index(s, g, r));
    decoy.push_back(false);
    bad = oor ? 0 : 1;
  }
  detail_ops::fill(*op, indices, tag, decoy, bad, r.below(std::max<std::size_t>(indices.size(), 1)), g.width);

  switch (op->op) {
    case planned::kind::write:
    case planned::kind::batch:
      op->expected = expected_write_error(s, op->entries, g);
      if (!op->expected)
        for (const kv_write& e : op->entries) s.write(e.index - g.base, tag);
      break;
    case planned::kind::initialize:
      if (op->n == 0)
        op->expected = kv_errc::zero_length;
      else
        s.initialize(op->n, g.max_tokens);
      break;
    case planned::kind::truncate: s.truncate(op->n); break;
    case planned::kind::fork: break;
  }
  if (op->expected) bump(g_figures.rejected);
  return op;
}

/// Starts `op` (not a fork) on `cache` with `token`.
template <class Token>
auto start(const layer_kv_cache& cache, planned& op, Token&& token) {
  switch (op.op) {
    case planned::kind::write:
      return cache.async_write(op.entries[0].index, op.entries[0].keys, op.entries[0].values,
                               std::forward<Token>(token));
    case planned::kind::batch: return cache.async_write_batch(op.entries, std::forward<Token>(token));
    case planned::kind::initialize: return cache.async_initialize(op.n, std::forward<Token>(token));
    default: return cache.async_truncate(op.n, std::forward<Token>(token));
  }
}

/// Runs `ops` on `cache`: one `co_await`ed, or all in flight at once.
/// `done(op)` runs right after each op's handler has stored its result (on
/// whatever thread the handler runs); the coroutine resumes after all.
template <class Done>
asio::awaitable<void> run_ops(const layer_kv_cache& cache, std::vector<std::unique_ptr<planned>>& ops, Done done) {
  if (ops.size() == 1) {
    planned& op = *ops.front();
    if (op.op == planned::kind::fork) {
      std::tie(op.ec, op.child) = co_await layer_kv_cache(cache).async_fork(as_tuple(asio::use_awaitable));
    } else {
      std::tie(op.ec) = co_await start(cache, op, as_tuple(asio::use_awaitable));
    }
    done(op);
    co_return;
  }
  // Shared with the handlers: one may still be inside try_send when the
  // coroutine, resumed by it, moves on.
  auto channel = std::make_shared<completion_channel>(co_await asio::this_coro::executor, ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    planned* op = ops[i].get();
    auto signal = [channel, i] {
      if (!channel->try_send(asio::error_code(), i)) fail("completion channel full");
    };
    if (op->op == planned::kind::fork) {
      layer_kv_cache(cache).async_fork([op, done, signal](ghostlink::error_code ec, layer_kv_cache child) {
        op->ec = ec;
        op->child = std::move(child);
        done(*op);
        signal();
      });
    } else {
      start(cache, *op, [op, done, signal](ghostlink::error_code ec) {
        op->ec = ec;
        done(*op);
        signal();
      });
    }
  }
  for (std::size_t i = 0; i < ops.size(); ++i) {
    auto [ec, index] = co_await channel->async_receive(as_tuple(asio::use_awaitable));
    if (ec) fail("completion channel: " + ec.message());
  }
}

}  // namespace stress
