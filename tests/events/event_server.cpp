// A kv_event_publisher over a small prefix cache, driven line by line from
// standard input, for check_wire.py: a router's test written in Python from
// vLLM's schema alone. One layer of the tests' geometry (2 heads of 4
// lanes, 4 tokens a block) on a pool of 16 blocks, so that inserts evict.
// Prints "ready" once the sockets are bound, then answers each command
// with one line:
//   insert <token ids>  appends them to a fresh sequence, inserts it and
//                       lets it go: {"added": n, "block_hashes": [hex, ...]}
//                       (the hashes of every full block of the ids)
//   clear               clears the cache: "ok"
//   state               the cache's entries (dump()): [{"hash": hex,
//                       "parent": hex or null, "tokens": [...]}, ...]
//   stats               the publisher's counters and the cache's, as JSON
//   quit                exits (as end of input does)
// A command that fails answers "error <what>".
//
// Usage: event_server --endpoint EP --replay EP [--hashes bytes|uint64]

#include <ghostlink/event_publisher.hpp>
#include <ghostlink/kv_cache.hpp>
#include <ghostlink/prefix_cache.hpp>

#include "common/asio_compat.hpp"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <exception>
#include <iostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace ghostlink;
using json = nlohmann::ordered_json;

kv_cache_config config() { return {.max_tokens_per_seq = 64, .num_heads = 2, .head_dim = 4, .block_tokens = 4}; }

/// Any keys and values will do: a block's hash depends on its tokens alone.
void append(const sequence_kv_cache& seq, std::span<const token_id> ids) {
  std::vector<float> keys, values;
  for (const token_id id : ids)
    for (std::size_t lane = 0; lane < config().token_width(); ++lane) {
      keys.push_back(static_cast<float>(id));
      values.push_back(-static_cast<float>(id));
    }
  const std::span<const float> ks[] = {keys}, vs[] = {values};
  seq.async_append(ids, ks, vs, asio::use_future).get();
}

json hashes_hex(const std::vector<kv_block_hash>& hashes) {
  json out = json::array();
  for (const kv_block_hash& h : hashes) out.push_back(h.hex());
  return out;
}

json state(const kv_prefix_cache& cache) {
  json out = json::array();
  for (const kv_prefix_dump::entry& e : cache.dump().entries)
    out.push_back({{"hash", e.hash.hex()},
                   {"parent", e.parent ? json(e.parent->hex()) : json(nullptr)},
                   {"tokens", e.token_ids}});
  return out;
}

json stats(const kv_event_publisher& publisher, const kv_prefix_cache& cache) {
  const kv_event_publisher_stats p = publisher.stats();
  const kv_prefix_stats c = cache.stats();
  return {{"events_published", p.events_published}, {"batches_published", p.batches_published},
          {"events_dropped", p.events_dropped},     {"batches_lost", p.batches_lost},
          {"replays_served", p.replays_served},     {"dumps_served", p.dumps_served},
          {"bad_requests", p.bad_requests},         {"replies_dropped", p.replies_dropped},
          {"inserted_blocks", c.inserted_blocks},   {"evicted_blocks", c.evicted_blocks},
          {"cached_entries", c.cached_entries}};
}

/// The answer to one command line.
std::string answer(const std::string& line, asio::thread_pool& threads, const kv_block_pool& pool,
                   kv_prefix_cache& cache, const kv_event_publisher& publisher) {
  std::istringstream in(line);
  std::string command;
  in >> command;
  if (command == "insert") {
    std::vector<token_id> ids;
    for (token_id id = 0; in >> id;) ids.push_back(id);
    if (!in.eof()) return "error bad token id";
    sequence_kv_cache seq(threads, 1, config(), pool);
    append(seq, ids);
    const std::size_t added = cache.insert(seq, ids);
    // Let go at once, as a finished request does: its blocks become idle
    // entries, which later inserts evict.
    seq.async_truncate(0, asio::use_future).get();
    return json{{"added", added}, {"block_hashes", hashes_hex(cache.block_hashes(ids))}}.dump();
  }
  if (command == "clear") {
    cache.clear();
    return "ok";
  }
  if (command == "state") return state(cache).dump();
  if (command == "stats") return stats(publisher, cache).dump();
  return "error unknown command " + command;
}

}  // namespace

int main(int argc, char** argv) {
  kv_event_publisher_options options;
  bool usage = argc % 2 == 0;  // flags and their values come in pairs
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view flag = argv[i], value = argv[i + 1];
    if (flag == "--endpoint") {
      options.endpoint = value;
    } else if (flag == "--replay") {
      options.replay_endpoint = value;
    } else if (flag == "--hashes" && (value == "bytes" || value == "uint64")) {
      options.hashes = value == "bytes" ? kv_wire_hash::bytes : kv_wire_hash::uint64;
    } else {
      usage = true;
    }
  }
  if (usage || options.replay_endpoint.empty()) {
    std::fputs("usage: event_server --endpoint EP --replay EP [--hashes bytes|uint64]\n", stderr);
    return 2;
  }
  try {
    asio::thread_pool threads(2);
    kv_block_pool pool = kv_block_pool::for_caches(config(), {.max_blocks = 16});
    kv_prefix_cache cache(1, config(), pool);
    {
      kv_event_publisher publisher(cache, options);
      std::cout << "ready" << std::endl;
      for (std::string line; std::getline(std::cin, line) && line != "quit";) {
        std::string out;
        try {
          out = answer(line, threads, pool, cache, publisher);
        } catch (const std::exception& e) {  // a full pool, say: the next command still runs
          out = std::string("error ") + e.what();
        }
        std::cout << out << std::endl;
      }
    }
    threads.join();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "event_server: %s\n", e.what());
    return 1;
  }
}
