#pragma once
/// @file
/// `basic_kv_prefix_cache<T>` (`kv_prefix_cache` for float storage): reuse
/// of the key/value blocks of prompt prefixes across requests, under the
/// pool's budget.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/block_hash.hpp"
#include "ghostlink/block_pool.hpp"
#include "ghostlink/block_store.hpp"
#include "ghostlink/completion_token.hpp"
#include "ghostlink/config.hpp"
#include "ghostlink/detail/cache_access.hpp"
#include "ghostlink/detail/prefix_interface.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/error.hpp"
#include "ghostlink/events.hpp"
#include "ghostlink/layout.hpp"
#include "ghostlink/sequence_kv_cache.hpp"
#include "ghostlink/stats.hpp"
#include "ghostlink/types.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// When a prefix cache with a store writes an entry to it.
enum class kv_store_policy : std::uint8_t {
  /// Every entry `insert()` adds is also stored, in the background, from
  /// its blocks (held until written, as a snapshot holds them).
  write_through,
  /// An entry is stored when it leaves RAM: eviction copies its blocks
  /// (`num_layers` blocks) on the evicting thread, then the store writes
  /// the copy in the background; `clear()` hands the store the entries it
  /// drops. `async_flush()` stores the entries still in RAM (before a
  /// shutdown, say). No entry is put twice while RAM holds it: not one
  /// that came from the store, nor one a flush or `clear()` put.
  write_back,
};

/// What a prefix cache's hashes cover besides the tokens and the geometry,
/// and the tier below its RAM.
struct kv_prefix_options {
  /// The model (and revision) the KV belongs to: two models never share an entry.
  std::string model{};
  /// The tier below RAM (a `kv_file_store`, or any `kv_block_store`); none
  /// (the default): RAM only. Shared: several prefix caches (of other
  /// models, geometries or pools) may use one store, as the hash tells
  /// their entries apart.
  std::shared_ptr<kv_block_store> store{};
  /// When entries are written to `store`.
  kv_store_policy store_policy = kv_store_policy::write_through;
};

/// What must stay cached, said by the request (TensorRT-LLM's
/// `KvCacheRetentionConfig`): retention priorities 0-100 over ranges of the
/// inserted tokens, each for a duration. Eviction takes the evictable entry
/// of the lowest priority first, least recently used among equals (see
/// `basic_kv_prefix_cache`, "Eviction"). A priority is an order, not a pin:
/// entries of priority 100 are evicted too when nothing lower is evictable.
struct kv_retention {
  /// The priority every token has that no range covers, and that the
  /// plain `insert()` gives: TensorRT-LLM's default.
  static constexpr std::uint8_t default_value = 35;
  /// The highest priority.
  static constexpr std::uint8_t max_priority = 100;

  /// Tokens `[first, last)` of the inserted tokens (by position from 0,
  /// the sequence's positions for `track()`), at `priority`.
  struct range {
    std::size_t first = 0;                  ///< The first token of the range.
    std::size_t last = SIZE_MAX;            ///< One past its last token (past the end: to the end).
    std::uint8_t priority = default_value;  ///< 0 .. 100.
    /// How long the priority holds from the insert, on the steady clock;
    /// then the entry has `default_priority`. 0: for as long as the entry
    /// is cached.
    std::chrono::milliseconds duration{0};
  };
  /// The ranges; a later range wins where they overlap.
  std::vector<range> ranges{};
  /// For tokens in no range, and for an entry whose range's duration ended.
  std::uint8_t default_priority = default_value;
};

/// Limits of one `async_attach`.
struct kv_attach_options {
  /// How long the store may take: when it passes, the blocks fetched so far
  /// are attached and the rest are a miss. None: no limit but the store's own.
  std::optional<std::chrono::steady_clock::duration> timeout{};
};

