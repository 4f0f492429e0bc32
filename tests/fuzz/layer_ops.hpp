#pragma once
// Layer-cache operations: one request, or a burst of requests mailed before
// the io_context runs so that one drain applies them all and publishes one
// epoch. Reads and snapshots pin the latest epoch when they are started.

#include "world.hpp"

#include "common/asio_compat.hpp"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

namespace ghostlink::fuzz {

using ghostlink::test::as_tuple;

enum class req_kind : std::uint8_t { initialize, write, batch, truncate, fork, read_kv, read_range, snapshot, count };

inline const char* name(req_kind k) {
  constexpr const char* names[] = {"initialize", "write",   "write_batch", "truncate",
                                   "fork",       "read_kv", "read_range",  "snapshot"};
  return names[static_cast<int>(k)];
}

inline bool through_actor(req_kind k) { return k <= req_kind::fork; }

/// When a request of a burst is cancelled through its handler's slot:
/// before the drain claims it (it must complete with operation_aborted,
/// unapplied) or after (it must complete as if not cancelled).
enum class cancel_when : std::uint8_t { never, before_drain, after_drain };

template <class T>
struct layer_req {
  req_kind kind{};
  std::size_t a = 0, b = 0;  // length, index or range
  std::vector<mwrite> writes;
  std::vector<std::vector<float>> bufs;  // keys then values of each entry; stay put until completion
  std::vector<kv_write> entries;

  bool done = false;
  bool on_strand = false;  // the handler ran on the actor's strand (it must not)
  ghostlink::error_code ec, want;
  std::size_t size_seen = 0;  // the cache's size() when the handler ran
  kv_entry entry;
  kv_range range;
  basic_layer_kv_cache<T> child;
  std::shared_ptr<mcache> child_model;
  std::shared_ptr<const mepoch> read_epoch;  // what a read pinned

