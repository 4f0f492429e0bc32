#pragma once
// Shared by the block pool, fork and truncate tests: blocking truncate and
// fork, and a model of what a cache should hold to check every token against.
//
// Tokens are written as concurrency::make_token(width, index, tag): keys
// token_pattern(width, index, tag), values their negation; tag 0 means
// zeros (a token made valid by initialize or skipped by a write).

#include "common/concurrency_support.hpp"
#include "common/reference.hpp"

#include <algorithm>
#include <functional>
#include <future>
#include <latch>
#include <memory_resource>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace ghostlink::test::pool {

using test::observe;
using test::observed;

using concurrency::diff_token;
using concurrency::for_each_token;
using concurrency::make_token;
using concurrency::mismatch_log;
using concurrency::str;
using concurrency::token_data;

/// What a cache should hold (see reference_cache).
using model = reference_cache<int>;

/// With a memory resource, each cache keeps one block of zeros outside the
/// budget, in memory of its own; it is counted in blocks_allocated while
/// its cache lives. Without one (reserved extents), the zeros are address
/// space that is no memory, counted nowhere.
inline constexpr std::size_t zero_blocks_per_cache = 1;
/// Blocks per extent of a pool with a memory resource: the slots a cursor
/// fills one after another.
inline constexpr std::size_t slots = kv_block_pool::extent_blocks;

/// Whether `pool` keeps its blocks in reserved extents (no memory
/// resource): memory is the slots committed, not whole extents.
inline bool reserved(const kv_block_pool& pool) {
  return pool.blocks_per_extent() == kv_block_pool::reserved_extent_blocks;
}
/// The blocks of zeros each cache of `pool` counts in blocks_allocated.
inline std::size_t zero_blocks(const kv_block_pool& pool) { return reserved(pool) ? 0 : zero_blocks_per_cache; }

/// `c` with tokens of 256 floats: a block's keys fill a page (4 KiB) at 4
/// tokens a block, so that a pool without a memory resource reserves its
/// extents (smaller blocks take extents allocated whole).
inline kv_cache_config paged(kv_cache_config c) {
  c.num_heads = 4;
  c.head_dim = 64;
  return c;
}

/// What a case that runs on both kinds of pool (`GENERATE(false, true)`
/// picks `with_resource`) says of the kind in its messages.
inline const char* kind_name(bool with_resource) {
  return with_resource ? "with a memory resource" : "reserved extents";
}

/// `c` for a pool of that kind: `c` itself with a memory resource; without
/// one, paged(c), so that the pool reserves its extents.
inline kv_cache_config config_for(bool with_resource, const kv_cache_config& c = small_config()) {
  return with_resource ? c : paged(c);
}

/// A pool of that kind for caches of `config` (from config_for): without a
/// memory resource, reserving its extents; or with `limits.memory` (the
/// default resource if none), extents allocated whole.
inline kv_block_pool pool_for(const kv_cache_config& config, bool with_resource, kv_pool_limits limits = {}) {
  if (with_resource && !limits.memory) limits.memory = std::pmr::new_delete_resource();
  kv_block_pool pool = kv_block_pool::for_caches(config, limits);
  REQUIRE(reserved(pool) == !with_resource);
  return pool;
}

/// The error `make` throws as std::system_error; {} if none.
inline ghostlink::error_code thrown_by(const std::function<void()>& make) {
  try {
    make();
    return {};
  } catch (const std::system_error& e) {
    return e.code();
  }
}

/// Blocks of `block_tokens` needed to hold `tokens` written tokens.
inline std::size_t blocks_for(std::size_t tokens, std::size_t block_tokens) {
  return (tokens + block_tokens - 1) / block_tokens;
}

