// write_prometheus: the text exposition format 0.0.4 (HELP and TYPE once a
// family, label values escaped, counters ending in _total), the values each
// series takes from the readings, the pool's sums over its caches, and the
// per-cache series only when asked for. tests/metrics/check_metrics.py
// checks real readings with promtool and prometheus_client.
#include "common/support.hpp"

#include <chrono>
#include <locale>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace metrics_tests {

using namespace ghostlink;

namespace {

std::string exposition(std::span<const kv_metrics_source> sources) {
  std::ostringstream out;
  write_prometheus(out, sources);
  return out.str();
}

std::string exposition(const kv_metrics_source& source) {
  std::ostringstream out;
  write_prometheus(out, source);
  return out.str();
}

/// The value of the sample line that starts with `series` (its name and
/// labels, as written), or "(none)"; "(twice)" when two lines match.
std::string value_of(const std::string& text, std::string_view series) {
  std::string found = "(none)";
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 && line[series.size()] == ' ') {
      if (found != "(none)") return "(twice)";
      found = line.substr(series.size() + 1);
    }
  }
  return found;
}

/// Lines of `text` that start with `prefix`.
std::size_t count_lines(const std::string& text, std::string_view prefix) {
  std::size_t n = 0;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) n += line.compare(0, prefix.size(), prefix) == 0 ? 1 : 0;
  return n;
}

kv_pool_stats some_pool() {
  kv_pool_stats p;
  p.block_bytes = 256;
  p.max_blocks = 100;
  p.blocks_in_use = 40;
  p.blocks_free = 3;
  p.peak_blocks_in_use = 55;
  p.blocks_shared = 2;
  p.cow_copies = 7;
  p.blocks_allocated = 45;
  p.bytes_allocated = 45 * 256 + 8192;  // the blocks and two extents' headers
  p.blocks_cached = 20;
  p.blocks_cached_idle = 15;
  p.blocks_reserved = 5;
  p.blocks_available = 75;
  return p;
}

kv_cache_stats some_cache(std::uint64_t id, std::uint64_t scale) {
  kv_cache_stats c;
  c.cache_id = id;
  c.epoch = 10 * scale;
  c.size = 12 * scale;
  c.requests_applied = 20 * scale;
  c.requests_failed = scale;
  c.requests_cancelled = 2 * scale;
  c.requests_queued = scale;
  c.requests_waiting = 3 * scale;
  c.requests_delayed = 4 * scale;
  c.epochs_alive = 2;
  c.oldest_epoch_alive = 10 * scale - 1;
  c.snapshots_alive = 1;
  c.requests_per_drain = {1 * scale, 2 * scale, 0, 0, 0, 0, 0, scale};
  return c;
}

}  // namespace

TEST_CASE("a pool's readings become gauges and a counter with HELP, TYPE and the pool label", "[metrics]") {
  const std::string text = exposition(kv_metrics_source{.pool = "m", .pool_stats = some_pool()});
  CHECK(value_of(text, R"(ghostlink_kv_blocks_in_use{pool="m"})") == "40");
  CHECK(value_of(text, R"(ghostlink_kv_blocks_max{pool="m"})") == "100");
  CHECK(value_of(text, R"(ghostlink_kv_blocks_in_use_peak{pool="m"})") == "55");
  CHECK(value_of(text, R"(ghostlink_kv_blocks_available{pool="m"})") == "75");
  CHECK(value_of(text, R"(ghostlink_kv_blocks_cached{pool="m"})") == "20");
  CHECK(value_of(text, R"(ghostlink_kv_blocks_cached_idle{pool="m"})") == "15");
  CHECK(value_of(text, R"(ghostlink_kv_blocks_reserved{pool="m"})") == "5");
  CHECK(value_of(text, R"(ghostlink_kv_blocks_shared{pool="m"})") == "2");
  CHECK(value_of(text, R"(ghostlink_kv_blocks_free{pool="m"})") == "3");
  CHECK(value_of(text, R"(ghostlink_kv_blocks_allocated{pool="m"})") == "45");
  CHECK(value_of(text, R"(ghostlink_kv_allocated_bytes{pool="m"})") == "19712");
  CHECK(value_of(text, R"(ghostlink_kv_block_size_bytes{pool="m"})") == "256");
  CHECK(value_of(text, R"(ghostlink_kv_in_use_bytes{pool="m"})") == "10240");
  CHECK(value_of(text, R"(ghostlink_kv_block_copies_total{pool="m"})") == "7");
  CHECK(count_lines(text, "# TYPE ghostlink_kv_block_copies_total counter") == 1);
  CHECK(count_lines(text, "# TYPE ghostlink_kv_blocks_in_use gauge") == 1);
  CHECK(count_lines(text, "# HELP ghostlink_kv_blocks_in_use ") == 1);
  // As vLLM's kv_cache_usage_perc: idle cached blocks count as free.
  CHECK(value_of(text, R"(ghostlink_kv_cache_usage_ratio{pool="m"})") == "0.25");
  // Every family has its HELP and its TYPE.
  CHECK(count_lines(text, "# HELP ") == count_lines(text, "# TYPE "));
  CHECK(text.back() == '\n');
}

