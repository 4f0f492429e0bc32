#pragma once
// Shared by the prefix-cache tests: a pool with a prefix cache on it, and
// sequences whose every token's keys and values follow from (layer,
// position, token id), so that an attached sequence can be checked against
// what was inserted, token for token.

#include "common/str.hpp"
#include "common/support.hpp"

#include "common/asio_compat.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ghostlink::test::prefix {

using ghostlink::test::str;
using ghostlink::test::wait_ec;

/// 2 heads of 4 lanes, 4 tokens a block, 64 tokens a sequence.
inline kv_cache_config config() { return {.max_tokens_per_seq = 64, .num_heads = 2, .head_dim = 4, .block_tokens = 4}; }

/// Layer `l`'s key for token `id` at `position`, lane `lane`, written by
/// tenant `tag` (a small number: its millions); values are the keys
/// negated. Exact in float and unique per (l, position, id, tag).
inline float key(std::size_t l, std::size_t position, token_id id, std::size_t lane, float tag = 0) {
  return static_cast<float>(l * 100000 + position * 1000 + static_cast<std::size_t>(id % 100) * 10 + lane) + tag * 1e6f;
}

/// Every event a handler got, in order; a stored event's token ids (valid
/// during the call only) are copied, and its span points at the copy.
struct event_log {
  std::mutex mutex;
  std::vector<kv_prefix_event> events;
  std::deque<std::vector<token_id>> token_ids;  // a deque: the spans into it stay valid
  kv_prefix_event_handler handler() {
    return [this](const kv_prefix_event& e) {
      std::lock_guard lock(mutex);
      kv_prefix_event& copy = events.emplace_back(e);
      copy.token_ids = token_ids.emplace_back(e.token_ids.begin(), e.token_ids.end());
    };
  }
  std::size_t size() {
    std::lock_guard lock(mutex);
    return events.size();
  }
};

/// What a router keeps of a cache: its entries by tier and hash, as events
/// and dumps say them.
struct event_mirror {
  struct entry {
    std::optional<kv_block_hash> parent;
    std::vector<token_id> tokens;
    bool operator==(const entry&) const = default;
  };
  std::map<std::pair<kv_prefix_tier, kv_block_hash>, entry> entries;

  explicit event_mirror(const kv_prefix_dump& d = {}) {
    for (const kv_prefix_dump::entry& e : d.entries) entries[{e.tier, e.hash}] = {e.parent, e.token_ids};
  }
  /// As a router applies one: idempotently.
  void apply(const kv_prefix_event& e) {
    switch (e.what) {
      case kv_prefix_event::kind::stored:
        entries[{e.tier, e.hash}] = {e.parent, std::vector<token_id>(e.token_ids.begin(), e.token_ids.end())};
        break;
      case kv_prefix_event::kind::removed: entries.erase({e.tier, e.hash}); break;
      case kv_prefix_event::kind::cleared: entries.clear(); break;
    }
  }
  /// The entry of `hash` in `tier` (throws std::out_of_range if none).
  const entry& at(const kv_block_hash& hash, kv_prefix_tier tier = kv_prefix_tier::ram) const {
    return entries.at({tier, hash});
  }
  /// How many entries `tier` holds.
  std::size_t count(kv_prefix_tier tier) const {
    return static_cast<std::size_t>(
        std::ranges::count_if(entries, [&](const auto& kv) { return kv.first.first == tier; }));
  }
};

/// The mirror of `d` with the events of `log` after its number applied.
inline event_mirror replay_onto(event_log& log, const kv_prefix_dump& d) {
  std::lock_guard lock(log.mutex);
  event_mirror m(d);
  for (const kv_prefix_event& e : log.events)
    if (e.sequence > d.sequence) m.apply(e);
  return m;
}

/// Every two of `seen` (the hashes of one prompt by caches that must not
/// share an entry) differ in their first two blocks.
inline void check_apart(const std::vector<std::vector<kv_block_hash>>& seen) {
  for (std::size_t i = 0; i < seen.size(); ++i)
    for (std::size_t j = i + 1; j < seen.size(); ++j) {
      INFO(i << " vs " << j);
      CHECK(seen[i][0] != seen[j][0]);
      CHECK(seen[i][1] != seen[j][1]);
    }
}

/// Tokens `first, first + 1, ...`: `n` of them.
inline std::vector<token_id> run(token_id first, std::size_t n) {
  std::vector<token_id> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = first + static_cast<token_id>(i);
  return t;
}

