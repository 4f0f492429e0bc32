// attach_from_disk: a prompt of 4096 tokens x L layers (32) at the
// benchmark's head shape inserted into a kv_prefix_cache whose store is a
// kv_file_store in a temporary directory, written through (256 entries of
// about 1 MiB: 16 tokens x 32 layers x 2 KiB, plus a 104-byte frame) and
// flushed (untimed, its rate in the note); then, each run, the RAM cache is
// cleared (cache.clear()) and timed:
// - ghostlink: async_attach of the 4096 tokens, every block from the file
//   store: read (one pread a file, on the library's 2 I/O threads),
//   checked (checksums, hash, geometry), copied into new blocks of the
//   pool, attached; the sequence must hold 4096 tokens (fails otherwise);
// - append: the same data put into a fresh sequence by one multi-token
//   async_append of the 4096 tokens (every layer), with their ids;
// - plain_read: the same entry files read the plain way, one after another
//   on one thread (open, read in chunks of up to 4 MiB into one buffer of
//   all their bytes, allocated once and untimed, close).
// Reported: the time of each (attach against the append), and the entry
// files' bytes over the time (attach against the plain reads). Every read
// is from the page cache (the files were just written; caches are not
// dropped, which needs root). The sequences made are released untimed, on
// the same pool, so later runs reuse the pool's freed blocks. Median of
// --runs runs.
#include <ghostlink/kv_cache.hpp>

#include <asio/thread_pool.hpp>
#include <asio/use_future.hpp>

#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "../files.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {

void attach_from_disk(const options& o, report& out) {
  const std::size_t n = std::min<std::size_t>(4096, o.tokens) / o.block_tokens * o.block_tokens;
  const std::size_t entries = n / o.block_tokens;
  const kv_cache_config config = o.config();
  const token_rows data(config.token_width(), n);
  std::mt19937_64 rng(7);
  const std::vector<token_id> ids = random_token_ids(rng, n);
  const std::vector<std::span<const float>> keys(o.layers, data.keys_of(0, n)), values(o.layers, data.values_of(0, n));
  const temp_dir dir("attach_from_disk");

  asio::thread_pool threads(o.threads);
  const auto pool = kv_block_pool::for_caches(config);
  // Room for every put of one insert (kv_file_store_limits' default of
  // 256 MiB pending is just short of the 256 entries of 1 MiB + 104 bytes).
  const auto store = std::make_shared<kv_file_store>(dir.path / "store",
                                                     kv_file_store_limits{.max_pending_bytes = std::size_t{1} << 30});
  kv_prefix_cache cache(o.layers, config, pool,
                        {.model = "ghostlink-bench", .store = store, .store_policy = kv_store_policy::write_through});
  double write_through_s = 0;
  {
    const sequence_kv_cache seq(threads, o.layers, config, pool);
    seq.async_append(std::span<const token_id>(ids), keys, values, asio::use_future).get();
    const auto t0 = clock_type::now();
    if (cache.insert_stored_tokens(seq) != entries) fail("attach_from_disk", "the prompt did not make every entry");
    store->flush();
    write_through_s = seconds_since(t0);
  }
  const kv_store_stats written = store->stats();
  if (written.stored != entries || written.entries != entries || written.dropped != 0 || written.write_errors != 0)
    fail("attach_from_disk", "the store holds " + std::to_string(written.entries) + " entries, not " +
                                 std::to_string(entries) + " (" + std::to_string(written.dropped) + " dropped, " +
                                 std::to_string(written.write_errors) + " failed)");
  const std::size_t bytes = written.bytes;
  std::vector<std::filesystem::path> files;  // in block order
  for (const kv_block_hash& h : cache.block_hashes(ids)) files.push_back(store->path_of(h));
  std::vector<std::byte> buffer(bytes);

  out.run("attach_from_disk", o, [&](std::map<std::string, metric>& m) {
    metric& time = declare(m, "1 time", "sequence ready, " + std::to_string(n) + " tokens", "us", false);
    metric& time_ratio = declare(m, "2 time ratio", "attach from disk / append time", "x", false);
    metric& rate = declare(m, "3 rate", "entry files' bytes read", "bytes/s");
    metric& rate_ratio = declare(m, "4 rate ratio", "attach / plain reads", "x");
    const kv_prefix_stats before = cache.stats();
    cache.clear();
    if (cache.match(ids) != 0) fail("attach_from_disk", "the RAM cache still holds the prompt");
    {
      const auto t0 = clock_type::now();
      const sequence_kv_cache seq = cache.async_attach(threads.get_executor(), ids, {}, asio::use_future).get();
      time.values["ghostlink"] = 1e6 * seconds_since(t0);
      if (seq.size() != n)
        fail("attach_from_disk",
             "attached " + std::to_string(seq.size()) + " tokens from disk, not " + std::to_string(n));
      if (cache.stats().store_hit_tokens - before.store_hit_tokens != n)
        fail("attach_from_disk", "not every block came from the store");
    }  // released untimed
    cache.clear();
    {
      std::optional<sequence_kv_cache> seq;
      const auto t0 = clock_type::now();
      seq.emplace(threads, o.layers, config, pool);
      seq->async_append(std::span<const token_id>(ids), keys, values, asio::use_future).get();
      time.values["append"] = 1e6 * seconds_since(t0);
    }
    {
      const auto t0 = clock_type::now();
      std::size_t read = 0;
      for (const auto& f : files) read += raw::read_file(f, std::span(buffer).subspan(read));
      const double s = seconds_since(t0);
      if (read != bytes) fail("attach_from_disk", "the entry files hold " + std::to_string(read) + " bytes");
      rate.values["plain_read"] = double(bytes) / s;
    }
    rate.values["ghostlink"] = double(bytes) / (1e-6 * time.values["ghostlink"]);
    time_ratio.values["ghostlink"] = time.values["ghostlink"] / time.values["append"];
    rate_ratio.values["ghostlink"] = rate.values["ghostlink"] / rate.values["plain_read"];
  });
  threads.join();
  out.add_note("attach_from_disk",
               std::to_string(n) + " tokens x " + std::to_string(o.layers) + " layers: " + std::to_string(entries) +
                   " entry files, " + std::to_string(bytes) + " bytes, written through and flushed (untimed) at " +
                   std::to_string(int(double(bytes) / write_through_s / 1e6)) +
                   " MB/s, no fsync; then each run clears the RAM cache and times async_attach (every block from "
                   "the file store, page cache hot) against one async_append of the same tokens into a fresh "
                   "sequence, and against reading the same files in block order on one thread");
}

}  // namespace ghostlink::bench