  cancel_when cancel = cancel_when::never;
  asio::cancellation_type cancel_type = asio::cancellation_type::terminal;
  asio::cancellation_signal signal;  // outlives the operation (this outlives the run)
};

/// Decodes one request of `kind` for a cache of `size` published tokens.
template <class T>
std::shared_ptr<layer_req<T>> decode_req(world<T>& w, req_kind kind, std::size_t size) {
  auto r = std::make_shared<layer_req<T>>();
  r->kind = kind;
  switch (kind) {
    case req_kind::initialize:
    case req_kind::truncate:
    case req_kind::read_kv: r->a = w.pick_index(size); break;
    case req_kind::read_range:
      r->a = w.pick_index(size);
      r->b = w.pick_index(size);
      // A read that succeeds copies its range out: keep it small.
      if (r->a <= r->b && r->b <= size && r->b - r->a > 64) r->b = r->a + (r->b - r->a) % 65;
      break;
    case req_kind::write:
    case req_kind::batch: {
      const std::size_t n = kind == req_kind::write ? 1 : w.in.byte() % 7;
      for (std::size_t i = 0; i < n; ++i) {
        const std::size_t index = w.pick_index(size);
        const auto [k, v] = w.pick_lengths();
        r->writes.push_back({index, k, v, w.next_recipe()});
      }
      r->bufs.reserve(2 * n);
      for (const mwrite& e : r->writes) {
        r->bufs.push_back(world<T>::floats(e.r, e.keys, false));
        r->bufs.push_back(world<T>::floats(e.r, e.values, true));
      }
      for (std::size_t i = 0; i < n; ++i)
        r->entries.push_back({r->writes[i].index, r->bufs[2 * i], r->bufs[2 * i + 1]});
      break;
    }
    case req_kind::fork:
    case req_kind::snapshot:
    case req_kind::count: break;
  }
  current_trace().add(name(kind), r->writes.empty() ? r->a : r->writes[0].index, r->b, r->writes.size());
  return r;
}

/// Decodes 2 to 5 requests for one drain, some of the actor's to be
/// cancelled through their handlers' slots.
template <class T>
std::vector<std::shared_ptr<layer_req<T>>> decode_burst(world<T>& w, std::size_t size) {
  static_assert(static_cast<int>(req_kind::count) == 8, "a burst byte's low 3 bits pick the kind");
  constexpr asio::cancellation_type types[] = {asio::cancellation_type::terminal, asio::cancellation_type::partial,
                                               asio::cancellation_type::total, asio::cancellation_type::all};
  std::vector<std::shared_ptr<layer_req<T>>> reqs;
  const std::size_t n = 2 + w.in.byte() % 4;
  for (std::size_t i = 0; i < n; ++i) {
    // Low 3 bits: the kind; the next 3: cancelled before the drain (6),
    // after it (7) or not; the top 2: the cancellation type.
    const std::uint8_t b = w.in.byte();
    auto& r = reqs.emplace_back(decode_req(w, static_cast<req_kind>(b % static_cast<int>(req_kind::count)), size));
    if (!through_actor(r->kind) || b / 8 % 8 < 6) continue;
    r->cancel = b / 8 % 8 == 6 ? cancel_when::before_drain : cancel_when::after_drain;
    r->cancel_type = types[b / 64];
    current_trace().add(
        r->cancel == cancel_when::before_drain ? "  cancelled before the drain" : "  cancelled after the drain",
        b / 64);
  }
  return reqs;
}

/// A write or fork awaited by a coroutine. Plain `use_awaitable` (errors
/// thrown) makes the actor dispatch its drain (urgency::now), a path other
/// tokens never take; `as_tuple` around it takes the ordinary one.
template <class T>
asio::awaitable<void> co_request(basic_layer_kv_cache<T> cache, std::shared_ptr<layer_req<T>> r, bool plain) {
  try {
    if (r->kind == req_kind::fork && plain) {
      r->child = co_await cache.async_fork(asio::use_awaitable);
    } else if (r->kind == req_kind::fork) {
      auto [ec, child] = co_await cache.async_fork(as_tuple(asio::use_awaitable));
      r->ec = ec;
      r->child = std::move(child);
    } else if (plain) {
      co_await cache.async_write_batch(r->entries, asio::use_awaitable);
    } else {
      auto [ec] = co_await cache.async_write_batch(r->entries, as_tuple(asio::use_awaitable));
      r->ec = ec;
    }
  } catch (const ghostlink::test::async_error& e) {
    r->ec = e.code();
  }
  r->size_seen = cache.size();
  r->done = true;
}

/// Starts `r` on `cache`; reads and snapshots take the latest epoch now.
template <class T>
void start_req(world<T>& w, typename world<T>::cache_slot& slot, const std::shared_ptr<layer_req<T>>& r) {
  basic_layer_kv_cache<T> cache = slot.real;
  // One handler for every actor request (a fork's also takes the new cache).
  auto completed = [r, cache](ghostlink::error_code ec, auto... child) {
    r->ec = ec;
    if constexpr (sizeof...(child) == 1) r->child = std::move(child...);
    r->size_seen = cache.size();  // includes every write whose handler has run
    r->on_strand = cache.get_executor().running_in_this_thread();
    r->done = true;
  };
  auto start = [&](auto handler) {
    switch (r->kind) {
      case req_kind::initialize: cache.async_initialize(r->a, std::move(handler)); break;
      case req_kind::write:
        cache.async_write(r->entries[0].index, r->entries[0].keys, r->entries[0].values, std::move(handler));
        break;
      case req_kind::batch: cache.async_write_batch(r->entries, std::move(handler)); break;
      case req_kind::truncate: cache.async_truncate(r->a, std::move(handler)); break;
      default: cache.async_fork(std::move(handler)); break;
    }
  };
  if (through_actor(r->kind)) {
    if (r->cancel == cancel_when::never)
      start(completed);
    else
      start(asio::bind_cancellation_slot(r->signal.slot(), completed));
    return;
  }
  switch (r->kind) {
    case req_kind::read_kv:
      r->read_epoch = slot.m->current;
      cache.async_read_kv(r->a, [r](ghostlink::error_code ec, kv_entry&& e) {
        r->ec = ec;
        r->entry = std::move(e);
        r->done = true;
      });
      break;
    case req_kind::read_range:
      r->read_epoch = slot.m->current;
      cache.async_read_range(r->a, r->b, [r](ghostlink::error_code ec, kv_range&& range) {
        r->ec = ec;
        r->range = std::move(range);
        r->done = true;
      });
      break;
    case req_kind::snapshot:
      if (w.snaps.size() >= world<T>::max_snaps) w.snaps.erase(w.snaps.begin());
      w.snaps.push_back({cache.snapshot(), slot.m->current, slot.m->current->length});
      r->done = true;
      break;
    default: break;  // the actor's requests, started above
  }
}

/// Applies the actor's requests of one drain to the model, in mailbox order.
template <class T>
void model_drain(world<T>& w, mcache& c, const std::vector<std::shared_ptr<layer_req<T>>>& reqs) {
  std::uint64_t n = 0, failed = 0, cancelled = 0;
  for (const auto& r : reqs) {
    if (!through_actor(r->kind)) continue;
    ++n;
    if (r->cancel == cancel_when::before_drain) {
      r->want = asio::error::operation_aborted;
      ++cancelled;
      continue;
    }
    switch (r->kind) {
      case req_kind::initialize: r->want = w.m.initialize(c, r->a); break;
      case req_kind::write:
      case req_kind::batch: r->want = w.m.write(c, r->writes); break;
      case req_kind::truncate: r->want = w.m.truncate(c, r->a); break;
      case req_kind::fork: r->child_model = w.m.fork(c); break;
      default: break;
    }
    failed += r->want ? 1 : 0;
  }
  if (n > 0) w.m.end_drain(c, n, failed, cancelled);
}

/// Checks a read's result against the epoch it pinned.
template <class T>
void check_read(const world<T>& w, const layer_req<T>& r) {
  const mepoch& e = *r.read_epoch;
  const std::size_t width = w.width();
  if (r.kind == req_kind::read_kv) {
    const ghostlink::error_code want =
        r.a >= e.length ? ghostlink::error_code(kv_errc::index_out_of_range) : ghostlink::error_code();
    expect_ec(r.ec, want, str("async_read_kv(", r.a, ')'));
    const std::size_t n = want ? 0 : width;
    if (r.entry.keys.size() != n || r.entry.values.size() != n)
      fail(str("async_read_kv(", r.a, "): entry holds ", r.entry.keys.size(), " keys, expected ", n));
    if (!want) compare_tokens(w.tm, e, r.a, 1, r.entry.keys, r.entry.values, "async_read_kv");
    return;
  }
  ghostlink::error_code want;
  if (r.a > r.b)
    want = kv_errc::invalid_range;
  else if (r.b > e.length)
    want = kv_errc::range_out_of_bounds;
  expect_ec(r.ec, want, str("async_read_range(", r.a, ", ", r.b, ')'));
  const std::size_t n = want ? 0 : (r.b - r.a) * width;
  if (r.range.keys.size() != n || r.range.values.size() != n)
    fail(str("async_read_range(", r.a, ", ", r.b, "): range holds ", r.range.keys.size(), " keys, expected ", n));
  if (!want) compare_tokens(w.tm, e, r.a, r.b - r.a, r.range.keys, r.range.values, "async_read_range");
}

/// Starts `reqs` on cache `k` and leaves them queued (past max_pending,
/// waiting for room): the run ends here and the io_context is destroyed with
/// them pending, so their handlers must be destroyed unrun and every block
/// still come back (checked once the io_context is gone).
template <class T>
void abandon_requests(world<T>& w, std::size_t k, const std::vector<std::shared_ptr<layer_req<T>>>& reqs) {
  for (const auto& r : reqs) start_req(w, w.caches[k], r);
  for (const auto& r : reqs)
    if (r->cancel != cancel_when::never) r->signal.emit(r->cancel_type);
  const auto mailed = std::count_if(reqs.begin(), reqs.end(), [](const auto& r) { return through_actor(r->kind); });
  w.m.leave_queued(*w.caches[k].m, static_cast<std::size_t>(mailed));
  w.abandoned = true;
}

/// How run_requests starts its requests.
enum class started_by : std::uint8_t { handler, coroutine_tuple, coroutine_plain };

/// Runs `reqs` on cache `k` (all mailed before the io_context runs, so the
/// actor's requests share one drain), or a lone write or fork awaited by a
/// coroutine.
template <class T>
void run_requests(world<T>& w, std::size_t k, std::vector<std::shared_ptr<layer_req<T>>> reqs,
                  started_by how = started_by::handler) {
  // Copies: w.caches grows with the forks below.
  const basic_layer_kv_cache<T> parent = w.caches[k].real;
  const std::shared_ptr<mcache> c = w.caches[k].m;
  const kv_cache_config config = w.caches[k].config;
  const kv_block_pool pool = w.pools[c->pool];
  if (how != started_by::handler)
    asio::co_spawn(w.io, co_request(parent, reqs.front(), how == started_by::coroutine_plain), asio::detached);
  else
    for (const auto& r : reqs) start_req(w, w.caches[k], r);
  // Handlers are queued, never run inside the initiating call.
  for (const auto& r : reqs)
    if (r->done && r->kind != req_kind::snapshot) fail(str(name(r->kind), ": completed inside the initiating call"));
  for (const auto& r : reqs)
    if (r->cancel == cancel_when::before_drain) r->signal.emit(r->cancel_type);
  model_drain(w, *c, reqs);
  if (std::any_of(reqs.begin(), reqs.end(), [](const auto& r) { return r->cancel == cancel_when::after_drain; })) {
    // Run the drain alone (its completions are queued behind it), then emit
    // while the handlers still wait.
    const std::uint64_t drains = parent.stats().drains;
    w.run_until([&] { return parent.stats().drains != drains; }, "the drain before a late cancellation");
    for (const auto& r : reqs) {
      if (r->cancel != cancel_when::after_drain) continue;
      if (r->done) fail(str(name(r->kind), ": completed inside the drain, before its handler was queued"));
      r->signal.emit(r->cancel_type);
    }
  }
  w.run_to_completion([&] { return std::all_of(reqs.begin(), reqs.end(), [](const auto& r) { return r->done; }); },
                      name(reqs.front()->kind));

  for (const auto& r : reqs) {
    const std::string what = str(name(r->kind), " on cache ", k);
    if (!through_actor(r->kind)) {
      if (r->kind != req_kind::snapshot) check_read(w, *r);
      continue;
    }
    if (trace::verbose()) std::fprintf(stderr, "  %s: %s\n", what.c_str(), ec_name(r->want).c_str());
    expect_ec(r->ec, r->want, what);
    if (r->on_strand) fail(what + ": the handler ran on the actor's strand, not the cache's executor");
    // Read-your-writes: the handler ran after the drain's epoch was published.
    expect_eq(r->size_seen, c->current->length, what + ": size() in the handler");
    if (r->kind != req_kind::fork) continue;
    if (r->want) {
      if (r->child.valid()) fail(what + ": failed but handed out a cache");
      continue;
    }
    if (!r->child.valid()) fail(what + ": the new cache's handle is empty");
    if (!(r->child.config() == config)) fail(what + ": the new cache's config differs");
    if (!(r->child.pool() == pool)) fail(what + ": the new cache is on another pool");
    if (r->child == parent) fail(what + ": the new cache is the parent");
    if (r->child.get_executor() == parent.get_executor()) fail(what + ": the new cache shares the parent's strand");
    if (w.caches.size() < world<T>::max_caches) w.caches.push_back({std::move(r->child), r->child_model, config});
  }
}

}  // namespace ghostlink::fuzz
