// decode_with_offload: as decode_with_offloader, L layers x B sequences
// prefilled with 2048 tokens each (untimed), decoded token by token from T
// threads (per layer: write the token, attend over the whole context), but
// the offload is to disk, block by block: each time a sequence completes a
// block (block_tokens tokens), its decode thread hands the new block, all
// layers, to a writer that stores it as one file (about 1 MiB at the
// default shape: 32 layers x 16 tokens x 2 KiB, plus a 104-byte frame) in a
// temporary directory, in the background:
// - ghostlink: its pool preallocated (kv_block_pool::preallocate) with
//   every cache's blocks at its longest plus the extent each fills, as the
//   baseline allocates and zeroes its buffers before the clock starts; the
//   sequence is a sequence_kv_cache decoded through sequence steps (begin,
//   per layer write then attend over step.snapshot(l), commit), under a
//   kv_prefix_cache whose store is a kv_file_store (no fsync, the default;
//   its I/O on a pool of offload_threads, as many as the baseline's writer
//   has) with write_through; the offload is cache.insert_stored_tokens(seq), whose new
//   entry is written through from the blocks themselves (no copy on the
//   decode thread). Every sequence's prompt is the same 2048 token ids, so
//   its 128 entries are inserted and flushed before the timed phases; the
//   decoded ids are each sequence's own.
// - rwlock_zero_copy (bench/baselines/locked_cache.hpp, attention straight
//   from the buffer under the shared lock): the block's bytes, every layer,
//   are copied into one buffer of the same size under each layer's shared
//   lock and queued; one writer thread checksums it (XXH3, as ghostlink's
//   entry) and writes it as a file: temporary name, write, close, rename,
//   no fsync (the file store's default).
// Both take their KV memory (ghostlink's pool, the baseline's buffers) from
// one arena written before the first run (bench/arena.hpp), in turn, so
// that both stream the same physical pages.
// Each sequence decodes 2 blocks' worth of steps (32 at 16-token blocks)
// without offloading (the reference: what the decode path costs alone),
// then, after an untimed catch-up (ghostlink inserts and flushes the blocks
// of those steps), 3.5 blocks' worth (56) offloading every completed block.
// Fixed step counts, not a time: at the default shape a step takes about
// 150 ms, and a phase must complete blocks. Reported per phase: decode steps/s and the p50/p99 time between
// two tokens of one sequence (TPOT); for the offloading phase also the
// entries and bytes actually stored per second during it (ghostlink: from
// store->stats(); the baseline: files its writer completed). Targets:
// ghostlink steps/s >= the lock's, p99 TPOT <= the lock's.
#include <ghostlink/kv_cache.hpp>

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
#include <asio/use_future.hpp>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

#include <xxhash.h>

#include "../arena.hpp"
#include "../baselines/locked_cache.hpp"
#include "../files.hpp"
#include "../scenarios.hpp"
#include "../workload.hpp"