/// "" when `snap` holds exactly what `m` says (its size, and every token
/// through for_each_block and read_range), otherwise the first difference.
inline std::string diff(const kv_snapshot& snap, const model& m) {
  if (snap.size() != m.size()) return str("size ", snap.size(), ", model says ", m.size());
  const std::size_t n = snap.size(), w = snap.token_width();
  std::string first;
  const ghostlink::error_code ec = for_each_token(snap, 0, n, [&](std::size_t i, auto keys, auto values) {
    if (first.empty()) first = diff_token(i, keys, values, m.tags[i]);
  });
  if (ec) return "for_each_block: " + ec.message();
  if (!first.empty()) return "for_each_block: " + first;
  kv_range r;
  if (ghostlink::error_code rec = snap.read_range(0, n, r)) return "read_range: " + rec.message();
  for (std::size_t i = 0; i < n; ++i) {
    const auto keys = std::span<const float>(r.keys).subspan(i * w, w);
    const auto values = std::span<const float>(r.values).subspan(i * w, w);
    if (std::string d = diff_token(i, keys, values, m.tags[i]); !d.empty()) return "read_range: " + d;
  }
  return {};
}

inline std::string diff(const layer_kv_cache& cache, const model& m) { return diff(cache.snapshot(), m); }

inline ghostlink::error_code truncate(layer_kv_cache& cache, std::size_t n) {
  return wait_ec([&](auto token) { return cache.async_truncate(n, token); });
}

/// The error and the new cache (empty on error).
inline std::pair<ghostlink::error_code, layer_kv_cache> fork(layer_kv_cache& cache) {
  try {
    return {{}, cache.async_fork(asio::use_future).get()};
  } catch (const ghostlink::test::async_error& e) {
    return {e.code(), {}};
  }
}

/// Tokens [begin, end) written with `tag`, as the entries of a batch. The
/// entries point into `tokens`: move it, never copy it.
struct batch_data {
  std::vector<token_data> tokens;
  std::vector<kv_write> entries;

  batch_data(std::size_t width, std::size_t begin, std::size_t end, int tag) {
    for (std::size_t i = begin; i < end; ++i) tokens.push_back(make_token(width, i, tag));
    for (std::size_t i = begin; i < end; ++i) entries.push_back({i, tokens[i - begin].keys, tokens[i - begin].values});
  }
  batch_data(batch_data&&) = default;
  batch_data(const batch_data&) = delete;
};

/// Writes tokens [begin, end) with `tag` as one batch; returns its error.
inline ghostlink::error_code write(layer_kv_cache& cache, std::size_t begin, std::size_t end, int tag) {
  const batch_data batch(cache.config().token_width(), begin, end, tag);
  return blocking{cache}.write_batch(batch.entries);
}

/// A cache together with what it should hold; every operation must succeed
/// and updates the model.
struct tracked {
  layer_kv_cache cache;
  model expected;

  void initialize(std::size_t n) {
    INFO("initialize(" << n << ")");
    REQUIRE_FALSE(blocking{cache}.initialize(n));
    expected.initialize(std::min(n, cache.config().max_tokens_per_seq));
  }
  void write(std::size_t begin, std::size_t end, int tag) {
    INFO("write [" << begin << ", " << end << ") tag " << tag);
    REQUIRE(pool::write(cache, begin, end, tag) == ghostlink::error_code{});
    expected.write(begin, end, tag);
  }
  void write(std::size_t index, int tag) { write(index, index + 1, tag); }
  void truncate(std::size_t n) {
    INFO("truncate(" << n << ")");
    REQUIRE(pool::truncate(cache, n) == ghostlink::error_code{});
    expected.truncate(n);
  }
  tracked fork() {
    auto [ec, child] = pool::fork(cache);
    INFO("fork: " << ec.message());
    REQUIRE_FALSE(ec);
    REQUIRE(child.valid());
    return {std::move(child), expected};
  }
  std::string diff() const { return pool::diff(cache, expected); }
};

/// `n` caches of `config` on `pool`, run by `io`, each initialized to one
/// token.
inline std::vector<tracked> make_caches(asio::thread_pool& io, const kv_block_pool& pool, const kv_cache_config& config,
                                        std::size_t n) {
  std::vector<tracked> t;
  for (std::size_t i = 0; i < n; ++i) {
    t.push_back({layer_kv_cache(io, config, pool), {}});
    t.back().initialize(1);
  }
  return t;
}

