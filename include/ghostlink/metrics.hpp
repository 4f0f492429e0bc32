#pragma once
/// @file
/// The counters of pools, their caches, prefix caches, their stores and event publishers in the Prometheus
/// text exposition format (version 0.0.4), for a `/metrics` endpoint.

#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>
#include "ghostlink/detail/flavour.hpp"
#include "ghostlink/stats.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// One pool's readings, as `write_prometheus` exports them: every series it
/// writes for this pool carries the label `pool="<pool>"`.
///
/// The caller takes the readings (`kv_block_pool::stats()`,
/// `basic_kv_prefix_cache::stats()`, `basic_layer_kv_cache::stats()` of
/// each layer, or of `seq.layer(i)` for a sequence) at scrape time; the
/// writer only formats them, so it needs no lock and touches no cache.
struct kv_metrics_source {
  /// The value of the `pool` label: what tells this pool from the others
  /// of the process, for example the model it serves. Distinct per source.
  std::string pool{};
  kv_pool_stats pool_stats{};              ///< The pool's counters.
  std::optional<kv_prefix_stats> prefix{};  ///< The pool's prefix cache's counters, if it has one.
  /// Caches on the pool (layers, of sequences or on their own), summed into
  /// the pool's `ghostlink_kv_cache_*` series: requests by outcome,
  /// requests per drain, queue lengths, epochs and snapshots alive.
  std::vector<kv_cache_stats> caches{};
  /// Also write one `ghostlink_kv_layer_*` series per cache in `caches`,
  /// labelled `cache="<cache_id>"`. Off by default: with a cache per layer
  /// per sequence, the series would multiply with every request.
  bool per_cache_series = false;
  /// The counters of the prefix cache's store (`kv_block_store::stats()`),
  /// if it has one: the `ghostlink_store_*` series.
  std::optional<kv_store_stats> store{};
  /// The counters of the prefix cache's KV-event publisher
  /// (`kv_event_publisher::stats()`), if it has one: the
  /// `ghostlink_events_*` series, whose drops and lost batches are the gaps
  /// its subscribers see.
  std::optional<kv_event_publisher_stats> events{};
};

/// Writes `sources` in the Prometheus text exposition format 0.0.4: each
/// metric family once (`# HELP`, `# TYPE`, then the samples of every
/// source that has it), counters ending in `_total`, sizes in bytes, label
/// values escaped. docs/API.md ("Metrics") lists every name, its type and
/// unit, and the vLLM metric it corresponds to.
/// Formats numbers locale-independently, whatever `out` is imbued with.
/// @throws std::invalid_argument if two sources have the same `pool`, or
///         one with `per_cache_series` lists the same `cache_id` twice
///         (the series would collide); nothing is written then.
///         Whatever writing to `out` throws.
void write_prometheus(std::ostream& out, std::span<const kv_metrics_source> sources);

/// As the overload above, for one pool.
void write_prometheus(std::ostream& out, const kv_metrics_source& source);

GHOSTLINK_NAMESPACE_END