namespace ghostlink::bench {
namespace {

constexpr std::size_t context = 2048;
constexpr std::size_t entry_frame = 96 + 8;  // a store entry's header and trailing checksum
constexpr std::size_t offload_threads = 1;  // each side's: the baseline's entry_writer, the file store's I/O pool

/// Steps of each sequence in the reference phase and the offloading one.
std::size_t reference_steps(const options& o) { return 2 * o.block_tokens; }
std::size_t offload_steps(const options& o) { return 3 * o.block_tokens + o.block_tokens / 2; }

struct phase {
  double steps_per_s = 0, entries_per_s = 0, bytes_per_s = 0;
  latencies tpot;
};
struct outcome {
  phase reference, offload;
};

kv_cache_config offload_config(const options& o) {
  kv_cache_config c = o.config();
  c.max_tokens_per_seq = context + reference_steps(o) + offload_steps(o);
  return c;
}

/// Token i of sequence s: the shared prompt's, then the sequence's own.
token_id id_of(std::size_t s, std::size_t i) { return i < context ? token_id(i) : token_id(((s + 1) << 20) | i); }

/// Runs one phase (`run()` returns when every sequence has done its
/// steps); `stored()` (entries, bytes) is read before and right after it.
template <class Run, class Stored>
phase timed_phase(std::vector<progress>& seqs, Run run, Stored stored) {
  for (progress& p : seqs) p.at.clear();
  phase out;
  const auto [entries0, bytes0] = stored();
  double elapsed = 0;
  {
    const perf_window profiled;
    const auto t0 = clock_type::now();
    run();
    elapsed = seconds_since(t0);
  }
  const auto [entries1, bytes1] = stored();
  const std::size_t tokens = add_tpot(seqs, out.tpot);
  out.steps_per_s = double(tokens) / double(seqs.size()) / elapsed;
  out.entries_per_s = double(entries1 - entries0) / elapsed;
  out.bytes_per_s = double(bytes1 - bytes0) / elapsed;
  return out;
}

/// Steps [first, end) of sequence `s`, through sequence steps; with a
/// `cache`, every completed block is inserted (so written through).
asio::awaitable<void> decode(const options& o, kv_prefix_cache* cache, const sequence_kv_cache& seq, std::size_t s,
                             std::size_t first, std::size_t end, const std::vector<token>& data, progress& done) {
  for (std::size_t step = first; step < end; ++step) {
    const token_id id = id_of(s, step);
    const token& t = data[step % data.size()];
    const auto open = co_await seq.async_begin_step(std::span<const token_id>(&id, 1), asio::use_awaitable);
    for (std::size_t l = 0; l < o.layers; ++l) {
      keep(float(open.write(l, t.keys, t.values).value()));
      attention a(o.heads, o.head_dim);
      a.over(open.snapshot(l));
      keep(a.checksum());
    }
    co_await open.async_commit(asio::use_awaitable);
    if (cache && (step + 1) % o.block_tokens == 0 && cache->insert_stored_tokens(seq) != 1)
      fail("decode_with_offload", "a completed block made no new entry");
    done.tick();
  }
}

outcome run_ghostlink(const options& o, const token_rows& prompt, const std::vector<token>& data, arena& memory) {
  const temp_dir dir("decode_with_offload");
  arena::resource resource(memory);  // outlives the pool, as it must
  asio::thread_pool threads(o.threads);
  const kv_cache_config config = offload_config(o);
  auto pool = kv_block_pool::for_caches(config, {.memory = &resource});
  pool.preallocate(preallocated_blocks(
      config, o.sequences * o.layers, pool.blocks_per_extent()));  // as the baseline's buffers, before the clock starts
  asio::thread_pool io(offload_threads);  // outlives the store
  const auto store = std::make_shared<kv_file_store>(dir.path, kv_file_store_limits{.io_executor = io.get_executor()});
  kv_prefix_cache cache(o.layers, config, pool,
                        {.model = "ghostlink-bench", .store = store, .store_policy = kv_store_policy::write_through});
  std::vector<token_id> ids(context);
  for (std::size_t i = 0; i < context; ++i) ids[i] = id_of(0, i);
  const std::vector<std::span<const float>> keys(o.layers, prompt.keys_of(0, context)),
      values(o.layers, prompt.values_of(0, context));
  std::vector<sequence_kv_cache> seqs;
  seqs.reserve(o.sequences);
  for (std::size_t s = 0; s < o.sequences; ++s) {
    seqs.emplace_back(threads, o.layers, config, pool);
    seqs.back().async_append(std::span<const token_id>(ids), keys, values, asio::use_future).get();
    cache.insert_stored_tokens(seqs.back());  // the shared prompt's entries: the first sequence's
  }
  store->flush();

  outcome out;
  std::vector<progress> done(o.sequences);
  const auto stored = [&] {
    const kv_store_stats st = store->stats();
    return std::pair{double(st.stored), double(st.bytes)};
  };
  const auto decode_all = [&](bool offload, std::size_t first, std::size_t end) {
    std::vector<std::future<void>> running;
    for (std::size_t s = 0; s < o.sequences; ++s)
      running.push_back(asio::co_spawn(
          threads, decode(o, offload ? &cache : nullptr, seqs[s], s, first, end, data, done[s]), asio::use_future));
    for (auto& f : running) f.get();
  };
  const std::size_t middle = context + reference_steps(o), end = middle + offload_steps(o);
  out.reference = timed_phase(
      done, [&] { decode_all(false, context, middle); }, stored);
  for (const auto& seq : seqs) cache.insert_stored_tokens(seq);  // the catch-up, untimed
  store->flush();
  out.offload = timed_phase(
      done, [&] { decode_all(true, middle, end); }, stored);
  store->flush();
  const kv_store_stats st = store->stats();
  if (st.write_errors != 0 || st.dropped != 0 || st.evictions != 0)
    fail("decode_with_offload", "the file store dropped, failed or evicted entries");
  threads.join();
  return out;
}

/// The baseline's offloader: a queue of encoded entries and one thread
/// writing each as a file of `dir`.
class entry_writer {
 public:
  explicit entry_writer(std::filesystem::path dir) : dir_(std::move(dir)), thread_([this] { run(); }) {}
  entry_writer(const entry_writer&) = delete;
  entry_writer& operator=(const entry_writer&) = delete;
  ~entry_writer() {  // writes what is queued, then ends
    {
      const std::lock_guard lock(mutex_);
      closing_ = true;
    }
    ready_.notify_one();
    thread_.join();
  }
  void push(std::vector<std::byte> entry) {
    {
      const std::lock_guard lock(mutex_);
      queue_.push_back(std::move(entry));
    }
    ready_.notify_one();
  }
  std::pair<double, double> stored() const {
    return {double(files_.load(std::memory_order_acquire)), double(bytes_.load(std::memory_order_acquire))};
  }