/// `caches` caches of `config` on `pool`, each round filled to `blocks`
/// blocks (the writes started together, so the actors allocate on both of
/// a 2-thread pool's threads), checked against their models and cut back to
/// one token, then `after_round()`; meanwhile `beside()` runs on a thread of
/// its own, started with the first round. `at_end()` runs once it has
/// joined, the caches still alive; they are gone on return.
template <class Beside, class AfterRound, class AtEnd>
void rounds_beside(kv_block_pool& pool, const kv_cache_config& config, std::size_t caches, std::size_t rounds,
                   std::size_t blocks, Beside beside, AfterRound after_round, AtEnd at_end) {
  const std::size_t bt = config.block_tokens;
  asio::thread_pool io(2);
  std::vector<tracked> t = make_caches(io, pool, config, caches);
  std::latch start(2);
  std::thread other([&] {
    start.arrive_and_wait();
    beside();
  });
  start.arrive_and_wait();
  for (std::size_t round = 0; round < rounds; ++round) {
    const int tag = static_cast<int>(round + 1);
    std::vector<std::future<void>> writes;
    std::vector<batch_data> data;
    data.reserve(caches);
    for (std::size_t i = 0; i < caches; ++i) {
      data.emplace_back(config.token_width(), 0, blocks * bt, tag);
      writes.push_back(t[i].cache.async_write_batch(data.back().entries, asio::use_future));
      t[i].expected.write(0, blocks * bt, tag);
    }
    for (auto& w : writes) w.get();
    for (std::size_t i = 0; i < caches; ++i) {
      INFO("round " << round << ", cache " << i);
      CHECK(t[i].diff() == "");
      t[i].truncate(1);
    }
    after_round();
  }
  other.join();
  at_end();
}  // the caches are gone once io's threads have joined

/// A cache with `config` on `pool`, initialized and holding tokens [0, n)
/// written with tag 1.
inline tracked make_written(asio::thread_pool& io, const kv_block_pool& pool, std::size_t n,
                            const kv_cache_config& config = small_config()) {
  tracked t{layer_kv_cache(io, config, pool), {}};
  t.initialize(1);
  if (n > 0) t.write(0, n, 1);
  return t;
}

/// A snapshot and what it must show for as long as it lives.
struct pinned {
  kv_snapshot snap;
  model expected;
  std::string what;
};

inline void pin(std::vector<pinned>& pins, const tracked& t, const std::string& what) {
  pins.push_back({t.cache.snapshot(), t.expected, what});
}

inline void check_pins(const std::vector<pinned>& pins) {
  for (const pinned& p : pins) {
    INFO("snapshot taken " << p.what << " (epoch " << p.snap.epoch() << ")");
    CHECK(diff(p.snap, p.expected) == "");
  }
}

/// A cache made by a fork in a concurrent test, what it must hold, and its
/// snapshot at the fork point with what that must keep showing.
struct branch {
  std::string name;
  layer_kv_cache cache;
  model expected;
  kv_snapshot at_fork;
  model at_fork_expected;
};

/// A branch for `cache`, just forked at a point where it holds `at_fork`
/// (nothing else writes it yet, so its snapshot is the fork point).
inline branch adopt(std::string name, layer_kv_cache cache, const model& at_fork) {
  branch b{std::move(name), std::move(cache), at_fork, {}, at_fork};
  b.at_fork = b.cache.snapshot();
  return b;
}

/// Writes token `index` of `b` with `tag` and follows it in the model; an
/// error goes to `log` (no Catch assertions off the test's thread).
inline asio::awaitable<void> put(branch& b, std::size_t index, int tag, mismatch_log& log) {
  const token_data t = make_token(b.cache.config().token_width(), index, tag);
  auto [ec] = co_await b.cache.async_write(index, t.keys, t.values, as_tuple(asio::use_awaitable));
  if (ec)
    log.add(str(b.name, ": write ", index, ": ", ec.message()));
  else
    b.expected.write(index, tag);
}

}  // namespace ghostlink::test::pool