/// `a` then `b`.
inline std::vector<token_id> cat(std::vector<token_id> a, const std::vector<token_id>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// Appends `ids` at `seq.size()` with their key() data (of tenant `tag`),
/// as one multi-token append that stores the ids.
template <class T>
ghostlink::error_code append(const basic_sequence_kv_cache<T>& seq, std::span<const token_id> ids, float tag = 0) {
  const std::size_t width = seq.config().token_width(), at = seq.size();
  std::vector<std::vector<float>> keys(seq.num_layers()), values(seq.num_layers());
  std::vector<std::span<const float>> ks, vs;
  for (std::size_t l = 0; l < seq.num_layers(); ++l) {
    for (std::size_t t = 0; t < ids.size(); ++t)
      for (std::size_t lane = 0; lane < width; ++lane) {
        keys[l].push_back(key(l, at + t, ids[t], lane, tag));
        values[l].push_back(-key(l, at + t, ids[t], lane, tag));
      }
    ks.emplace_back(keys[l]);
    vs.emplace_back(values[l]);
  }
  return wait_ec([&](auto token) { return seq.async_append(ids, ks, vs, token); });
}

template <class T>
ghostlink::error_code truncate(const basic_sequence_kv_cache<T>& seq, std::size_t n) {
  return wait_ec([&](auto token) { return seq.async_truncate(n, token); });
}

template <class T>
basic_sequence_kv_cache<T> fork(const basic_sequence_kv_cache<T>& seq) {
  return seq.async_fork(asio::use_future).get();
}

/// "" when `seq`'s snapshot holds exactly `ids` (its size, its stored ids,
/// and every layer's key() data of tenant `tag`), else the first difference.
template <class T>
std::string diff(const basic_sequence_kv_cache<T>& seq, std::span<const token_id> ids, float tag = 0) {
  const auto snap = seq.snapshot();
  if (snap.size() != ids.size()) return str("size ", snap.size(), ", expected ", ids.size());
  const std::vector<token_id> stored = snap.token_ids();
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (stored[i] != ids[i]) return str("token ", i, " has id ", stored[i], ", expected ", ids[i]);
  const std::size_t width = seq.config().token_width();
  for (std::size_t l = 0; l < snap.num_layers(); ++l) {
    kv_range r;
    if (ghostlink::error_code ec = snap.layer(l).read_range(0, ids.size(), r))
      return str("layer ", l, ": ", ec.message());
    for (std::size_t i = 0; i < ids.size(); ++i)
      for (std::size_t lane = 0; lane < width; ++lane) {
        const float k = static_cast<float>(T(key(l, i, ids[i], lane, tag)));
        if (r.keys[i * width + lane] != k || r.values[i * width + lane] != -k)
          return str("layer ", l, " token ", i, " lane ", lane, ": key ", r.keys[i * width + lane], ", expected ", k);
      }
  }
  return {};
}

/// What an `async_attach` completed with.
using attach_result = std::pair<ghostlink::error_code, sequence_kv_cache>;

/// Receives an `async_attach`'s completion (`handler()`), for `get()` to
/// wait for.
struct attach_waiter {
  std::promise<attach_result> done;
  auto handler() {
    return [this](ghostlink::error_code ec, sequence_kv_cache s) { done.set_value({ec, std::move(s)}); };
  }
  attach_result get() { return done.get_future().get(); }
};

/// `ids` appended to a new sequence of `cache` on `pool`, inserted, and
/// the sequence let go of (truncated to 0, so every block is the cache's
/// alone by the time this returns): the entries insert() added.
inline std::size_t insert_idle(kv_prefix_cache& cache, asio::thread_pool& threads, const kv_block_pool& pool,
                               std::span<const token_id> ids) {
  sequence_kv_cache seq(threads, cache.num_layers(), cache.config(), pool);
  REQUIRE(append(seq, ids) == ghostlink::error_code());
  const std::size_t added = cache.insert(seq, ids);
  REQUIRE(truncate(seq, 0) == ghostlink::error_code());
  return added;
}

/// `ids` attached by `cache.async_attach` on `threads`, waited for.
inline attach_result attach_waited(kv_prefix_cache& cache, asio::thread_pool& threads, std::span<const token_id> ids) {
  attach_waiter done;
  cache.async_attach(threads.get_executor(), ids, {}, {}, done.handler());
  return done.get();
}

/// A pool of `max_blocks` blocks with a prefix cache of `layers` layers on
/// it, and a 2-thread executor.
template <class T = float>
struct fixture {
  explicit fixture(std::size_t max_blocks = 1000, std::size_t layers = 2, kv_prefix_options options = {})
      : pool(kv_block_pool::for_caches<T>(config(), {.max_blocks = max_blocks})),
        cache(layers, config(), pool, std::move(options)) {}

  /// A new sequence on the pool holding `ids`.
  basic_sequence_kv_cache<T> prefill(std::span<const token_id> ids) {
    basic_sequence_kv_cache<T> seq(threads, cache.num_layers(), config(), pool);
    if (!ids.empty()) REQUIRE(append(seq, ids) == ghostlink::error_code());
    return seq;
  }
  /// A sequence holding `ids`, inserted, then let go of (truncated to 0,
  /// so every block is the cache's alone by the time this returns).
  std::size_t insert_idle(std::span<const token_id> ids, std::string_view salt = {}) {
    basic_sequence_kv_cache<T> seq = prefill(ids);
    const std::size_t added = cache.insert(seq, ids, salt);
    REQUIRE(truncate(seq, 0) == ghostlink::error_code());
    return added;
  }

  fixture(const fixture&) = delete;
  fixture& operator=(const fixture&) = delete;
  /// Ends `threads` as Asio wants a pool that other threads post to ended:
  /// joined once its work is done. An attach from a store completes from
  /// the store's thread, which lets go of its hold on the handler's
  /// executor (`threads`) just after queueing the handler, so the handler
  /// may have run before that; destroying the pool unjoined would race
  /// with it (as test_persist's fixture says for a load).
  ~fixture() { threads.join(); }

  asio::thread_pool threads{2};
  kv_block_pool pool;
  basic_kv_prefix_cache<T> cache;
};

}  // namespace ghostlink::test::prefix