TEST_CASE("an unlimited budget is +Inf blocks, and its usage ratio 0", "[metrics]") {
  asio::io_context io;
  auto pool = kv_block_pool::for_caches(test::small_config());
  layer_kv_cache cache(io, test::small_config(), pool);
  cache.async_initialize(1, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  const std::vector<float> v(test::small_config().token_width(), 1.0f);
  cache.async_write(0, v, v, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  io.run();
  const kv_pool_stats s = pool.stats();
  REQUIRE(s.blocks_in_use == 1);
  const std::string text = exposition(kv_metrics_source{.pool = "p", .pool_stats = s});
  CHECK(value_of(text, R"(ghostlink_kv_blocks_max{pool="p"})") == "+Inf");
  CHECK(value_of(text, R"(ghostlink_kv_blocks_available{pool="p"})") == "+Inf");
  CHECK(value_of(text, R"(ghostlink_kv_cache_usage_ratio{pool="p"})") == "0");
  CHECK(value_of(text, R"(ghostlink_kv_blocks_in_use{pool="p"})") == "1");
}

TEST_CASE("label values escape backslash, double quote and newline; HELP text is one line", "[metrics]") {
  const std::string text = exposition(kv_metrics_source{.pool = "a\\b\"c\nd", .pool_stats = some_pool()});
  CHECK(value_of(text, R"(ghostlink_kv_blocks_in_use{pool="a\\b\"c\nd"})") == "40");
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    INFO(line);
    CHECK((line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0 || line.rfind("ghostlink_", 0) == 0));
  }
}

TEST_CASE("each family is written once, with every pool's sample after it", "[metrics]") {
  std::vector<kv_metrics_source> sources(2);
  sources[0] = {.pool = "llama", .pool_stats = some_pool()};
  sources[1] = {.pool = "mistral", .pool_stats = some_pool()};
  sources[1].pool_stats.blocks_in_use = 41;
  const std::string text = exposition(sources);
  CHECK(count_lines(text, "# TYPE ghostlink_kv_blocks_in_use ") == 1);
  CHECK(count_lines(text, "# HELP ghostlink_kv_blocks_in_use ") == 1);
  CHECK(value_of(text, R"(ghostlink_kv_blocks_in_use{pool="llama"})") == "40");
  CHECK(value_of(text, R"(ghostlink_kv_blocks_in_use{pool="mistral"})") == "41");
  // Both samples follow the family's TYPE line before the next family's.
  const std::size_t type = text.find("# TYPE ghostlink_kv_blocks_in_use gauge");
  const std::size_t next = text.find("# HELP", type);
  CHECK(text.find(R"(ghostlink_kv_blocks_in_use{pool="llama"})", type) < next);
  CHECK(text.find(R"(ghostlink_kv_blocks_in_use{pool="mistral"})", type) < next);
}

TEST_CASE("two sources with one pool name are refused and nothing is written", "[metrics]") {
  std::vector<kv_metrics_source> sources(2);
  sources[0].pool = sources[1].pool = "same";
  std::ostringstream out;
  CHECK_THROWS_AS(write_prometheus(out, sources), std::invalid_argument);
  CHECK(out.str().empty());
  kv_metrics_source twice{.pool = "p", .caches = {some_cache(3, 1), some_cache(3, 2)}, .per_cache_series = true};
  CHECK_THROWS_AS(write_prometheus(out, twice), std::invalid_argument);
  CHECK(out.str().empty());
  twice.per_cache_series = false;  // summed only: no series collide
  CHECK_NOTHROW(write_prometheus(out, twice));
}

TEST_CASE("the prefix cache's families name tokens as vLLM does, and only pools with one have them", "[metrics]") {
  kv_prefix_stats x;
  x.queries = 3;
  x.query_tokens = 64;
  x.hit_tokens = 16;
  x.inserted_blocks = 9;
  x.evicted_blocks = 4;
  x.cached_blocks = 5;
  x.idle_blocks = 2;
  x.window_evictions = 7;
  x.evictions_by_priority = {1, 2, 0, 1};
  std::vector<kv_metrics_source> sources(2);
  sources[0] = {.pool = "with", .prefix = x};
  sources[1] = {.pool = "without"};
  const std::string text = exposition(sources);
  CHECK(value_of(text, R"(ghostlink_prefix_cache_queries_total{pool="with"})") == "64");
  CHECK(value_of(text, R"(ghostlink_prefix_cache_hits_total{pool="with"})") == "16");
  CHECK(value_of(text, R"(ghostlink_prefix_cache_hit_ratio{pool="with"})") == "0.25");
  CHECK(value_of(text, R"(ghostlink_prefix_cache_lookups_total{pool="with"})") == "3");
  CHECK(value_of(text, R"(ghostlink_prefix_cache_insertions_total{pool="with"})") == "9");
  CHECK(value_of(text, R"(ghostlink_prefix_cache_evictions_total{pool="with"})") == "4");
  CHECK(value_of(text, R"(ghostlink_prefix_cache_entries{pool="with"})") == "5");
  CHECK(value_of(text, R"(ghostlink_prefix_cache_window_evictions_total{pool="with"})") == "7");
  CHECK(value_of(text, R"(ghostlink_prefix_cache_idle_entries{pool="with"})") == "2");
  // Four fixed bands, whatever the priorities: a bounded label.
  CHECK(value_of(text, R"(ghostlink_prefix_cache_evictions_by_priority_total{pool="with",priority="0-24"})") == "1");
  CHECK(value_of(text, R"(ghostlink_prefix_cache_evictions_by_priority_total{pool="with",priority="25-49"})") == "2");
  CHECK(value_of(text, R"(ghostlink_prefix_cache_evictions_by_priority_total{pool="with",priority="50-74"})") == "0");
  CHECK(value_of(text, R"(ghostlink_prefix_cache_evictions_by_priority_total{pool="with",priority="75-100"})") == "1");
  CHECK(count_lines(text, "ghostlink_prefix_cache_evictions_by_priority_total{") == 4);
  CHECK(count_lines(text, "# TYPE ghostlink_prefix_cache_hits_total counter") == 1);
  CHECK(text.find(R"(ghostlink_prefix_cache_hits_total{pool="without"})") == std::string::npos);
  // No pool with a prefix cache: no prefix family at all.
  CHECK(exposition(sources[1]).find("ghostlink_prefix_cache") == std::string::npos);
  // Before any query the hit ratio is 0, not NaN.
  CHECK(value_of(exposition(kv_metrics_source{.pool = "new", .prefix = kv_prefix_stats{}}),
                 R"(ghostlink_prefix_cache_hit_ratio{pool="new"})") == "0");
}

TEST_CASE("an event publisher's families: events and batches published, dropped and lost, requests served",
          "[metrics]") {
  kv_event_publisher_stats x;
  x.events_published = 100;
  x.batches_published = 9;
  x.events_dropped = 7;
  x.batches_lost = 2;
  x.replays_served = 3;
  x.dumps_served = 4;
  x.bad_requests = 5;
  x.replies_dropped = 6;
  std::vector<kv_metrics_source> sources(2);
  sources[0] = {.pool = "with", .events = x};
  sources[1] = {.pool = "without"};
  const std::string text = exposition(sources);
  CHECK(value_of(text, R"(ghostlink_events_published_total{pool="with"})") == "100");
  CHECK(value_of(text, R"(ghostlink_events_batches_published_total{pool="with"})") == "9");
  CHECK(value_of(text, R"(ghostlink_events_dropped_total{pool="with"})") == "7");
  CHECK(value_of(text, R"(ghostlink_events_batches_lost_total{pool="with"})") == "2");
  CHECK(value_of(text, R"(ghostlink_events_replays_served_total{pool="with"})") == "3");
  CHECK(value_of(text, R"(ghostlink_events_dumps_served_total{pool="with"})") == "4");
  CHECK(value_of(text, R"(ghostlink_events_bad_requests_total{pool="with"})") == "5");
  CHECK(value_of(text, R"(ghostlink_events_replies_dropped_total{pool="with"})") == "6");
  CHECK(count_lines(text, "# TYPE ghostlink_events_dropped_total counter") == 1);
  CHECK(text.find(R"(ghostlink_events_published_total{pool="without"})") == std::string::npos);
  CHECK(exposition(sources[1]).find("ghostlink_events") == std::string::npos);
}

TEST_CASE("a store's families: writes by outcome, refused connections by kind, the last error's code and time",
          "[metrics]") {
  kv_store_stats x;
  x.puts = 10;
  x.stored = 6;
  x.dropped = 1;
  x.write_errors = 2;
  x.lookups = 8;
  x.hits = 5;
  x.oversized = 1;
  x.auth_errors = 3;
  x.tls_errors = 4;
  x.pending_bytes = 1024;
  std::vector<kv_metrics_source> sources(2);
  sources[0] = {.pool = "with", .store = x};
  sources[1] = {.pool = "without"};
  std::string text = exposition(sources);
  CHECK(value_of(text, R"(ghostlink_store_puts_total{pool="with"})") == "10");
  CHECK(value_of(text, R"(ghostlink_store_writes_total{pool="with",outcome="stored"})") == "6");
  CHECK(value_of(text, R"(ghostlink_store_writes_total{pool="with",outcome="dropped"})") == "1");
  CHECK(value_of(text, R"(ghostlink_store_writes_total{pool="with",outcome="failed"})") == "2");
  CHECK(value_of(text, R"(ghostlink_store_hits_total{pool="with"})") == "5");
  CHECK(value_of(text, R"(ghostlink_store_oversized_total{pool="with"})") == "1");
  CHECK(value_of(text, R"(ghostlink_store_connection_errors_total{pool="with",kind="auth"})") == "3");
  CHECK(value_of(text, R"(ghostlink_store_connection_errors_total{pool="with",kind="tls"})") == "4");
  CHECK(value_of(text, R"(ghostlink_store_pending_bytes{pool="with"})") == "1024");
  CHECK(value_of(text, R"(ghostlink_store_directory_writable_by_others{pool="with"})") == "0");
  // No error yet: a timestamp of 0 and no code sample.
  CHECK(value_of(text, R"(ghostlink_store_last_error_timestamp_seconds{pool="with"})") == "0");
  CHECK(text.find("ghostlink_store_last_error_code{") == std::string::npos);
  CHECK(text.find(R"(ghostlink_store_puts_total{pool="without"})") == std::string::npos);
  CHECK(exposition(sources[1]).find("ghostlink_store") == std::string::npos);

  const auto when = std::chrono::system_clock::time_point(std::chrono::seconds(1'700'000'000));
  sources[0].store->last_error = kv_errc::store_tls_failed;
  sources[0].store->last_error_time = when;
  sources[0].store->directory_writable_by_others = true;
  text = exposition(sources);
  CHECK(std::stod(value_of(text, R"(ghostlink_store_last_error_timestamp_seconds{pool="with"})")) == 1.7e9);
  CHECK(value_of(text, R"(ghostlink_store_last_error_code{pool="with",category="ghostlink.kv"})") ==
        std::to_string(static_cast<int>(kv_errc::store_tls_failed)));
  CHECK(value_of(text, R"(ghostlink_store_directory_writable_by_others{pool="with"})") == "1");
  CHECK(count_lines(text, "# TYPE ghostlink_store_writes_total counter") == 1);
  CHECK(count_lines(text, "ghostlink_store_writes_total{") == 3);
}

TEST_CASE("the pool's cache series sum its caches; requests per drain is a cumulative histogram", "[metrics]") {
  const kv_metrics_source source{.pool = "m", .caches = {some_cache(1, 1), some_cache(2, 10)}};
  const std::string text = exposition(source);
  CHECK(value_of(text, R"(ghostlink_kv_caches{pool="m"})") == "2");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_total{pool="m",outcome="applied"})") == "220");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_total{pool="m",outcome="failed"})") == "11");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_total{pool="m",outcome="cancelled"})") == "22");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_delayed_total{pool="m"})") == "44");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_queued{pool="m"})") == "11");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_waiting{pool="m"})") == "33");
  CHECK(value_of(text, R"(ghostlink_kv_cache_epochs_alive{pool="m"})") == "4");
  CHECK(value_of(text, R"(ghostlink_kv_cache_snapshots_alive{pool="m"})") == "2");
  CHECK(count_lines(text, "# TYPE ghostlink_kv_cache_requests_per_drain histogram") == 1);
  // Buckets {11, 22, 0, 0, 0, 0, 0, 11}: drains of 1, of 2-3, and of 128.
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_per_drain_bucket{pool="m",le="1"})") == "11");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_per_drain_bucket{pool="m",le="3"})") == "33");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_per_drain_bucket{pool="m",le="127"})") == "33");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_per_drain_bucket{pool="m",le="128"})") == "44");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_per_drain_bucket{pool="m",le="+Inf"})") == "44");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_per_drain_count{pool="m"})") == "44");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_per_drain_sum{pool="m"})") == "253");  // 220 + 11 + 22
  CHECK(count_lines(text, "ghostlink_kv_cache_requests_per_drain_bucket{") == 9);
}

