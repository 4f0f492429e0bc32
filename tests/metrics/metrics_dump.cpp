// Builds two pools with real traffic (sequences appended, a prefix cache
// inserted into, attached from and evicted from, a single layer written),
// writes their exposition (ghostlink::write_prometheus) to standard output,
// and the readings it was made from, field by field, as JSON to the file
// named by the one argument. check_metrics.py lints the exposition with
// promtool, parses it with prometheus_client and compares every sample
// with what it computes from the readings.

#include <ghostlink/block_store.hpp>
#include <ghostlink/kv_cache.hpp>

#include <asio/thread_pool.hpp>
#include <asio/use_future.hpp>

#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace gl = ghostlink;

namespace {

const gl::kv_cache_config config{.max_tokens_per_seq = 64, .num_heads = 2, .head_dim = 4, .block_tokens = 4};
constexpr std::size_t layers = 2;

std::vector<gl::token_id> run(gl::token_id first, std::size_t n) {
  std::vector<gl::token_id> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = first + static_cast<gl::token_id>(i);
  return t;
}

/// Appends `ids` (keys and values derived from them) to `seq`.
void append(const gl::sequence_kv_cache& seq, const std::vector<gl::token_id>& ids) {
  const std::size_t width = config.token_width();
  std::vector<std::vector<float>> data(layers);
  std::vector<std::span<const float>> spans;
  for (std::size_t l = 0; l < layers; ++l) {
    for (const gl::token_id id : ids)
      for (std::size_t lane = 0; lane < width; ++lane)
        data[l].push_back(static_cast<float>(id) + static_cast<float>(lane));
    spans.emplace_back(data[l]);
  }
  seq.async_append(ids, spans, spans, asio::use_future).get();
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buffer[8];
      std::snprintf(buffer, sizeof buffer, "\\u%04x", static_cast<unsigned>(c));
      out += buffer;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

void field(std::ostream& out, const char* name, unsigned long long v, bool last = false) {
  out << '"' << name << "\": " << v << (last ? "" : ", ");
}

void json(std::ostream& out, const std::vector<gl::kv_metrics_source>& sources) {
  out << "[\n";
  for (std::size_t i = 0; i < sources.size(); ++i) {
    const gl::kv_metrics_source& s = sources[i];
    const gl::kv_pool_stats& p = s.pool_stats;
    out << "{\"pool\": " << json_string(s.pool) << ", \"per_cache_series\": " << (s.per_cache_series ? "true" : "false")
        << ",\n \"pool_stats\": {";
    field(out, "block_bytes", p.block_bytes);
    field(out, "max_blocks", p.max_blocks);
    field(out, "blocks_in_use", p.blocks_in_use);
    field(out, "blocks_free", p.blocks_free);
    field(out, "peak_blocks_in_use", p.peak_blocks_in_use);
    field(out, "blocks_shared", p.blocks_shared);
    field(out, "cow_copies", p.cow_copies);
    field(out, "blocks_allocated", p.blocks_allocated);
    field(out, "bytes_allocated", p.bytes_allocated);
    field(out, "blocks_cached", p.blocks_cached);
    field(out, "blocks_cached_idle", p.blocks_cached_idle);
    field(out, "blocks_reserved", p.blocks_reserved);
    field(out, "blocks_available", p.blocks_available, true);
    out << "},\n \"prefix\": ";
    if (s.prefix) {
      const gl::kv_prefix_stats& x = *s.prefix;
      out << '{';
      field(out, "queries", x.queries);
      field(out, "query_tokens", x.query_tokens);
      field(out, "hit_tokens", x.hit_tokens);
      field(out, "inserted_blocks", x.inserted_blocks);
      field(out, "evicted_blocks", x.evicted_blocks);
      field(out, "cached_blocks", x.cached_blocks);
      field(out, "idle_blocks", x.idle_blocks);
      field(out, "window_evictions", x.window_evictions);
      out << "\"evictions_by_priority\": [";
      for (std::size_t i = 0; i < x.evictions_by_priority.size(); ++i)
        out << (i ? ", " : "") << x.evictions_by_priority[i];
      out << ']';
      out << '}';
    } else {
      out << "null";
    }
    out << ",\n \"store\": ";
    if (s.store) {
      const gl::kv_store_stats& x = *s.store;
      out << '{';
      field(out, "puts", x.puts);
      field(out, "stored", x.stored);
      field(out, "dropped", x.dropped);
      field(out, "write_errors", x.write_errors);
      field(out, "lookups", x.lookups);
      field(out, "hits", x.hits);
      field(out, "evictions", x.evictions);
      field(out, "entries", x.entries);
      field(out, "bytes", x.bytes);
      field(out, "pending_bytes", x.pending_bytes);
      field(out, "auth_errors", x.auth_errors);
      field(out, "tls_errors", x.tls_errors);
      field(out, "oversized", x.oversized);
      field(out, "directory_writable_by_others", x.directory_writable_by_others ? 1 : 0);
      out << "\"last_error_category\": "
          << (x.last_error ? json_string(x.last_error.category().name()) : std::string("null")) << ", ";
      field(out, "last_error_code", static_cast<unsigned long long>(x.last_error.value()));
      out << "\"last_error_time\": "
          << std::to_string(std::chrono::duration<double>(x.last_error_time.time_since_epoch()).count()) << "}";
    } else {
      out << "null";
    }
    out << ",\n \"events\": ";
    if (s.events) {
      const gl::kv_event_publisher_stats& x = *s.events;
      out << '{';
      field(out, "events_published", x.events_published);
      field(out, "batches_published", x.batches_published);
      field(out, "events_dropped", x.events_dropped);
      field(out, "batches_lost", x.batches_lost);
      field(out, "replays_served", x.replays_served);
      field(out, "dumps_served", x.dumps_served);
      field(out, "bad_requests", x.bad_requests);
      field(out, "replies_dropped", x.replies_dropped, true);
      out << '}';
    } else {
      out << "null";
    }
    out << ",\n \"caches\": [";
    for (std::size_t c = 0; c < s.caches.size(); ++c) {
      const gl::kv_cache_stats& k = s.caches[c];
      out << (c ? ",\n  {" : "\n  {");
      field(out, "cache_id", k.cache_id);
      field(out, "epoch", k.epoch);
      field(out, "size", k.size);
      field(out, "drains", k.drains);
      field(out, "requests_applied", k.requests_applied);
      field(out, "requests_failed", k.requests_failed);
      field(out, "requests_cancelled", k.requests_cancelled);
      field(out, "requests_queued", k.requests_queued);
      field(out, "requests_waiting", k.requests_waiting);
      field(out, "requests_delayed", k.requests_delayed);
      field(out, "epochs_alive", k.epochs_alive);
      field(out, "oldest_epoch_alive", k.oldest_epoch_alive);
      field(out, "snapshots_alive", k.snapshots_alive);
      out << "\"requests_per_drain\": [";
      for (std::size_t b = 0; b < k.requests_per_drain.size(); ++b) out << (b ? ", " : "") << k.requests_per_drain[b];
      out << "]}";
    }
    out << "]}" << (i + 1 < sources.size() ? ",\n" : "\n");
  }
  out << "]\n";
}

int dump(const char* readings_path) {
  asio::thread_pool threads(2);

  // Pool 1: a model's pool of 24 blocks with a prefix cache on it. Three
  // prompts of 16 tokens (4 blocks, 8 blocks with both layers) are inserted
  // at three priorities and let go; a fourth that shares the first's opening blocks attaches
  // them; the budget runs out, so idle entries are evicted.
  auto pool1 = gl::kv_block_pool::for_caches(config, {.max_blocks = 24});
  const std::filesystem::path directory = std::filesystem::path(readings_path).parent_path() / "store";
  auto store = std::make_shared<gl::kv_file_store>(directory);
  gl::kv_prefix_cache prefix(layers, config, pool1, {.model = "llama-3-8b@main", .store = store});
  for (gl::token_id p = 0; p < 3; ++p) {
    gl::sequence_kv_cache seq(threads, layers, config, pool1);
    const auto ids = run(1000 * (p + 1), 16);
    append(seq, ids);
    // Three retention bands: the first prompt kept at 90, the last at 10.
    prefix.insert(seq, ids, "", {.default_priority = static_cast<std::uint8_t>(p == 0 ? 90 : p == 1 ? 35 : 10)});
    seq.async_truncate(0, asio::use_future).get();
  }
  // The write-through puts hold their entries' blocks until written: let
  // them finish, so that the evictions below free what they evict.
  store->flush();
  gl::sequence_kv_cache attached = prefix.attach(threads, run(1000, 10));  // 2 full blocks hit
  append(attached, run(50, 3));
  gl::sequence_kv_cache other(threads, layers, config, pool1);
  append(other, run(7000, 13));
  gl::sequence_kv_cache forked = attached.async_fork(asio::use_future).get();
  append(forked, run(60, 1));  // a write into a shared block: a copy
  const auto pinned = attached.snapshot();  // an old epoch pinned
  append(attached, run(70, 2));
  (void)prefix.match(run(2000, 12));
  // The prompts again, from the store where RAM evicted them: store hits.
  store->flush();
  for (gl::token_id p = 0; p < 3; ++p) {
    const auto ids = run(1000 * (p + 1), 16);
    (void)prefix.async_attach(threads.get_executor(), ids, "", asio::use_future).get();
  }

  gl::kv_metrics_source model;
  model.pool = "llama-3-8b@main";
  model.pool_stats = pool1.stats();
  model.prefix = prefix.stats();
  for (const gl::sequence_kv_cache* s : {&attached, &other, &forked})
    for (std::size_t l = 0; l < layers; ++l) model.caches.push_back(s->layer(l).stats());
  model.per_cache_series = true;
  store->flush();
  model.store = store->stats();

  // Pool 2: no budget, no prefix cache, one layer on its own with a burst of
  // writes (drains of several requests), and a pool name that needs escaping.
  auto pool2 = gl::kv_block_pool::for_caches(config);
  gl::layer_kv_cache layer(threads, config, pool2);
  layer.async_initialize(1, asio::use_future).get();
  std::vector<std::vector<float>> tokens;
  for (std::size_t i = 0; i < 20; ++i) tokens.emplace_back(config.token_width(), static_cast<float>(i));
  std::vector<std::future<void>> writes;
  for (std::size_t i = 0; i < tokens.size(); ++i)
    writes.push_back(layer.async_write(i, tokens[i], tokens[i], asio::use_future));
  for (auto& w : writes) w.get();
  gl::kv_metrics_source odd;
  odd.pool = "tenant \"b\"\\\nsecond line";
  odd.pool_stats = pool2.stats();
  odd.caches.push_back(layer.stats());
  // A store's readings with an error in them, as a Redis store reports a
  // refused password: the error families' samples are written from them.
  odd.store = gl::kv_store_stats{.puts = 3, .write_errors = 3, .lookups = 2, .auth_errors = 2, .tls_errors = 1};
  odd.store->last_error = gl::kv_errc::store_auth_failed;
  odd.store->last_error_time = std::chrono::system_clock::now();
  odd.store->directory_writable_by_others = true;
  // A publisher's readings with drops in them (its own tests count them).
  odd.events = gl::kv_event_publisher_stats{.events_published = 40,
                                            .batches_published = 5,
                                            .events_dropped = 3,
                                            .batches_lost = 1,
                                            .replays_served = 2,
                                            .dumps_served = 1,
                                            .bad_requests = 1,
                                            .replies_dropped = 1};

  const std::vector<gl::kv_metrics_source> sources{model, odd};
  gl::write_prometheus(std::cout, sources);
  std::ofstream readings(readings_path);
  json(readings, sources);
  return readings && std::cout ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: metrics_dump READINGS.json > exposition.txt\n";
    return 2;
  }
  try {
    return dump(argv[1]);
  } catch (const std::exception& e) {
    std::cerr << "metrics_dump: " << e.what() << '\n';
    return 1;
  }
}
