// Cancelling a sequence's append, truncate or fork: the slot reaches its one
// request to the sequence's actor. Before the actor takes it, nothing
// changes; once taken, every layer applies it in that drain and it
// completes normally. Every outcome leaves the sequence as one of the two
// states.
#include "common/sequence_support.hpp"

#include "common/asio_compat.hpp"

#include <future>
#include <optional>
#include <random>

namespace sequence_cancellation_tests {

using namespace ghostlink;
using namespace ghostlink::test::seq;

namespace {

constexpr auto aborted = asio::error::operation_aborted;
constexpr std::size_t n_layers = 3;

kv_cache_config seq_config() { return {.max_tokens_per_seq = 64, .num_heads = 2, .head_dim = 4, .block_tokens = 4}; }

/// Every layer's size, in order.
std::vector<std::size_t> layer_sizes(const sequence_kv_cache& s) {
  std::vector<std::size_t> sizes;
  for (std::size_t l = 0; l < s.num_layers(); ++l) sizes.push_back(s.layer(l).size());
  return sizes;
}

/// Appends `st` on an io_context the test thread runs.
ghostlink::error_code append_blocking(asio::io_context& io, sequence_kv_cache& s, const step& st) {
  std::optional<ghostlink::error_code> result;
  s.async_append(st.key_spans, st.value_spans, [&](ghostlink::error_code ec) { result = ec; });
  io.run();
  io.restart();
  REQUIRE(result.has_value());
  return *result;
}

/// Starts an append of `st` whose handler `signal` can cancel; its result
/// lands in `result`.
void start_append(sequence_kv_cache& s, const step& st, asio::cancellation_signal& signal,
                  std::optional<ghostlink::error_code>& result) {
  s.async_append(st.key_spans, st.value_spans,
                 asio::bind_cancellation_slot(signal.slot(), [&result](ghostlink::error_code ec) { result = ec; }));
}

}  // namespace

TEST_CASE("a sequence append cancelled before any layer applies it completes with operation_aborted and "
          "changes no layer",
          "[cancellation][sequence]") {
  asio::io_context io;
  sequence_kv_cache seq(io, n_layers, seq_config());
  const std::size_t width = seq.config().token_width();
  const step first(n_layers, width, 0, 1), cancelled(n_layers, width, 1, 2), next(n_layers, width, 1, 3);
  REQUIRE_FALSE(append_blocking(io, seq, first));

  asio::cancellation_signal signal;
  std::optional<ghostlink::error_code> result;
  start_append(seq, cancelled, signal, result);
  signal.emit(asio::cancellation_type::terminal);
  io.run();
  io.restart();

  REQUIRE(result.has_value());
  CHECK(*result == aborted);
  CHECK(seq.size() == 1);
  CHECK(layer_sizes(seq) == std::vector<std::size_t>(n_layers, 1));
  // The sequence is free again and the index unused.
  REQUIRE_FALSE(append_blocking(io, seq, next));
  CHECK(diff_snapshot(seq.snapshot(), {1, 3}).empty());
}

TEST_CASE("a sequence append cancelled once its actor took it completes normally: one drain applied every layer",
          "[cancellation][sequence]") {
  asio::io_context io;
  sequence_kv_cache seq(io, n_layers, seq_config());
  const std::size_t width = seq.config().token_width();
  const step st(n_layers, width, 0, 4);

  asio::cancellation_signal signal;
  std::optional<ghostlink::error_code> result;
  start_append(seq, st, signal, result);
  // One drain of the sequence's actor: every layer, and the token ids.
  REQUIRE(io.run_one() == 1);
  REQUIRE(layer_sizes(seq) == std::vector<std::size_t>(n_layers, 1));
  CHECK(seq.snapshot().token_ids() == std::vector<token_id>{no_token_id});
  signal.emit(asio::cancellation_type::terminal);
  io.run();

  REQUIRE(result.has_value());
  CHECK_FALSE(*result);
  CHECK(seq.size() == 1);
  CHECK(diff_snapshot(seq.snapshot(), {4}).empty());
}

TEST_CASE("a cancelled sequence truncate or fork before any layer applies it changes nothing",
          "[cancellation][sequence]") {
  asio::io_context io;
  sequence_kv_cache seq(io, n_layers, seq_config());
  const std::size_t width = seq.config().token_width();
  const step a(n_layers, width, 0, 1), b(n_layers, width, 1, 2);
  REQUIRE_FALSE(append_blocking(io, seq, a));
  REQUIRE_FALSE(append_blocking(io, seq, b));

  asio::cancellation_signal signal;
  std::optional<ghostlink::error_code> truncated;
  seq.async_truncate(1, asio::bind_cancellation_slot(signal.slot(), [&](ghostlink::error_code ec) { truncated = ec; }));
  signal.emit(asio::cancellation_type::terminal);
  io.run();
  io.restart();
  REQUIRE(truncated.has_value());
  CHECK(*truncated == aborted);
  CHECK(seq.size() == 2);
  CHECK(layer_sizes(seq) == std::vector<std::size_t>(n_layers, 2));

  std::optional<ghostlink::error_code> forked;
  sequence_kv_cache child;
  seq.async_fork(asio::bind_cancellation_slot(signal.slot(), [&](ghostlink::error_code ec, sequence_kv_cache c) {
    forked = ec;
    child = std::move(c);
  }));
  signal.emit(asio::cancellation_type::terminal);
  io.run();
  REQUIRE(forked.has_value());
  CHECK(*forked == aborted);
  CHECK_FALSE(child.valid());
  CHECK(diff_snapshot(seq.snapshot(), {1, 2}).empty());
}

TEST_CASE("sequence appends cancelled at random from another thread apply on every layer or on none",
          "[cancellation][sequence][concurrency]") {
  asio::thread_pool pool(2);
  sequence_kv_cache seq(pool, n_layers, seq_config());
  const std::size_t width = seq.config().token_width();
  // The handler and its cancellation run on one strand, as Asio requires.
  auto strand = asio::make_strand(pool);
  std::mt19937 rng(11);
  std::vector<int> tags;  // of the appends that completed successfully
  std::size_t aborted_count = 0;
  for (int attempt = 0; attempt < 300 && tags.size() < seq.config().max_tokens_per_seq; ++attempt) {
    const step st(n_layers, width, tags.size(), attempt % 10);
    asio::cancellation_signal signal;
    std::promise<ghostlink::error_code> done;
    std::atomic<bool> finished{false};
    seq.async_append(
        st.key_spans, st.value_spans,
        asio::bind_executor(strand, asio::bind_cancellation_slot(signal.slot(), [&](ghostlink::error_code ec) {
                              finished = true;
                              done.set_value(ec);
                            })));
    if (rng() % 2)
      asio::post(strand, [&] {
        if (!finished) signal.emit(asio::cancellation_type::terminal);
      });
    const ghostlink::error_code ec = done.get_future().get();
    // The posted emission (if any) must run before `signal` dies.
    std::promise<void> strand_idle;
    asio::post(strand, [&] { strand_idle.set_value(); });
    strand_idle.get_future().wait();

    INFO("attempt " << attempt << ": " << ec.message());
    REQUIRE((!ec || ec == aborted));
    if (!ec)
      tags.push_back(attempt % 10);
    else
      ++aborted_count;
    REQUIRE(seq.size() == tags.size());
    REQUIRE(diff_snapshot(seq.snapshot(), tags).empty());
    // Layers that applied a cancelled append have undone it.
    REQUIRE(layer_sizes(seq) == std::vector<std::size_t>(n_layers, tags.size()));
  }
  INFO(tags.size() << " appended, " << aborted_count << " aborted");
  CHECK(tags.size() + aborted_count > 0);
  pool.join();
}

}  // namespace sequence_cancellation_tests