TEST_CASE("per-cache series are written only when asked for, labelled by cache id", "[metrics]") {
  kv_metrics_source source{.pool = "m", .caches = {some_cache(1, 1), some_cache(2, 10)}};
  CHECK(exposition(source).find("ghostlink_kv_layer") == std::string::npos);
  CHECK(exposition(source).find("cache=\"") == std::string::npos);
  source.per_cache_series = true;
  const std::string text = exposition(source);
  CHECK(value_of(text, R"(ghostlink_kv_layer_requests_total{pool="m",cache="2",outcome="applied"})") == "200");
  CHECK(value_of(text, R"(ghostlink_kv_layer_requests_total{pool="m",cache="1",outcome="applied"})") == "20");
  CHECK(value_of(text, R"(ghostlink_kv_layer_requests_per_drain_bucket{pool="m",cache="2",le="3"})") == "30");
  CHECK(value_of(text, R"(ghostlink_kv_layer_requests_per_drain_sum{pool="m",cache="1"})") == "23");
  CHECK(value_of(text, R"(ghostlink_kv_layer_tokens{pool="m",cache="2"})") == "120");
  CHECK(value_of(text, R"(ghostlink_kv_layer_epoch{pool="m",cache="2"})") == "100");
  CHECK(value_of(text, R"(ghostlink_kv_layer_oldest_epoch_alive{pool="m",cache="2"})") == "99");
  // The pool's sums stay as they were, in families of their own.
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_total{pool="m",outcome="applied"})") == "220");
  CHECK(count_lines(text, "# TYPE ghostlink_kv_layer_requests_total counter") == 1);
}

