// The Prometheus text exposition format 0.0.4 (see include/ghostlink/metrics.hpp
// and docs/API.md, "Metrics", for the names). The text is built in a string
// with std::to_chars, so the stream's locale never touches a number, and
// written in one call once every argument has been checked.
#include "ghostlink/metrics.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN

namespace {

/// A label's name and value (the value is escaped when written).
struct label {
  std::string_view name;
  std::string_view value;
};

/// A sample's value: counts exact as integers, ratios and +Inf as doubles.
using number = std::variant<std::uint64_t, double>;

/// Whether the budget is unlimited: `kv_pool_limits` left at its defaults,
/// where the byte limit over the block size is the budget.
bool unlimited(const kv_pool_stats& s) noexcept {
  constexpr std::size_t most = std::numeric_limits<std::size_t>::max();
  return s.max_blocks == most || (s.block_bytes != 0 && s.max_blocks == most / s.block_bytes);
}

/// Builds the exposition text, one family after another.
class exposition {
 public:
  /// Starts a family: its HELP and TYPE lines.
  void family(std::string_view name, std::string_view type, std::string_view help) {
    text_ += "# HELP ";
    text_ += name;
    text_ += ' ';
    for (const char c : help) {
      if (c == '\\')
        text_ += "\\\\";
      else if (c == '\n')
        text_ += "\\n";
      else
        text_ += c;
    }
    text_ += "\n# TYPE ";
    text_ += name;
    text_ += ' ';
    text_ += type;
    text_ += '\n';
  }

  /// One sample line: `name{labels} value`.
  template <class Number>
  void sample(std::string_view name, std::initializer_list<label> labels, const Number& v) {
    text_ += name;
    char separator = '{';
    for (const label& l : labels) {
      text_ += separator;
      separator = ',';
      text_ += l.name;
      text_ += "=\"";
      escape(l.value);
      text_ += '"';
    }
    if (separator == ',') text_ += '}';
    text_ += ' ';
    this->value(v);
    text_ += '\n';
  }

  /// The text so far.
  const std::string& text() const noexcept { return text_; }

 private:
  void escape(std::string_view value) {
    for (const char c : value) {
      if (c == '\\')
        text_ += "\\\\";
      else if (c == '"')
        text_ += "\\\"";
      else if (c == '\n')
        text_ += "\\n";
      else
        text_ += c;
    }
  }

  void value(std::uint64_t v) { append_chars(v); }

  void value(double v) {
    if (v == std::numeric_limits<double>::infinity())
      text_ += "+Inf";
    else
      append_chars(v);  // shortest text that reads back as the same double
  }

  void value(const number& v) {
    std::visit([this](auto x) { value(x); }, v);
  }

  template <class T>
  void append_chars(T v) {
    std::array<char, 32> buffer{};
    const std::to_chars_result r = std::to_chars(buffer.data(), buffer.data() + buffer.size(), v);
    text_.append(buffer.data(), r.ptr);
  }