 private:
  void run() {
    for (std::size_t n = 0;; ++n) {
      std::vector<std::byte> entry;
      {
        std::unique_lock lock(mutex_);
        ready_.wait(lock, [&] { return closing_ || !queue_.empty(); });
        if (queue_.empty()) return;
        entry = std::move(queue_.front());
        queue_.pop_front();
      }
      const std::uint64_t sum = XXH3_64bits(entry.data() + 96, entry.size() - entry_frame);
      std::memcpy(entry.data() + entry.size() - 8, &sum, 8);
      raw::write_file(dir_ / (std::to_string(n) + ".kvb"), entry.size(), entry, false);
      bytes_.fetch_add(entry.size(), std::memory_order_release);
      files_.fetch_add(1, std::memory_order_release);
    }
  }

  const std::filesystem::path dir_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::vector<std::byte>> queue_;
  bool closing_ = false;
  std::atomic<std::size_t> files_{0}, bytes_{0};
  std::thread thread_;  // last: starts once the rest is made
};

outcome run_locked(const options& o, const token_rows& prompt, const std::vector<token>& data, arena& memory) {
  const temp_dir dir("decode_with_offload");
  arena::resource resource(memory);
  const std::size_t width = o.config().token_width(), bt = o.block_tokens;
  const std::size_t half_block = bt * width * sizeof(float);  // a layer's keys (or values) of one block
  std::vector<std::vector<std::unique_ptr<rwlock_cache>>> seqs(o.sequences);
  for (auto& layers : seqs)
    for (std::size_t l = 0; l < o.layers; ++l) {
      layers.push_back(std::make_unique<rwlock_cache>(offload_config(o), &resource));
      layers.back()->initialize(1);
      for (std::size_t i = 0; i < context; ++i) layers.back()->write(i, prompt.keys_of(i, 1), prompt.values_of(i, 1));
    }
  outcome out;
  std::vector<progress> done(o.sequences);
  {
    entry_writer writer(dir.path);
    const auto offload = [&](std::size_t s, std::size_t block) {  // copied under each layer's shared lock
      std::vector<std::byte> entry(entry_frame + o.layers * 2 * half_block);
      for (std::size_t l = 0; l < o.layers; ++l)
        seqs[s][l]->visit_range(block * bt, (block + 1) * bt, [&](auto k, auto v) {
          std::memcpy(entry.data() + 96 + 2 * l * half_block, k.data(), half_block);
          std::memcpy(entry.data() + 96 + (2 * l + 1) * half_block, v.data(), half_block);
        });
      writer.push(std::move(entry));
    };
    // Each thread: round robin over its sequences, one step each.
    const auto decode_from = [&](std::size_t first_seq, bool offloading, std::size_t first, std::size_t end) {
      for (std::size_t step = first; step < end; ++step)
        for (std::size_t s = first_seq; s < o.sequences; s += o.threads) {
          const token& t = data[step % data.size()];
          for (auto& cache : seqs[s]) {
            cache->write(step, t.keys, t.values);
            attention a(o.heads, o.head_dim);
            cache->visit_range(0, step + 1, [&](auto k, auto v) { a.over(k, v); });
            keep(a.checksum());
          }
          if (offloading && (step + 1) % bt == 0) offload(s, step / bt);
          done[s].tick();
        }
    };
    const auto decode_all = [&](bool offloading, std::size_t first, std::size_t end) {
      std::vector<std::thread> workers;
      for (std::size_t t = 0; t < o.threads; ++t) workers.emplace_back(decode_from, t, offloading, first, end);
      for (auto& w : workers) w.join();
    };
    const std::size_t middle = context + reference_steps(o), end = middle + offload_steps(o);
    out.reference = timed_phase(
        done, [&] { decode_all(false, context, middle); }, [&] { return writer.stored(); });
    out.offload = timed_phase(
        done, [&] { decode_all(true, middle, end); }, [&] { return writer.stored(); });
  }  // the writer writes what is queued and ends
  return out;
}

}  // namespace

void decode_with_offload(const options& o, report& out) {
  const std::vector<token> data = tokens_for(o, 256);
  const token_rows prompt(o.config().token_width(), context);
  arena memory(arena_bytes(offload_config(o), o.sequences * o.layers));
  std::size_t runs = 0;
  out.run("decode_with_offload", o, [&](std::map<std::string, metric>& m) {
    metric& rate = declare(m, "1 steps", "decode steps, offloading blocks", "steps/s");
    metric& p50 = declare(m, "2 p50", "TPOT p50", "ns", false);
    metric& p99 = declare(m, "3 p99", "TPOT p99", "ns", false);
    metric& entries = declare(m, "4 entries", "blocks offloaded", "entries/s");
    metric& bytes = declare(m, "5 bytes", "offloaded to disk", "bytes/s");
    metric& ref_rate = declare(m, "6 ref steps", "reference: decode steps, no offload", "steps/s");
    metric& ref_p99 = declare(m, "7 ref p99", "reference: TPOT p99, no offload", "ns", false);
    const auto record = [&](const std::string& impl, outcome r) {
      rate.values[impl] = r.offload.steps_per_s;
      p50.values[impl] = r.offload.tpot.p(0.5);
      p99.values[impl] = r.offload.tpot.p(0.99);
      entries.values[impl] = r.offload.entries_per_s;
      bytes.values[impl] = r.offload.bytes_per_s;
      ref_rate.values[impl] = r.reference.steps_per_s;
      ref_p99.values[impl] = r.reference.tpot.p(0.99);
    };
    // First in turn, run by run: whichever runs second finds the memory the
    // other freed.
    const bool ghostlink_first = runs++ % 2 == 0;
    if (ghostlink_first && o.wants("ghostlink")) record("ghostlink", run_ghostlink(o, prompt, data, memory));
    if (o.wants("rwlock_zero_copy")) record("rwlock_zero_copy", run_locked(o, prompt, data, memory));
    if (!ghostlink_first && o.wants("ghostlink")) record("ghostlink", run_ghostlink(o, prompt, data, memory));
  });
  out.add_note(
      "decode_with_offload",
      std::to_string(o.layers) + " layers x " + std::to_string(o.sequences) + " sequences, 2048-token contexts, " +
          std::to_string(o.threads) + " decode threads; " + std::to_string(reference_steps(o)) +
          " steps a sequence without offload (reference), then " + std::to_string(offload_steps(o)) +
          " offloading every completed " + std::to_string(o.block_tokens) + "-token block (" +
          std::to_string(entry_frame + o.layers * 2 * o.block_tokens * o.config().token_width() * 4) +
          "-byte file) offloaded to a temporary directory, no fsync; both take their KV memory from one arena in turn. "
          "ghostlink: a preallocated pool, sequence steps, "
          "insert_stored_tokens into a prefix cache with a write-through kv_file_store (" +
          std::to_string(offload_threads) +
          " I/O thread); zero_copy: the block copied under each layer's shared lock, " +
          std::to_string(offload_threads) +
          " writer thread. Targets: ghostlink steps/s >= zero_copy's, p99 TPOT <= zero_copy's");
}

}  // namespace ghostlink::bench