/// An index from block hashes to the blocks of every layer that hold one
/// full block of tokens, shared copy-on-write by every sequence that
/// attaches it: the prefix cache of vLLM's automatic prefix caching and of
/// SGLang's RadixAttention, under the budget of one `kv_block_pool`.
///
/// **The block hash.** All integers little-endian, `||` concatenation,
/// `B = block_tokens`:
///
///     root = SHA-256("ghostlink-prefix-v1" || u64(len(model)) || model
///                    || u64(len(salt)) || salt || u64(num_layers)
///                    || u64(num_heads) || u64(head_dim) || u64(B)
///                    || u8(element: 0 float, 1 half, 2 bfloat16,
///                          3 q8_0, 4 q4_0, 5 fp8_e4m3)
///                    [|| f32(key_scale) || f32(value_scale): fp8_e4m3 only]
///                    [|| u8(keys_only) || u64(window[0]) || u64(sink_tokens[0])
///                     || ... || u64(window[L-1]) || u64(sink_tokens[L-1]):
///                     a layout with a windowed layer, or keys only])
///     h[0] = SHA-256(root   || i32(t[0])   || ... || i32(t[B-1]))
///     h[i] = SHA-256(h[i-1] || i32(t[i*B]) || ... || i32(t[i*B+B-1]))
///
/// Only full blocks have a hash. The salt separates tenants (vLLM's
/// `cache_salt`): two salts never share an entry, nor do two models, two
/// geometries, two layouts (their `rollback_tokens` aside), two element
/// types or two fp8 caches of other scales (an fp8
/// block's bytes mean `scale * code`: its scales are part of what it is). SHA-256 is OpenSSL's (libcrypto), which uses
/// the processor's SHA instructions where it has them.
///
/// **Layouts** (`kv_model_layout`). An entry holds, per layer, the block
/// the inserted sequence held for it, or none where a windowed layer had
/// dropped it. A match of `L` tokens (a multiple of `B`) needs an entry for
/// each of its blocks, every full layer's block in each, and every windowed
/// layer's blocks of the positions a query at `L` attends (`L + 1 - window`
/// to `L - 1`, and its sinks). That is not monotone in `L`: `match()` and
/// the attaches find the longest valid `L`, not where a scan first fails.
/// An attached sequence's windowed layers start with those blocks alone and
/// its high-water mark is `L` (more with `rollback_tokens`, as after a
/// load). `track()` caches a sequence's blocks as they fill, before its
/// windows drop any: `insert()` after a long prompt finds the early blocks
/// of its windowed layers gone.
///
/// **Eviction.** An entry is idle when nothing but the prefix cache
/// references its blocks (no sequence, epoch or snapshot); it becomes idle
/// on whatever thread drops the last other reference. An idle entry is
/// evictable when no cached entry is its child (the next block of the same
/// prefix), so the cached set stays prefix-closed. When a cache on the pool
/// needs a block and the budget is spent, evictable entries are evicted
/// one at a time, the lowest retention priority first and least recently
/// used (last attached or inserted) among equals, until the block can be
/// had; only when none is evictable does the write fail with
/// `kv_errc::capacity_exhausted`. An entry's priority is the one its last
/// insert gave it (`kv_retention`: the range its block's last token falls
/// in; the plain `insert()` gives 35), back to that insert's
/// `default_priority` once the range's duration has ended on the steady
/// clock. A parent is never evictable before its children, whatever their
/// priorities: a cached child keeps its parent cached. With windowed layers, an
/// entry's windowed blocks are also evictable on their own once no
/// sequence uses them (the entry stays, and a full layer's blocks with it):
/// they have their own recency, renewed only by an insert and by an attach
/// whose window reads them, and the entry's priority, and the eviction
/// takes the lower in (priority, recency) of the first evictable entry and
/// the first evictable windowed part, a windowed part first at equal
/// priority and age. An entry left holding no block (every
/// layer windowed) goes when it has no cached child; its parent in turn. The allocation path takes the
/// next evictable entry from an ordered set of the evictable ones, by
/// (priority, recency), and the durations that ended from an ordered set
/// of deadlines: O(log n), and no entry in use is ever looked at. Within one attach or
/// insert, later blocks count as used before earlier ones, so a child is
/// always older than its parent.
///
/// **Cached data never changes.** A write by any sequence into a block the
/// cache references copies it first, also after a truncate made that slot
/// writable again for its owner: the cache's hold counts as a reference.
///
/// A handle: copies share one index, every member is safe from any thread.
/// One prefix cache per pool while it lives; once every handle is gone its
/// entries are released and another may be made.
template <storage_element T>
class basic_kv_prefix_cache {
 public:
  /// The sequence type `attach()` makes and `insert()` takes.
  using sequence_type = basic_sequence_kv_cache<T>;

