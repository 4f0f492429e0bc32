// libFuzzer target: decodes the input into a sequence of ghostlink API calls
// with arbitrary (also invalid) arguments, runs them on one single-threaded
// io_context, and checks every result, every token read, every held
// snapshot and every counter against a model (model.hpp). A mismatch prints
// what differed and aborts, so libFuzzer records the input.
//
// Input layout: 7 bytes of configuration (element type and fp8 scales,
// token width, block tokens and mailbox bound, max tokens, pool budget, what
// the run starts with), then operations, one opcode byte each followed by
// its arguments.
// Running out of input reads zeros, so every input is valid.

#include "layer_ops.hpp"
#include "prefix_ops.hpp"
#include "sequence_ops.hpp"
#include "snapshot_ops.hpp"
#include "world.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

namespace ghostlink::fuzz {
namespace {

enum op : std::uint8_t {
  // 0-7: one layer request of that req_kind.
  op_burst = static_cast<std::uint8_t>(req_kind::count),
  op_coroutine,
  op_snapshot_read,
  op_snapshot_reshape,
  op_release,
  op_drop_cache,
  op_new_cache,
  op_bad_config,
  op_trim,
  op_seq,
  op_seq_double,
  op_seq_snapshot,
  op_seq_step,
  op_seq_drop,
  op_new_seq,
  op_refuse_memory,
  op_abandon,
  op_prefix,
  op_count
};

/// Variant `v` (0-7) of a config whose element type decides whether it is
/// valid: a group type's head_dim (a multiple of 32), or a key or value
/// scale (1 for every type but fp8, whose scales must be finite, positive
/// and at most 1e30). Returns whether `c` is now invalid.
template <class T>
bool element_config(kv_cache_config& c, unsigned v) {
  constexpr float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  if constexpr (std::is_same_v<T, fp8_e4m3>) {
    switch (v) {
      case 0: c.key_scale = nan; return true;
      case 1: c.value_scale = 0.0f; return true;
      case 2: c.key_scale = -0.0f; return true;
      case 3: c.value_scale = -3.75f; return true;
      case 4: c.key_scale = inf; return true;
      case 5: c.value_scale = std::nextafter(1e30f, inf); return true;
      case 6:
        c.key_scale = 1e30f;
        c.value_scale = std::numeric_limits<float>::denorm_min();
        return false;
      default:
        c.key_scale = std::numeric_limits<float>::min();
        c.value_scale = 448.0f;
        return false;
    }
  } else {
    constexpr bool group = elements_per<T> != 1;
    switch (v) {
      case 0: c.key_scale = 0.5f; return true;
      case 1: c.value_scale = 3.75f; return true;
      case 2: c.key_scale = nan; return true;
      case 3: c.value_scale = 0.0f; return true;
      case 4: c.key_scale = -1.0f; return true;
      case 5:
        if (group)
          c.head_dim = 16;
        else
          c.key_scale = inf;
        return true;
      case 6:
        if (group)
          c.head_dim += 16;
        else
          c.value_scale = 1.0f / 64;
        return true;
      default: c.head_dim = group ? 96 : 3; return false;
    }
  }
}

/// Constructs something ghostlink must refuse with invalid_config (or, in
/// the last case and some of case 6's, accept), then lets it go.
template <class T>
void bad_config(world<T>& w) {
  const std::uint8_t b = w.in.byte();
  current_trace().add("bad_config", b % 9);
  constexpr std::size_t top = std::numeric_limits<std::size_t>::max();
  kv_cache_config c = w.geometry;
  const std::size_t bytes = kv_block_pool::block_bytes_for<T>(c);
  bool want_invalid = true;
  auto attempt = [&](auto make) {
    try {
      make();
    } catch (const std::system_error& e) {
      if (e.code() != kv_errc::invalid_config) fail(str("bad_config ", b % 9, " ", c, ": threw ", ec_name(e.code())));
      if (!want_invalid) fail(str("bad_config ", b % 9, " ", c, ": a valid config was refused"));
      return;
    }
    if (want_invalid) fail(str("bad_config ", b % 9, " ", c, ": an invalid config was accepted"));
  };
  auto private_cache = [&] { basic_layer_kv_cache<T>(w.io, c); };
  auto on_pool = [&] { basic_layer_kv_cache<T>(w.io, c, w.pools[0]); };
  switch (b % 9) {
    case 0: {
      std::size_t* fields[] = {&c.max_tokens_per_seq, &c.num_heads,  &c.head_dim,
                               &c.block_tokens,       &c.max_blocks, &c.max_pending};
      *fields[b / 9 % 6] = 0;
      if (b & 0x80)
        attempt([&] { basic_sequence_kv_cache<T>(w.io, 1, c); });
      else
        attempt(private_cache);
      break;
    }
    case 1:
      c.max_blocks = 1 + b % 7;
      attempt(on_pool);
      break;  // a cache on a pool must leave the budget to it
    case 2:
      c.block_tokens += 1;
      attempt(on_pool);
      break;       // blocks of another size
    case 3:
      if (b & 0x80) {
        // A layout the contract refuses: sinks without a window, a window
        // whose rollback overflows, or no layers.
        kv_model_layout bad = kv_model_layout::sliding(1 + b / 9 % 3, 1 + b / 27 % 4, 1);
        if (b / 9 % 3 == 0) bad.layers.back() = {.window = 0, .sink_tokens = 1};
        if (b / 9 % 3 == 1) bad.rollback_tokens = top;
        if (b / 9 % 3 == 2) bad.layers.clear();
        attempt([&] { basic_sequence_kv_cache<T>(w.io, bad, c, w.pools[0]); });
      } else {
        attempt([&] { basic_sequence_kv_cache<T>(w.io, 0, c, w.pools[0]); });
      }
      break;
    case 4: attempt([&] { kv_block_pool(b & 1 ? bytes + 1 : 0); }); break;
    case 5:
      attempt([&] { kv_block_pool(bytes, b & 1 ? kv_pool_limits{0, top} : kv_pool_limits{top, bytes - 1}); });
      break;
    case 6:
      if (b & 0x80) {
        // The element type's own rules, checked by a private cache, a
        // sequence on a private pool, or a pool for it.
        const unsigned v = b / 9 % 8, how = b / 72 % 3;
        current_trace().add("  element_config", v, how);
        want_invalid = element_config<T>(c, v);
        c.max_blocks = 2;
        // Few tokens: a wider head must not overflow a huge max_tokens_per_seq.
        c.max_tokens_per_seq = std::min<std::size_t>(c.max_tokens_per_seq, 64);
        if (how == 0)
          attempt(private_cache);
        else if (how == 1)
          attempt([&] { basic_sequence_kv_cache<T>(w.io, 1, c); });
        else
          attempt([&] { (void)kv_block_pool::for_caches<T>(c); });
      } else {
        c.num_heads = top, c.head_dim = 2;
        attempt(private_cache);
      }
      break;
    case 7:
      c.max_tokens_per_seq = top / c.token_width() + 1;
      attempt(private_cache);
      break;
    default:
      want_invalid = false;
      c.max_blocks = 1 + b % 5;
      attempt(private_cache);
      attempt([&] { basic_sequence_kv_cache<T>(w.io, 1 + b % 3, w.geometry, w.pools[0]); });
      break;
  }
}

template <class T>
void step(world<T>& w) {
  const std::uint8_t code = w.in.byte() % op_count;
  const bool needs_cache = code <= op_coroutine || code == op_drop_cache || code == op_abandon;
  const bool needs_snap = code >= op_snapshot_read && code <= op_release;
  const bool needs_seq = code >= op_seq && code <= op_seq_drop;
  if ((needs_cache && w.caches.empty()) || (needs_snap && w.snaps.empty() && w.seq_snaps.empty()) ||
      (needs_seq && w.seqs.empty()))
    return;
  const std::size_t k = w.in.byte();
  const std::size_t cache = w.caches.empty() ? 0 : k % w.caches.size();
  const std::size_t seq = w.seqs.empty() ? 0 : k % w.seqs.size();
  const std::size_t size = w.caches.empty() ? 0 : w.caches[cache].m->current->length;

  if (code < op_burst) {
    run_requests(w, cache, {decode_req(w, static_cast<req_kind>(code), size)});
    return;
  }
  switch (code) {
    case op_burst: run_requests(w, cache, decode_burst(w, size)); break;
    case op_abandon: abandon_requests(w, cache, decode_burst(w, size)); break;
    case op_coroutine: {
      const std::uint8_t b = w.in.byte();
      run_requests(w, cache, {decode_req(w, b & 1 ? req_kind::fork : req_kind::batch, size)},
                   b & 2 ? started_by::coroutine_plain : started_by::coroutine_tuple);
      break;
    }
    case op_snapshot_read:
      if (!w.snaps.empty()) snapshot_read(w, k % w.snaps.size());
      break;
    case op_snapshot_reshape:
      if (!w.snaps.empty()) snapshot_reshape(w, k % w.snaps.size());
      break;
    case op_release:
      current_trace().add("release", k);
      if (k & 1 && !w.seq_snaps.empty())
        w.seq_snaps.erase(w.seq_snaps.begin() + static_cast<std::ptrdiff_t>(k / 2 % w.seq_snaps.size()));
      else if (!w.snaps.empty())
        w.snaps.erase(w.snaps.begin() + static_cast<std::ptrdiff_t>(k / 2 % w.snaps.size()));
      break;
    case op_drop_cache:
      current_trace().add("drop_cache", cache);
      w.caches.erase(w.caches.begin() + static_cast<std::ptrdiff_t>(cache));
      break;
    case op_new_cache:
      current_trace().add("new_cache", k & 1, 1 + k / 2 % 12);
      w.new_cache(k & 1, 1 + k / 2 % 12);
      break;
    case op_bad_config: bad_config(w); break;
    case op_trim: {
      const std::size_t i = k % w.pools.size();
      current_trace().add("trim", i);
      w.pools[i].trim();
      expect_eq(detail::census(w.pools[i]).unused, std::size_t{0}, "unused extents after trim()");
      break;
    }
    case op_seq:
    case op_seq_double: run_seq(w, seq, code == op_seq_double); break;
    case op_seq_snapshot:
      current_trace().add("seq_snapshot", seq);
      hold_seq_snapshot(w, seq);
      break;
    case op_seq_step: run_step(w, seq); break;
    case op_seq_drop:
      current_trace().add("seq_drop", seq);
      w.seqs.erase(w.seqs.begin() + static_cast<std::ptrdiff_t>(seq));
      break;
    case op_new_seq: {
      const kv_model_layout layout = w.pick_layout(1 + k % 3);
      current_trace().add("new_seq", 1 + k % 3, k >> 7 & 1, layout.windowed() ? layout.layers[0].window : 0);
      w.new_sequence(layout, k >> 7 & 1, 1 + k / 4 % 12);
      break;
    }
    case op_prefix: prefix_op(w, seq); break;
    case op_refuse_memory: {
      // The pool's fault hook: its next n requests for block memory fail as
      // if the system had none (a write then fails with capacity_exhausted).
      const std::size_t i = k % w.pools.size(), n = w.in.byte() % 4;
      current_trace().add("refuse_memory", i, n);
      ghostlink::detail::fail_next_allocations(w.pools[i], n);
      w.m.pools[i].refuse = n;
      break;
    }
    default: break;
  }
}

/// The model's state in one line (GHOSTLINK_FUZZ_VERBOSE).
template <class T>
void print_state(world<T>& w) {
  std::string line = "  caches (length/stored):";
  for (const auto& c : w.caches) line += str(' ', c.m->length, '/', c.m->stored);
  line += "  sequences:";
  for (const auto& s : w.seqs) line += str(' ', s.m->length);
  line += str("  snapshots: ", w.snaps.size(), '+', w.seq_snaps.size(), "  pools (in use/max):");
  for (std::size_t i = 0; i < w.pools.size(); ++i) line += str(' ', w.m.in_use(i), '/', w.m.pools[i].max);
  std::fprintf(stderr, "%s\n", line.c_str());
}

template <class T>
void run(input& in, const std::uint8_t (&head)[7]) {
  kv_cache_config geometry;
  constexpr bool group = elements_per<T> != 1;
  geometry.num_heads = 1 + head[1] % 2;
  // A group type's heads are whole groups of 32.
  geometry.head_dim = group ? 32 * (1 + head[1] / 2 % 2) : 1 + head[1] / 2 % 3;
  if constexpr (std::is_same_v<T, fp8_e4m3>) {
    // head[0] % 6 picked the type; the rest picks the scales.
    constexpr float scales[] = {1.0f, 0.5f, 3.75f, 1.0f / 64};
    geometry.key_scale = scales[head[0] / 6 % 4];
    geometry.value_scale = scales[head[0] / 24 % 4];
  }
  geometry.block_tokens = 1 + head[2] % 5;
  // Half the inputs bound the mailbox to 1-4 requests: bursts then wait
  // for room (backpressure).
  if (head[2] / 5 % 8 < 4) geometry.max_pending = 1 + head[2] / 5 % 8;
  // One input in 16 has a huge max_tokens_per_seq (edges of the index
  // arithmetic and the page table's bound); the others 1..40.
  const bool huge = head[3] >= 0xf0;
  const std::size_t huge_max[] = {std::size_t{1} << 40,
                                  std::numeric_limits<std::size_t>::max() / geometry.token_width(),
                                  (std::size_t{1} << 36) + 3};
  geometry.max_tokens_per_seq = huge ? huge_max[head[3] % 3] : 1 + head[3] % 40;
  const std::size_t budget = head[4] >= 0xf8 ? std::numeric_limits<std::size_t>::max() : 1 + head[4] % 16;
  const std::size_t bytes = kv_block_pool::block_bytes_for<T>(geometry);
  kv_pool_limits limits{budget, std::numeric_limits<std::size_t>::max()};
  if (head[5] >= 0xc0) limits.max_bytes = head[5] % 8 * bytes + head[5] / 8 % bytes;
  const std::size_t effective = std::min(limits.max_blocks, limits.max_bytes / bytes);

  trace& t = current_trace();
  t = {};
  t.config = str(type_name<T>(), ' ', geometry, " pool budget=", effective, " start=", int(head[6]));
  if (trace::verbose()) std::fprintf(stderr, "config: %s\n", t.config.c_str());

  asio::io_context io;
  {
    world<T> w(io, in, geometry, huge);
    if (effective == 0) {
      // Limits that allow no block are refused; go on with the block budget.
      try {
        (void)kv_block_pool::for_caches<T>(geometry, limits);
        fail("a pool whose limits allow no block was made");
      } catch (const std::system_error& e) {
        expect_ec(e.code(), kv_errc::invalid_config, "pool limits allowing no block");
      }
      limits.max_bytes = std::numeric_limits<std::size_t>::max();
    }
    // The smaller limit applies (an unlimited block count still has a byte bound).
    w.adopt_pool(kv_block_pool::for_caches<T>(geometry, limits), std::min(limits.max_blocks, limits.max_bytes / bytes));
    // Pool 0's prefix cache, for sequences of 1-3 layers (the others'
    // inserts must fail).
    w.m.prefix_layers = 1 + head[6] / 64 % 3;
    // Its layout (head[2] / 40): full layers, or windows (with sinks) on
    // every other layer or on every layer.
    const std::size_t n = w.m.prefix_layers;
    switch (head[2] / 40) {
      case 2: w.m.prefix_layout = kv_model_layout::interleaved(n, 2, 3); break;
      case 3: w.m.prefix_layout = kv_model_layout::interleaved(n, 2, 5, 1); break;
      case 4: w.m.prefix_layout = kv_model_layout::sliding(n, 4); break;
      case 5: w.m.prefix_layout = kv_model_layout::sliding(n, 2, 2); break;
      default: w.m.prefix_layout = kv_model_layout::full(n); break;
    }
    t.config += str(" prefix layout ", w.m.prefix_layout);
    w.prefix.emplace(w.m.prefix_layout, geometry, w.pools[0]);
    clock_ms() = w.m.now_ms;  // the retention clock is the model's
    ghostlink::detail::set_retention_clock(&model_now);
    w.new_cache(head[6] & 1, 1 + (head[6] >> 1) % 16);
    if (head[6] & 0x20)
      w.new_sequence(kv_model_layout::full(1 + (head[6] >> 6) % 3), head[6] & 0x10, 1 + (head[6] >> 1) % 16);
    w.check_all();
    for (int n = 0; n < 400 && in.more() && !w.abandoned; ++n) {
      step(w);
      w.check_all();
      if (trace::verbose()) print_state(w);
    }
    // Everything goes; then every pool must count no block in use (after an
    // abandon, only once the io_context is gone: LLVMFuzzerTestOneInput
    // checks that no pool is left).
    w.snaps.clear();
    w.seq_snaps.clear();
    w.caches.clear();
    w.seqs.clear();
    if (w.abandoned) return;
    w.run_to_completion([] { return true; }, "teardown");
    expect_eq(w.prefix->stats().idle_blocks, w.m.entries.size(), "prefix cache: every entry idle at the end");
    w.prefix->clear();
    w.m.entries.clear();
    for (std::size_t i = 0; i < w.pools.size(); ++i) {
      expect_eq(w.m.in_use(i), std::size_t{0}, str("model: pool ", i, " in use at the end"));
      expect_eq(w.pools[i].stats().blocks_in_use, std::size_t{0}, str("pool ", i, ": blocks_in_use at the end"));
    }
  }
}

}  // namespace
}  // namespace ghostlink::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace ghostlink::fuzz;
  const std::size_t alive = ghostlink::detail::pools_alive(),
                    unbalanced = ghostlink::detail::pools_destroyed_unbalanced();
  input in(data, size);
  std::uint8_t head[7];
  for (std::uint8_t& b : head) b = in.byte();
  try {
    switch (head[0] % 6) {
      case 0: run<float>(in, head); break;
      case 1: run<ghostlink::half>(in, head); break;
      case 2: run<ghostlink::bfloat16>(in, head); break;
      case 3: run<ghostlink::q8_0>(in, head); break;
      case 4: run<ghostlink::q4_0>(in, head); break;
      default: run<ghostlink::fp8_e4m3>(in, head); break;
    }
  } catch (const std::exception& e) {
    fail(str("unexpected exception: ", e.what()));
  }
  // Every block holds its pool: none left alive means nothing leaked.
  expect_eq(ghostlink::detail::pools_alive(), alive, "block pools alive after the run");
  expect_eq(ghostlink::detail::pools_destroyed_unbalanced(), unbalanced, "pools destroyed with blocks counted in use");
  return 0;
}