namespace {
/// Groups thousands with a comma: what a stream's locale could do to numbers.
struct grouping : std::numpunct<char> {
  char do_thousands_sep() const override { return ','; }
  std::string do_grouping() const override { return "\3"; }
};
}  // namespace

TEST_CASE("numbers are written the same whatever locale the stream has", "[metrics]") {
  std::ostringstream out;
  out.imbue(std::locale(out.getloc(), new grouping));  // NOLINT(cppcoreguidelines-owning-memory): std::locale owns it
  kv_pool_stats p = some_pool();
  p.blocks_in_use = 1234567;
  write_prometheus(out, kv_metrics_source{.pool = "m", .pool_stats = p});
  CHECK(value_of(out.str(), R"(ghostlink_kv_blocks_in_use{pool="m"})") == "1234567");
}

TEST_CASE("a real pool's and cache's readings come out as they read", "[metrics]") {
  asio::io_context io;
  const kv_cache_config config = test::small_config();  // 4 tokens a block
  auto pool = kv_block_pool::for_caches(config, {.max_blocks = 8});
  layer_kv_cache cache(io, config, pool);
  cache.async_initialize(1, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  io.run();
  io.restart();
  const std::vector<float> v(config.token_width(), 1.0f);
  for (std::size_t i = 0; i < 6; ++i) cache.async_write(i, v, v, [](ghostlink::error_code ec) { REQUIRE_FALSE(ec); });
  io.run();  // one drain of six
  const kv_cache_stats c = cache.stats();
  const kv_pool_stats p = pool.stats();
  REQUIRE(p.blocks_in_use == 2);
  REQUIRE(c.requests_applied == 7);
  kv_metrics_source source{.pool = "real", .pool_stats = p, .caches = {c}, .per_cache_series = true};
  const std::string text = exposition(source);
  const std::string id = std::to_string(c.cache_id);
  CHECK(value_of(text, R"(ghostlink_kv_blocks_in_use{pool="real"})") == "2");
  CHECK(value_of(text, R"(ghostlink_kv_cache_usage_ratio{pool="real"})") == "0.25");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_per_drain_bucket{pool="real",le="1"})") == "1");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_per_drain_bucket{pool="real",le="7"})") == "2");
  CHECK(value_of(text, R"(ghostlink_kv_cache_requests_per_drain_sum{pool="real"})") == "7");
  CHECK(value_of(text, "ghostlink_kv_layer_tokens{pool=\"real\",cache=\"" + id + "\"}") == "6");
  CHECK(value_of(text, "ghostlink_kv_layer_epoch{pool=\"real\",cache=\"" + id + "\"}") == std::to_string(c.epoch));
}

}  // namespace metrics_tests