  /// An empty cache for sequences of `num_layers` layers of `config` on `pool`.
  /// @throws std::system_error with `kv_errc::invalid_config` if the pool
  ///         has a prefix cache already (nothing is claimed then), if
  ///         `num_layers` is 0, if `config` or `T` do not fit the pool (as
  ///         for a layer cache made on it; a `kv_block_kind::keys_only`
  ///         pool fits none), or if `config` sets `max_blocks` (the pool
  ///         holds the budget).
  basic_kv_prefix_cache(std::size_t num_layers, kv_cache_config config, const kv_block_pool& pool,
                        kv_prefix_options options = {})
      : basic_kv_prefix_cache(kv_model_layout::full(num_layers), config, pool, std::move(options)) {}

  /// An empty cache for sequences of `layout` (windowed layers, sinks, keys
  /// only) of `config` on `pool` (a `kv_block_kind::keys_only` pool for a
  /// keys-only layout). Its `rollback_tokens` is the attached sequences'.
  /// @throws std::system_error with `kv_errc::invalid_config` as above, or
  ///         for a layout `kv_model_layout` refuses (no layers, sinks without
  ///         a window).
  basic_kv_prefix_cache(const kv_model_layout& layout, kv_cache_config config, const kv_block_pool& pool,
                        kv_prefix_options options = {})
      : index_(detail::make_prefix_index(layout, config, detail::codec_of<T>, pool, std::move(options))) {}

  /// The layers of every sequence it caches.
  std::size_t num_layers() const noexcept { return detail::num_layers(*index_); }
  /// The layout of every sequence it caches and attaches.
  const kv_model_layout& layout() const noexcept { return detail::layout_of(*index_); }
  /// The config it was made with.
  const kv_cache_config& config() const noexcept { return detail::config_of(*index_); }
  /// The pool whose blocks it holds and evicts.
  kv_block_pool pool() const noexcept { return detail::pool_of(*index_); }
  /// The tier below RAM it uses (`kv_prefix_options::store`); null: none.
  const std::shared_ptr<kv_block_store>& store() const noexcept { return detail::store_of(*index_); }

  /// The hash of each full block of `tokens` under `salt`:
  /// `tokens.size() / block_tokens` of them, as defined above.
  std::vector<kv_block_hash> block_hashes(std::span<const token_id> tokens, std::string_view salt = {}) const {
    return detail::block_hashes(*index_, tokens, salt);
  }

  /// The tokens of the longest match of `tokens` from block 0 (the rule
  /// above: every block of a full layout; a multiple of `block_tokens`, at
  /// most `tokens.size()` and at most
  /// the cache's `max_tokens_per_seq`, which an attached sequence holds). Pins
  /// nothing and changes no entry's place in the eviction order. An engine
  /// that needs the logits of the last prompt token passes
  /// `tokens.first(tokens.size() - 1)`. Counts a query.
  std::size_t match(std::span<const token_id> tokens, std::string_view salt = {}) const {
    return detail::prefix_match(*index_, tokens, salt);
  }

  /// A new sequence of `num_layers()` layers, the cache's config and pool,
  /// on `ex`, whose first `match(tokens, salt)` tokens are the cached
  /// blocks of every layer, shared copy-on-write: no token data is copied
  /// and no block is allocated, and its `size()` is that length (0 on a
  /// miss). It stores those tokens' ids. The entries become the most
  /// recently used, and in use until the sequence lets go of them. The
  /// sequence is like any other: append, fork, truncate, snapshot; a write
  /// into a shared block copies it. Counts a query.
  /// @throws std::bad_alloc, attaching nothing.
  sequence_type attach(asio::any_io_executor ex, std::span<const token_id> tokens, std::string_view salt = {}) {
    return detail::cache_access::adopt<sequence_type>(detail::prefix_attach(*index_, std::move(ex), tokens, salt));
  }
  /// As above, on `ctx.get_executor()`.
  template <class ExecutionContext>
    requires std::is_convertible_v<ExecutionContext&, asio::execution_context&>
  sequence_type attach(ExecutionContext& ctx, std::span<const token_id> tokens, std::string_view salt = {}) {
    return attach(asio::any_io_executor(ctx.get_executor()), tokens, salt);
  }

