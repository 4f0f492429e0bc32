// save_load: a sequence of 4096 tokens x L layers (32) at the benchmark's
// head shape (4 heads x 64 dims, float: 2 KiB a token a layer, so a file
// of about 256 MiB) saved with async_save to a temporary directory and
// loaded back with async_load, against the same number of bytes written
// and read the plain way in the same directory, same process:
// - raw write: open a temporary file, write in 4 MiB chunks, fsync, close,
//   rename, fsync the directory: async_save's policy (it fsyncs the file
//   and the directory);
// - raw read: open, read in 4 MiB chunks into a buffer the file's size
//   (allocated once, untimed), close.
// Reported: bytes/s of each (the saved file's size over the time) and
// ghostlink's ratio to the plain way (target >= 0.8x each way). Each file
// is removed before it is written again, so no write replaces an old file.
// Every read is from the page cache: the file was just written, and the
// caches are not dropped (that needs root). A load reads its file once,
// each layer's full blocks straight into pool blocks with their checksums
// computed on the way; the plain read reads it once into one buffer.
#include <ghostlink/kv_cache.hpp>

#include <asio/thread_pool.hpp>
#include <asio/use_future.hpp>

#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "../files.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {

void save_load(const options& o, report& out) {
  const std::size_t n = std::min<std::size_t>(4096, o.tokens);
  const kv_cache_config config = o.config();
  const token_rows data(config.token_width(), n);
  std::mt19937_64 rng(6);
  const std::vector<token_id> ids = random_token_ids(rng, n);
  const std::vector<std::span<const float>> keys(o.layers, data.keys_of(0, n)), values(o.layers, data.values_of(0, n));
  const std::string model = "ghostlink-bench";
  const temp_dir dir("save_load");
  const std::filesystem::path file = dir.path / "sequence.kv", plain = dir.path / "plain.bin";

  asio::thread_pool threads(o.threads);
  const auto pool = kv_block_pool::for_caches(config);
  std::size_t file_bytes = 0;
  {
    const sequence_kv_cache seq(threads, o.layers, config, pool);
    seq.async_append(std::span<const token_id>(ids), keys, values, asio::use_future).get();
    const std::span<const std::byte> source = std::as_bytes(std::span<const float>(data.keys));
    const kv_save_options save_options{config, model, {}};
    async_save(seq.snapshot(), file, save_options, asio::use_future).get();  // untimed: the file's size
    file_bytes = std::filesystem::file_size(file);
    const double bytes = double(file_bytes);
    std::vector<std::byte> buffer(file_bytes);  // the plain read's destination, touched before any timing
    const auto timed = [&](auto op) {
      const auto t0 = clock_type::now();
      op();
      return bytes / seconds_since(t0);
    };
    const auto save = [&] { async_save(seq.snapshot(), file, save_options, asio::use_future).get(); };
    const auto write = [&] { raw::write_file(plain, file_bytes, source, true); };
    const auto load = [&] {
      auto [loaded, loaded_ids] = async_load<float>(threads.get_executor(), file, pool,
                                                    kv_sequence_expectation{o.layers, config, model}, asio::use_future)
                                      .get();
      if (loaded.size() != n || loaded_ids != ids)
        fail("save_load", "loaded " + std::to_string(loaded.size()) + " tokens, not the " + std::to_string(n) +
                              " saved with their ids");
      return loaded;  // released by the caller, untimed
    };
    const auto read = [&] {
      if (raw::read_file(plain, buffer) != file_bytes) fail("save_load", "the plain file is short");
    };

    std::size_t run = 0;
    out.run("save_load", o, [&](std::map<std::string, metric>& m) {
      metric& saves = declare(m, "1 save", "save, fsync'd", "bytes/s");
      metric& save_ratio = declare(m, "2 save ratio", "save / plain write", "x");
      metric& loads = declare(m, "3 load", "load, page cache hot", "bytes/s");
      metric& load_ratio = declare(m, "4 load ratio", "load / plain read", "x");
      // Both files removed and the removal synced first (untimed), so that
      // neither write replaces a file nor pays for the other's unlink; the
      // two go first in turn, run by run.
      std::filesystem::remove(file);
      std::filesystem::remove(plain);
      raw::sync_filesystem(dir.path);
      const bool ghostlink_first = run++ % 2 == 0;
      if (ghostlink_first) saves.values["ghostlink"] = timed(save);
      saves.values["plain"] = timed(write);
      if (!ghostlink_first) saves.values["ghostlink"] = timed(save);
      save_ratio.values["ghostlink"] = saves.values["ghostlink"] / saves.values["plain"];

      sequence_kv_cache loaded;
      const auto timed_load = [&] { return timed([&] { loaded = load(); }); };
      if (ghostlink_first) loads.values["ghostlink"] = timed_load();
      loads.values["plain"] = timed(read);
      if (!ghostlink_first) loads.values["ghostlink"] = timed_load();
      load_ratio.values["ghostlink"] = loads.values["ghostlink"] / loads.values["plain"];
    });
  }
  threads.join();
  out.add_note("save_load", std::to_string(n) + " tokens x " + std::to_string(o.layers) + " layers x " +
                                std::to_string(o.heads) + " heads x " + std::to_string(o.head_dim) +
                                " dims, float: a " + std::to_string(file_bytes >> 20) + " MiB file (" +
                                std::to_string(file_bytes) + " bytes) in " +
                                std::filesystem::temp_directory_path().string() +
                                "; plain: the same bytes written in 4 MiB chunks, fsync, close, rename, fsync of "
                                "the directory (async_save's policy), read back in 4 MiB chunks. Reads are from the "
                                "page cache (hot: just written, caches not dropped); a load reads the file once, "
                                "into pool blocks. Target ghostlink >= 0.8x both ways");
}

}  // namespace ghostlink::bench