  std::string text_;
};

/// A count of blocks against the budget: +Inf when it is unlimited.
number budget(std::size_t blocks, const kv_pool_stats& s) {
  if (unlimited(s)) return std::numeric_limits<double>::infinity();
  return std::uint64_t{blocks};
}

/// vLLM's `kv_cache_usage_perc`: the blocks that are not free for a new
/// request (idle cached blocks are, as vLLM counts its cached free blocks),
/// over the budget. 0 for an unlimited or empty budget.
double usage_ratio(const kv_pool_stats& s) {
  if (s.max_blocks == 0 || unlimited(s)) return 0;
  const std::size_t used = s.blocks_in_use > s.blocks_cached_idle ? s.blocks_in_use - s.blocks_cached_idle : 0;
  return static_cast<double>(used) / static_cast<double>(s.max_blocks);
}

/// The lifetime prefix hit rate, in tokens; 0 before any query.
double hit_ratio(const kv_prefix_stats& s) {
  return s.query_tokens == 0 ? 0 : static_cast<double>(s.hit_tokens) / static_cast<double>(s.query_tokens);
}

/// One gauge or counter of a reading (a pool's, a prefix cache's, a store's).
template <class Stats>
struct family {
  std::string_view name;
  std::string_view type;
  std::string_view help;
  number (*value)(const Stats&);
};
using pool_family = family<kv_pool_stats>;
using prefix_family = family<kv_prefix_stats>;
using store_family = family<kv_store_stats>;
using events_family = family<kv_event_publisher_stats>;

/// Each of `families` (its HELP and TYPE), then a sample of it for every
/// source whose reading `of` gives (null: the source has none).
template <class Stats, std::size_t N, class Reading>
void write_families(exposition& e, const std::array<family<Stats>, N>& families,
                    std::span<const kv_metrics_source> sources, Reading of) {
  for (const family<Stats>& f : families) {
    e.family(f.name, f.type, f.help);
    for (const kv_metrics_source& source : sources)
      if (const Stats* reading = of(source)) e.sample(f.name, {{"pool", source.pool}}, f.value(*reading));
  }
}

/// Whether some source has the optional reading `member`.
template <class Member>
bool any_has(std::span<const kv_metrics_source> sources, Member member) {
  return std::any_of(sources.begin(), sources.end(),
                     [&](const kv_metrics_source& s) { return (s.*member).has_value(); });
}

// clang-format off
constexpr std::array pool_families{
  pool_family{"ghostlink_kv_cache_usage_ratio", "gauge",
    "Fraction (0..1) of the block budget not free for new tokens: blocks in use less idle cached blocks, over the "
    "budget (vLLM kv_cache_usage_perc). 0 for an unlimited budget.",
    [](const kv_pool_stats& s) -> number { return usage_ratio(s); }},
  pool_family{"ghostlink_kv_blocks_max", "gauge", "The block budget (+Inf when unlimited).",
    [](const kv_pool_stats& s) -> number { return budget(s.max_blocks, s); }},
  pool_family{"ghostlink_kv_blocks_in_use", "gauge",
    "Blocks some cache, epoch, snapshot, prefix cache or reservation holds.",
    [](const kv_pool_stats& s) -> number { return std::uint64_t{s.blocks_in_use}; }},
  pool_family{"ghostlink_kv_blocks_in_use_peak", "gauge", "The most blocks in use at once so far.",
    [](const kv_pool_stats& s) -> number { return std::uint64_t{s.peak_blocks_in_use}; }},
  pool_family{"ghostlink_kv_blocks_available", "gauge",
    "Blocks a new request can have: the budget left plus idle cached blocks (+Inf when unlimited).",
    [](const kv_pool_stats& s) -> number { return budget(s.blocks_available, s); }},
  pool_family{"ghostlink_kv_blocks_cached", "gauge", "Of the blocks in use, those a prefix cache references.",
    [](const kv_pool_stats& s) -> number { return std::uint64_t{s.blocks_cached}; }},
  pool_family{"ghostlink_kv_blocks_cached_idle", "gauge",
    "Of the cached blocks, those only the prefix cache references: evictable.",
    [](const kv_pool_stats& s) -> number { return std::uint64_t{s.blocks_cached_idle}; }},
  pool_family{"ghostlink_kv_blocks_reserved", "gauge",
    "Of the blocks in use, budget held by reservations and not yet allocated.",
    [](const kv_pool_stats& s) -> number { return std::uint64_t{s.blocks_reserved}; }},
  pool_family{"ghostlink_kv_blocks_shared", "gauge", "Blocks referenced from more than one place (forks, pinned epochs).",
    [](const kv_pool_stats& s) -> number { return std::uint64_t{s.blocks_shared}; }},
  pool_family{"ghostlink_kv_blocks_free", "gauge", "Blocks' memory the pool holds that no block uses: freed and kept for reuse, or allocated ahead (trim() returns it).",
    [](const kv_pool_stats& s) -> number { return std::uint64_t{s.blocks_free}; }},
  pool_family{"ghostlink_kv_blocks_allocated", "gauge",
    "Blocks' memory obtained from the system and not yet returned.",
    [](const kv_pool_stats& s) -> number { return std::uint64_t{s.blocks_allocated}; }},
  pool_family{"ghostlink_kv_allocated_bytes", "gauge",
    "Bytes of memory the pool holds: its blocks' memory and its extents' headers.",
    [](const kv_pool_stats& s) -> number { return std::uint64_t{s.bytes_allocated}; }},
  pool_family{"ghostlink_kv_block_size_bytes", "gauge", "Payload bytes of one block (keys and values).",
    [](const kv_pool_stats& s) -> number { return std::uint64_t{s.block_bytes}; }},
  pool_family{"ghostlink_kv_in_use_bytes", "gauge", "Payload bytes of the blocks in use.",
    [](const kv_pool_stats& s) -> number { return std::uint64_t{s.bytes_in_use()}; }},
  pool_family{"ghostlink_kv_block_copies_total", "counter", "Blocks copied because a write hit a shared one.",
    [](const kv_pool_stats& s) -> number { return std::uint64_t{s.cow_copies}; }},
};
// clang-format on

// clang-format off
constexpr std::array prefix_families{
  prefix_family{"ghostlink_prefix_cache_queries_total", "counter",
    "Tokens of full blocks looked up by match() and attach() (vLLM prefix_cache_queries).",
    [](const kv_prefix_stats& s) -> number { return std::uint64_t{s.query_tokens}; }},
  prefix_family{"ghostlink_prefix_cache_hits_total", "counter",
    "Of the queried tokens, those found cached (vLLM prefix_cache_hits).",
    [](const kv_prefix_stats& s) -> number { return std::uint64_t{s.hit_tokens}; }},
  prefix_family{"ghostlink_prefix_cache_hit_ratio", "gauge",
    "Hits over queries, in tokens, since the cache was made (0 before any query); "
    "rate(hits_total) / rate(queries_total) gives it over a window.",
    [](const kv_prefix_stats& s) -> number { return hit_ratio(s); }},
  prefix_family{"ghostlink_prefix_cache_lookups_total", "counter", "match() and attach() calls.",
    [](const kv_prefix_stats& s) -> number { return std::uint64_t{s.queries}; }},
  prefix_family{"ghostlink_prefix_cache_insertions_total", "counter", "Entries (one block of tokens each) insert() added.",
    [](const kv_prefix_stats& s) -> number { return std::uint64_t{s.inserted_blocks}; }},
  prefix_family{"ghostlink_prefix_cache_evictions_total", "counter",
    "Entries (one block of tokens each) evicted for room in the pool.",
    [](const kv_prefix_stats& s) -> number { return std::uint64_t{s.evicted_blocks}; }},
  prefix_family{"ghostlink_prefix_cache_entries", "gauge", "Entries (one block of tokens each, every layer) cached now.",
    [](const kv_prefix_stats& s) -> number { return std::uint64_t{s.cached_blocks}; }},
  prefix_family{"ghostlink_prefix_cache_idle_entries", "gauge", "Of the entries, those nothing but the cache uses.",
    [](const kv_prefix_stats& s) -> number { return std::uint64_t{s.idle_blocks}; }},
  prefix_family{"ghostlink_prefix_cache_window_evictions_total", "counter",
    "Windowed layers' blocks of an entry evicted on their own, the entry staying (hybrid layouts).",
    [](const kv_prefix_stats& s) -> number { return std::uint64_t{s.window_evictions}; }},
};
// clang-format on

/// Seconds since the Unix epoch of `t` (0 for the epoch itself: no error yet).
double unix_seconds(std::chrono::system_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// clang-format off
constexpr std::array store_families{
  store_family{"ghostlink_store_puts_total", "counter", "Entries handed to the store to write.",
    [](const kv_store_stats& s) -> number { return s.puts; }},
  store_family{"ghostlink_store_lookups_total", "counter", "Entries looked up in the store.",
    [](const kv_store_stats& s) -> number { return s.lookups; }},
  store_family{"ghostlink_store_hits_total", "counter", "Of the lookups, those answered with bytes.",
    [](const kv_store_stats& s) -> number { return s.hits; }},
  store_family{"ghostlink_store_evictions_total", "counter", "Entries the store removed for its byte budget.",
    [](const kv_store_stats& s) -> number { return s.evictions; }},
  store_family{"ghostlink_store_oversized_total", "counter",
    "Values found larger than any entry of the cache's geometry: misses, not read.",
    [](const kv_store_stats& s) -> number { return s.oversized; }},
  store_family{"ghostlink_store_entries", "gauge", "Entries the store holds (0 for Redis: its INFO tells).",
    [](const kv_store_stats& s) -> number { return std::uint64_t{s.entries}; }},
  store_family{"ghostlink_store_bytes", "gauge", "Bytes of the entries the store holds (0 for Redis).",
    [](const kv_store_stats& s) -> number { return std::uint64_t{s.bytes}; }},
  store_family{"ghostlink_store_pending_bytes", "gauge", "Bytes of writes not yet stored or dropped.",
    [](const kv_store_stats& s) -> number { return std::uint64_t{s.pending_bytes}; }},
  store_family{"ghostlink_store_directory_writable_by_others", "gauge",
    "1 if the file store's directory can be written by users other than its owner, else 0.",
    [](const kv_store_stats& s) -> number { return std::uint64_t{s.directory_writable_by_others ? 1U : 0U}; }},
  store_family{"ghostlink_store_last_error_timestamp_seconds", "gauge",
    "When the store last met an error, in seconds since the Unix epoch; 0 while none.",
    [](const kv_store_stats& s) -> number { return s.last_error ? unix_seconds(s.last_error_time) : 0.0; }},
};
// clang-format on

/// The store's families, for the sources that have a store.
void write_stores(exposition& e, std::span<const kv_metrics_source> sources) {
  if (!any_has(sources, &kv_metrics_source::store)) return;
  write_families(e, store_families, sources, [](const kv_metrics_source& s) { return s.store ? &*s.store : nullptr; });
  e.family("ghostlink_store_writes_total", "counter",
           "Writes the store settled, by outcome: stored, dropped (a limit) or failed (an error).");
  for (const kv_metrics_source& source : sources) {
    if (!source.store) continue;
    e.sample("ghostlink_store_writes_total", {{"pool", source.pool}, {"outcome", "stored"}}, source.store->stored);
    e.sample("ghostlink_store_writes_total", {{"pool", source.pool}, {"outcome", "dropped"}}, source.store->dropped);
    e.sample("ghostlink_store_writes_total", {{"pool", source.pool}, {"outcome", "failed"}},
             source.store->write_errors);
  }
  e.family("ghostlink_store_connection_errors_total", "counter",
           "Connections to the store's server refused, by kind: auth (credentials, database, ACL) or tls (the "
           "handshake or the certificate).");
  for (const kv_metrics_source& source : sources) {
    if (!source.store) continue;
    e.sample("ghostlink_store_connection_errors_total", {{"pool", source.pool}, {"kind", "auth"}},
             source.store->auth_errors);
    e.sample("ghostlink_store_connection_errors_total", {{"pool", source.pool}, {"kind", "tls"}},
             source.store->tls_errors);
  }
  e.family("ghostlink_store_last_error_code", "gauge",
           "The store's last error: its code, labelled by its category (ghostlink.kv, generic, system); no sample "
           "while none.");
  for (const kv_metrics_source& source : sources)
    if (source.store && source.store->last_error)
      e.sample("ghostlink_store_last_error_code",
               {{"pool", source.pool}, {"category", source.store->last_error.category().name()}},
               static_cast<double>(source.store->last_error.value()));
}

// clang-format off
constexpr std::array events_families{
  events_family{"ghostlink_events_published_total", "counter", "KV events sent in batches on the PUB socket.",
    [](const kv_event_publisher_stats& s) -> number { return s.events_published; }},
  events_family{"ghostlink_events_batches_published_total", "counter", "Event batches sent on the PUB socket.",
    [](const kv_event_publisher_stats& s) -> number { return s.batches_published; }},
  events_family{"ghostlink_events_dropped_total", "counter",
    "KV events the publisher's full queue dropped: a gap every subscriber sees.",
    [](const kv_event_publisher_stats& s) -> number { return s.events_dropped; }},
  events_family{"ghostlink_events_batches_lost_total", "counter",
    "Batch numbers never sent, their events dropped: the gaps subscribers replay or rejoin over.",
    [](const kv_event_publisher_stats& s) -> number { return s.batches_lost; }},
  events_family{"ghostlink_events_replays_served_total", "counter", "Replay requests answered.",
    [](const kv_event_publisher_stats& s) -> number { return s.replays_served; }},
  events_family{"ghostlink_events_dumps_served_total", "counter", "Dump requests answered.",
    [](const kv_event_publisher_stats& s) -> number { return s.dumps_served; }},
  events_family{"ghostlink_events_bad_requests_total", "counter", "Replay-socket messages that were not a request.",
    [](const kv_event_publisher_stats& s) -> number { return s.bad_requests; }},
  events_family{"ghostlink_events_replies_dropped_total", "counter",
    "Replies cut short because the client was not reading.",
    [](const kv_event_publisher_stats& s) -> number { return s.replies_dropped; }},
};
// clang-format on

/// The labels of kv_prefix_stats::evictions_by_priority's bands
/// (kv_priority_band): a fixed few, never one series per priority.
constexpr std::array<std::string_view, 4> priority_bands{"0-24", "25-49", "50-74", "75-100"};
static_assert(priority_bands.size() == std::tuple_size_v<decltype(kv_prefix_stats::evictions_by_priority)>);

void write_priority_bands(exposition& e, std::span<const kv_metrics_source> sources) {
  e.family("ghostlink_prefix_cache_evictions_by_priority_total", "counter",
           "Entries evicted, by the band of their retention priority when they went (0-24, 25-49 with the default "
           "35, 50-74, 75-100); the bands sum to ghostlink_prefix_cache_evictions_total.");
  for (const kv_metrics_source& source : sources)
    if (source.prefix)
      for (std::size_t b = 0; b < priority_bands.size(); ++b)
        e.sample("ghostlink_prefix_cache_evictions_by_priority_total",
                 {{"pool", source.pool}, {"priority", priority_bands[b]}}, source.prefix->evictions_by_priority[b]);
}

/// One cache's readings, or several caches' summed.
struct cache_totals {
  std::uint64_t applied = 0, failed = 0, cancelled = 0, delayed = 0;
  std::uint64_t queued = 0, waiting = 0, epochs_alive = 0, snapshots_alive = 0;
  kv_cache_stats::drain_histogram drain_sizes{};

  void add(const kv_cache_stats& s) noexcept {
    applied += s.requests_applied;
    failed += s.requests_failed;
    cancelled += s.requests_cancelled;
    delayed += s.requests_delayed;
    queued += s.requests_queued;
    waiting += s.requests_waiting;
    epochs_alive += s.epochs_alive;
    snapshots_alive += s.snapshots_alive;
    for (std::size_t i = 0; i < drain_sizes.size(); ++i) drain_sizes[i] += s.requests_per_drain[i];
  }
};

/// The sample labels of one pool or one cache of it.
struct series {
  std::string_view pool;
  std::string_view cache;  // empty: the pool's sums

  template <class Number>
  void write(exposition& e, std::string_view name, Number v) const {
    if (cache.empty())
      e.sample(name, {{"pool", pool}}, v);
    else
      e.sample(name, {{"pool", pool}, {"cache", cache}}, v);
  }
  template <class Number>
  void write(exposition& e, std::string_view name, label extra, Number v) const {
    if (cache.empty())
      e.sample(name, {{"pool", pool}, extra}, v);
    else
      e.sample(name, {{"pool", pool}, {"cache", cache}, extra}, v);
  }
};

/// The upper bounds (`le`) of kv_cache_stats::drain_histogram's buckets:
/// bucket i holds drains of [2^i, 2^(i+1)) requests, so at most
/// 2^(i+1) - 1; the last holds drains of 128.
constexpr std::array<std::string_view, 8> drain_bounds{"1", "3", "7", "15", "31", "63", "127", "128"};
static_assert(drain_bounds.size() == std::tuple_size_v<kv_cache_stats::drain_histogram>);

/// The request families of `prefix` (`ghostlink_kv_cache` or
/// `ghostlink_kv_layer`), for every entry of `rows`.
void write_requests(exposition& e, std::string_view prefix, const std::vector<std::pair<series, cache_totals>>& rows) {
  const std::string p(prefix);
  e.family(p + "_requests_total", "counter",
           "Write requests the actor took, by outcome: applied, failed, or cancelled before it applied them.");
  for (const auto& [s, t] : rows) {
    s.write(e, p + "_requests_total", {"outcome", "applied"}, t.applied);
    s.write(e, p + "_requests_total", {"outcome", "failed"}, t.failed);
    s.write(e, p + "_requests_total", {"outcome", "cancelled"}, t.cancelled);
  }
  e.family(p + "_requests_delayed_total", "counter", "Requests that had to wait for room in a full mailbox.");
  for (const auto& [s, t] : rows) s.write(e, p + "_requests_delayed_total", t.delayed);
  e.family(p + "_requests_queued", "gauge", "Requests in the mailboxes now.");
  for (const auto& [s, t] : rows) s.write(e, p + "_requests_queued", t.queued);
  e.family(p + "_requests_waiting", "gauge", "Requests waiting for room in a full mailbox now.");
  for (const auto& [s, t] : rows) s.write(e, p + "_requests_waiting", t.waiting);
  e.family(p + "_requests_per_drain", "histogram",
           "Mailbox drains by the requests each took (group commit); the sum is the requests taken in all drains "
           "(applied + failed + cancelled).");
  for (const auto& [s, t] : rows) {
    std::uint64_t cumulative = 0;
    for (std::size_t i = 0; i < drain_bounds.size(); ++i) {
      cumulative += t.drain_sizes[i];
      s.write(e, p + "_requests_per_drain_bucket", {"le", drain_bounds[i]}, cumulative);
    }
    s.write(e, p + "_requests_per_drain_bucket", {"le", "+Inf"}, cumulative);
    s.write(e, p + "_requests_per_drain_sum", t.applied + t.failed + t.cancelled);
    s.write(e, p + "_requests_per_drain_count", cumulative);
  }
  e.family(p + "_epochs_alive", "gauge", "Epochs in memory: the latest of each cache and older ones snapshots pin.");
  for (const auto& [s, t] : rows) s.write(e, p + "_epochs_alive", t.epochs_alive);
  e.family(p + "_snapshots_alive", "gauge", "Snapshots open now (reads in progress included).");
  for (const auto& [s, t] : rows) s.write(e, p + "_snapshots_alive", t.snapshots_alive);
}

void check(std::span<const kv_metrics_source> sources) {
  std::set<std::string_view> pools;
  for (const kv_metrics_source& source : sources) {
    if (!pools.insert(source.pool).second)
      throw std::invalid_argument("write_prometheus: two sources with pool=\"" + source.pool + "\"");
    if (!source.per_cache_series) continue;
    std::set<std::uint64_t> ids;
    for (const kv_cache_stats& c : source.caches)
      if (!ids.insert(c.cache_id).second)
        throw std::invalid_argument("write_prometheus: cache " + std::to_string(c.cache_id) + " twice in pool=\"" +
                                    source.pool + "\"");
  }
}

}  // namespace

void write_prometheus(std::ostream& out, std::span<const kv_metrics_source> sources) {
  check(sources);
  exposition e;

  write_families(e, pool_families, sources, [](const kv_metrics_source& s) { return &s.pool_stats; });
  if (any_has(sources, &kv_metrics_source::prefix)) {
    write_families(e, prefix_families, sources,
                   [](const kv_metrics_source& s) { return s.prefix ? &*s.prefix : nullptr; });
    write_priority_bands(e, sources);
  }

  write_stores(e, sources);
  if (any_has(sources, &kv_metrics_source::events))
    write_families(e, events_families, sources,
                   [](const kv_metrics_source& s) { return s.events ? &*s.events : nullptr; });

  e.family("ghostlink_kv_caches", "gauge",
           "Caches (layers) the readings of the pool's ghostlink_kv_cache_* series sum.");
  for (const kv_metrics_source& source : sources)
    e.sample("ghostlink_kv_caches", {{"pool", source.pool}}, static_cast<std::uint64_t>(source.caches.size()));

  std::vector<std::pair<series, cache_totals>> pools;
  pools.reserve(sources.size());
  for (const kv_metrics_source& source : sources) {
    cache_totals t;
    for (const kv_cache_stats& c : source.caches) t.add(c);
    pools.emplace_back(series{.pool = source.pool, .cache = {}}, t);
  }
  write_requests(e, "ghostlink_kv_cache", pools);

  // Per cache, opt-in. The ids' text lives in `ids` while the rows point at it.
  std::vector<std::string> ids;
  std::vector<const kv_cache_stats*> stats;
  std::vector<std::string_view> owners;
  for (const kv_metrics_source& source : sources)
    if (source.per_cache_series)
      for (const kv_cache_stats& c : source.caches) {
        ids.push_back(std::to_string(c.cache_id));
        stats.push_back(&c);
        owners.emplace_back(source.pool);
      }
  if (!ids.empty()) {
    std::vector<std::pair<series, cache_totals>> caches;
    caches.reserve(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      cache_totals t;
      t.add(*stats[i]);
      caches.emplace_back(series{.pool = owners[i], .cache = ids[i]}, t);
    }
    write_requests(e, "ghostlink_kv_layer", caches);
    e.family("ghostlink_kv_layer_tokens", "gauge", "Tokens in the cache's latest epoch.");
    for (std::size_t i = 0; i < ids.size(); ++i)
      caches[i].first.write(e, "ghostlink_kv_layer_tokens", static_cast<std::uint64_t>(stats[i]->size));
    e.family("ghostlink_kv_layer_epoch", "gauge", "The cache's latest published epoch number.");
    for (std::size_t i = 0; i < ids.size(); ++i) caches[i].first.write(e, "ghostlink_kv_layer_epoch", stats[i]->epoch);
    e.family("ghostlink_kv_layer_oldest_epoch_alive", "gauge",
             "The cache's oldest epoch in memory; far behind its epoch, a reader holds an old snapshot.");
    for (std::size_t i = 0; i < ids.size(); ++i)
      caches[i].first.write(e, "ghostlink_kv_layer_oldest_epoch_alive", stats[i]->oldest_epoch_alive);
  }

  out.write(e.text().data(), static_cast<std::streamsize>(e.text().size()));
}

void write_prometheus(std::ostream& out, const kv_metrics_source& source) {
  write_prometheus(out, std::span<const kv_metrics_source>(&source, 1));
}

GHOSTLINK_NAMESPACE_END