  /// As `attach()`, then from the store (`kv_prefix_options::store`): the
  /// blocks after the RAM hits are looked up in the store, pipelined, and
  /// each value, in block order, is checked (its checksums, and that it is
  /// this entry: hash, geometry, element type, layout), copied into new blocks of
  /// the pool, and attached; the fetched entries are then inserted, so the
  /// next attach finds them in RAM. A block that is missing, corrupt, of
  /// another entry, late (past `options.timeout`) or that the pool has no
  /// room for ends the match there: the rest is a miss, never wrong data.
  /// With a layout, the blocks after the RAM match are fetched (a value may
  /// also fill an entry's windowed blocks that RAM lacks), and the match is
  /// the longest valid one over RAM's blocks and the fetched ones (a stored
  /// entry may hold no block for a windowed layer).
  /// Without a store it is `attach()`, completing through the executor.
  ///
  /// Completion signature: `void(error_code, sequence_type)`. The sequence
  /// is on `ex`, holding the tokens attached (`size()` of them, their ids
  /// stored); the error is empty. The handler runs on its associated
  /// executor, default `ex`; the store's checks and copies run on the
  /// store's threads, never on a cache's strand.
  ///
  /// Per-operation cancellation (any type): seen when the store delivers
  /// its next value and before the match starts; the operation then
  /// completes with `asio::error::operation_aborted` and a sequence holding
  /// what was attached until then (RAM hits at least); a cancellation that
  /// finds the operation waiting on a silent store queues its end on `ex`.
  /// Memory refused is `kv_errc::capacity_exhausted` (with an empty
  /// sequence if even the sequence could not be made). `tokens` and `salt`
  /// are read when the operation starts: at the initiating call, or for a
  /// deferred token when it is launched; they must live until then.
  template <class CompletionToken = default_completion_token>
    requires(!std::same_as<std::decay_t<CompletionToken>, kv_attach_options>)
  auto async_attach(asio::any_io_executor ex, std::span<const token_id> tokens, std::string_view salt,
                    CompletionToken&& token = default_completion_token()) {
    return async_attach(std::move(ex), tokens, salt, kv_attach_options{}, std::forward<CompletionToken>(token));
  }
  /// As above, within `options`.
  template <class CompletionToken = default_completion_token>
  auto async_attach(asio::any_io_executor ex, std::span<const token_id> tokens, std::string_view salt,
                    kv_attach_options options, CompletionToken&& token = default_completion_token()) {
    return asio::async_initiate<CompletionToken, void(error_code, sequence_type)>(
        detail::initiate_attach<T>{}, token, index_, std::move(ex), tokens, salt, options);
  }

  /// For each full block of the first `min(tokens.size(), seq.snapshot().size())`
  /// tokens, makes the entry for its hash reference the blocks of every
  /// layer that `seq`'s snapshot holds for it: no copy, no round trip
  /// through an actor, `seq` unchanged. A hash that has an entry keeps it
  /// (it becomes the most recently used). Stops at a block that some layer
  /// holds as never-written zeros. Returns the entries added.
  ///
  /// A windowed layer's block goes in where `seq` still holds all of it
  /// (none otherwise); an existing entry lacking it takes it. Entries at the
  /// end holding no block at all are not added.
  ///
  /// The caller vouches that `tokens` are the tokens `seq` holds; tokens
  /// that are not make later attaches of those tokens read the wrong KV.
  /// `insert_stored_tokens()` cannot be wrong that way.
  /// @throws std::system_error with `kv_errc::layer_mismatch` for a `seq`
  ///         of another number of layers, with `kv_errc::invalid_config`
  ///         for one on another pool, of another geometry (`num_heads`,
  ///         `head_dim`, `block_tokens`), other fp8 scales, or another
  ///         layout (its `rollback_tokens` aside); nothing is inserted then.
  ///         std::bad_alloc, inserting nothing.
  std::size_t insert(const sequence_type& seq, std::span<const token_id> tokens, std::string_view salt = {}) {
    return detail::prefix_insert(*index_, detail::cache_access::state_of(seq).get(), &tokens, salt, nullptr);
  }

  /// As `insert()`, each entry (those added and those already cached) at
  /// the priority `retention` gives its block's last token (block `i`:
  /// token `(i + 1) * block_tokens - 1`), for its range's duration from
  /// now. A cached entry takes the new priority and duration, and so does
  /// every entry the plain `insert()` re-inserts (at 35, with none): a
  /// server passes the same retention for a prefix on every insert, and to
  /// `track()`.
  /// @throws std::system_error with `kv_errc::invalid_retention` for a
  ///         priority above 100, a range whose `first > last` or a negative
  ///         duration, and as `insert()` does; nothing is inserted then.
  std::size_t insert(const sequence_type& seq, std::span<const token_id> tokens, std::string_view salt,
                     const kv_retention& retention) {
    return detail::prefix_insert(*index_, detail::cache_access::state_of(seq).get(), &tokens, salt, &retention);
  }

  /// As `insert()`, with the token ids `seq` stores with its tokens (its
  /// snapshot's `token_ids()`), so they cannot mismatch. Stops at the first
  /// block holding a token stored without an id.
  std::size_t insert_stored_tokens(const sequence_type& seq, std::string_view salt = {}) {
    return detail::prefix_insert(*index_, detail::cache_access::state_of(seq).get(), nullptr, salt, nullptr);
  }
  /// As `insert_stored_tokens()`, at the priorities of `retention` (as the
  /// `insert()` taking one).
  std::size_t insert_stored_tokens(const sequence_type& seq, std::string_view salt, const kv_retention& retention) {
    return detail::prefix_insert(*index_, detail::cache_access::state_of(seq).get(), nullptr, salt, &retention);
  }

  /// Caches `seq`'s blocks as they fill: every full block `seq` stores from
  /// now on is inserted (as `insert_stored_tokens()` under `salt`) inside
  /// the drain that stores its last token, before `seq`'s windowed layers
  /// drop anything, as vLLM caches blocks when they fill; the blocks `seq`
  /// holds already go in at its next drain that stores a token. A block
  /// holding a token stored without an id, and every later one, is not
  /// inserted until a truncate cuts it. A sequence is tracked by one cache
  /// under one salt: a second call replaces the first. Tracking ends with
  /// `untrack()`, when the sequence goes, or when this cache's last handle
  /// goes; forks are not tracked. Memory refused in a drain leaves those
  /// blocks for the next one.
  /// @throws std::system_error as `insert()` does, tracking nothing then.
  ///         std::bad_alloc.
  void track(const sequence_type& seq, std::string_view salt = {}) {
    detail::prefix_track(index_, detail::cache_access::state_of(seq).get(), salt, nullptr);
  }
  /// As above, each block inserted at the priority `retention` gives its
  /// last token's position in `seq` (as the `insert()` taking one), its
  /// duration running from the drain that inserts it. The blocks `seq`
  /// held already (an attached prefix) are re-inserted at its next drain,
  /// and take these priorities too.
  /// @throws std::system_error with `kv_errc::invalid_retention` as
  ///         `insert()` does, and as the `track()` above; tracking nothing then.
  void track(const sequence_type& seq, std::string_view salt, const kv_retention& retention) {
    detail::prefix_track(index_, detail::cache_access::state_of(seq).get(), salt, &retention);
  }
  /// Ends the tracking of `seq` (by any cache), from its next drain on.
  void untrack(const sequence_type& seq) noexcept { detail::prefix_untrack(detail::cache_access::state_of(seq).get()); }

  /// Drops every entry: blocks in use elsewhere stay with their users, idle
  /// ones go back to the pool. Not an eviction: `evicted_blocks` stays, and
  /// one `cleared` event is emitted (also on an empty cache), no `removed`.
  ///
  /// With a store, every entry not in it yet (with `write_back`, those not
  /// evicted nor fetched nor flushed; with `write_through`, only those whose
  /// write memory refused), idle or in use, is handed to it first, as a
  /// flush hands it: clear() is where those entries leave RAM, so
  /// write-back stores them as it stores an evicted one. They are put, not
  /// copied: each value holds its blocks until the store has written or
  /// dropped it (a store's pending limit, as `kv_file_store_limits::
  /// max_pending_bytes`, bounds what it holds), so clear() stays quick and
  /// allocates no copy of the cache; the idle blocks go back to the pool as
  /// the store lets go of them. It does not wait for the store:
  /// `async_flush()` first does. Memory refused for a value loses its
  /// entry's write, nothing else.
  void clear() noexcept { detail::prefix_clear(*index_); }

  /// Hands the store every entry not in it yet, in use or idle (one a
  /// sequence still references is cached data that never changes, so it is
  /// stored too: a shutdown keeps everything RAM held), and completes when
  /// the store has settled those puts: stored, dropped (a limit) or failed,
  /// as `kv_block_store::when_flushed` reports. What a server calls before
  /// it shuts down, with `write_back`, so that a restarted one attaches
  /// what this one computed. Each put counts in `store_puts`; no entry is
  /// put twice (a second flush with nothing new puts nothing, and an
  /// evicted entry that a flush stored is not written back again). Until
  /// the store lets go of a value, its entry's blocks are held, as an
  /// attach holds them: not evictable. The entries that a write-back,
  /// another flush or a write-through of another thread was putting when
  /// this call looked are waited for too (this call waits for their put()
  /// to return, which is at once). The cache's destruction (its
  /// last handle gone) stores nothing: a server flushes first.
  ///
  /// Completion signature: `void(error_code)`. Success when every entry was
  /// handed, also when there was nothing to put or the cache has no store;
  /// puts the store dropped or failed are not errors here (the tier is a
  /// cache): they count in the store's `dropped` and `write_errors`.
  /// `kv_errc::capacity_exhausted` if memory was refused for some entry's
  /// value (it stays unstored: a later flush tries again). Not
  /// cancellable: the puts are handed in this call. The handler is queued
  /// on its associated executor, default ghostlink's private I/O pool,
  /// never run inside this call; the store calls `when_flushed`'s
  /// callback from its own thread, which only queues it.
  /// @throws std::bad_alloc if the operation or the store's wait cannot be
  ///         allocated (the puts are handed all the same).
  template <class CompletionToken = default_completion_token>
  auto async_flush(CompletionToken&& token = default_completion_token()) {
    return asio::async_initiate<CompletionToken, void(error_code)>(detail::initiate_flush<T>{}, token, index_);
  }

  /// The counters now (see `kv_prefix_stats`). `cached_entries -
  /// idle_blocks` entries are in use.
  kv_prefix_stats stats() const noexcept { return detail::prefix_stats(*index_); }

  /// Reports every later change to `handler`: `stored` for every entry
  /// added, in block order with its parent; `removed` for every entry
  /// evicted; `cleared` once per `clear()`. With a store that tells
  /// (`kv_store_receipt`), the same for the entries of its tier
  /// (`kv_prefix_event::tier`). `sequence` numbers the events delivered
  /// to this handler from 1 without gaps. Called synchronously, one call
  /// at a time and in `sequence` order, possibly under the cache's lock,
  /// inside an actor's drain (a removed event) or on a store's thread,
  /// under its lock (a store-tier event): it must be quick, must not throw
  /// and must not call the prefix cache or its store. An empty handler
  /// turns events off (the default, and then free; a cache with a store
  /// still keeps its store tier, for `dump()` and a handler set later).
  /// @throws std::bad_alloc if the handler cannot be stored.
  void set_event_handler(kv_prefix_event_handler handler) {
    detail::prefix_set_event_handler(*index_, std::move(handler));
  }

  /// Every cached entry (hash, tier, parent, token ids, priority): RAM's,
  /// then those of the store tier (see `kv_prefix_event::tier`), and the
  /// number of the last event the handler had been given when the dump
  /// began: what a mirror joining late starts from (see `kv_prefix_dump`).
  /// An entry copied while events change the cache is as it was at some
  /// moment after that event, and the events after it settle it: a mirror
  /// applies them idempotently. Inserts and evictions wait at most for a
  /// chunk of 256 entries to be copied, never for the whole dump.
  /// @throws std::bad_alloc.
  kv_prefix_dump dump() const { return detail::prefix_dump(*index_); }

 private:
  std::shared_ptr<detail::prefix_index> index_;
};

/// A prefix cache of float storage.
using kv_prefix_cache = basic_kv_prefix_cache<float>;

GHOSTLINK_NAMESPACE_END

#include "ghostlink/impl/prefix_cache.hpp"
