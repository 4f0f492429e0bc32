// The tiny decoder (examples/tiny_llama.hpp, serving_loop's model) with its
// KV cache stored as q8_0, fp8_e4m3 and q4_0, against a float cache on the
// same prompts: the greedy tokens that agree and the largest logit
// difference, asserted so that a regression in a quantizer or in attend's
// reading of a quantized block fails here.
//
// Each quantized run is fed the float run's tokens (teacher forcing), so
// that every position compares the same context: a position agrees when
// its greedy token is the float cache's. The bounds below are what this
// model measured with margin (docs/PERFORMANCE.md, "KV in 8 and 4 bits",
// has the figures); a float cache against itself must agree exactly.

#include "common/sequence_support.hpp"

#include "../examples/tiny_llama.hpp"

#include "common/asio_compat.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace quantized_decoder_tests {

using namespace ghostlink;

namespace {

constexpr std::size_t prompts = 3, prompt_tokens = 24, decode_tokens = 24;

/// What one cache type's run showed against the float run's.
struct agreement {
  std::size_t positions = 0, agreeing = 0;
  double worst_logit = 0;  // the largest |logit - float's logit|
  double fraction() const { return double(agreeing) / double(positions); }
};

/// Every position's logits of `tokens` (a prompt then its decode), fed as
/// one prefill step and then one step a token, through a `T` cache.
template <storage_element T>
std::vector<std::vector<float>> run(asio::thread_pool& threads, const tiny_llama::model& m,
                                    const std::vector<std::int32_t>& tokens) {
  const tiny_llama::dims& d = m.shape();
  const kv_cache_config config{.max_tokens_per_seq = prompt_tokens + decode_tokens,
                               .num_heads = d.kv_heads,
                               .head_dim = d.head_dim,
                               .block_tokens = 8};
  const basic_sequence_kv_cache<T> seq(threads, kv_model_layout::full(d.layers), config);
  std::vector<std::vector<float>> logits =
      test::run(threads.get_executor(),
                tiny_llama::forward(m, seq, std::vector<std::int32_t>(tokens.begin(), tokens.begin() + prompt_tokens)));
  for (std::size_t p = prompt_tokens; p < tokens.size(); ++p) {
    auto rows = test::run(threads.get_executor(), tiny_llama::forward(m, seq, std::vector<std::int32_t>(1, tokens[p])));
    logits.push_back(std::move(rows.front()));
  }
  return logits;
}

/// The float cache's greedy decode of prompt `i`: its tokens.
std::vector<std::int32_t> float_tokens(asio::thread_pool& threads, const tiny_llama::model& m, std::size_t i) {
  std::vector<std::int32_t> tokens(prompt_tokens);
  for (std::size_t t = 0; t < prompt_tokens; ++t)
    tokens[t] = static_cast<std::int32_t>((i * 131 + t * 29 + 7) % m.shape().vocab);
  const tiny_llama::dims& d = m.shape();
  const kv_cache_config config{.max_tokens_per_seq = prompt_tokens + decode_tokens,
                               .num_heads = d.kv_heads,
                               .head_dim = d.head_dim,
                               .block_tokens = 8};
  const sequence_kv_cache seq(threads, kv_model_layout::full(d.layers), config);
  auto rows = test::run(threads.get_executor(), tiny_llama::forward(m, seq, tokens));
  for (std::size_t t = 0; t + 1 < decode_tokens; ++t) {
    tokens.push_back(tiny_llama::greedy(rows.back()));
    rows = test::run(threads.get_executor(), tiny_llama::forward(m, seq, std::vector<std::int32_t>(1, tokens.back())));
  }
  tokens.push_back(tiny_llama::greedy(rows.back()));
  return tokens;
}

/// Type `T`'s run against the float run over every prompt.
template <storage_element T>
agreement compare(asio::thread_pool& threads, const tiny_llama::model& m) {
  agreement a;
  for (std::size_t i = 0; i < prompts; ++i) {
    std::vector<std::int32_t> tokens = float_tokens(threads, m, i);
    const std::int32_t last = tokens.back();
    tokens.pop_back();  // the logits of every token but the last decoded
    const auto expected = run<float>(threads, m, tokens), got = run<T>(threads, m, tokens);
    REQUIRE(expected.size() == got.size());
    REQUIRE(tiny_llama::greedy(expected.back()) == last);
    for (std::size_t p = prompt_tokens - 1; p < expected.size(); ++p) {  // the decoded positions
      ++a.positions;
      a.agreeing += tiny_llama::greedy(expected[p]) == tiny_llama::greedy(got[p]) ? 1 : 0;
      for (std::size_t v = 0; v < expected[p].size(); ++v)
        a.worst_logit = std::max(a.worst_logit, std::abs(double(expected[p][v]) - got[p][v]));
    }
  }
  return a;
}

}  // namespace

TEST_CASE("a quantized KV cache decodes the tiny model's greedy tokens as a float cache does, within bounds",
          "[quantized][decoder]") {
  asio::thread_pool threads(2);
  const tiny_llama::model m(tiny_llama::dims{});
  const agreement same = compare<float>(threads, m);
  const agreement q8 = compare<q8_0>(threads, m);
  const agreement fp8 = compare<fp8_e4m3>(threads, m);
  const agreement q4 = compare<q4_0>(threads, m);
  threads.join();
  INFO("q8_0: " << q8.agreeing << "/" << q8.positions << " agree, largest logit difference " << q8.worst_logit);
  INFO("fp8_e4m3: " << fp8.agreeing << "/" << fp8.positions << ", " << fp8.worst_logit);
  INFO("q4_0: " << q4.agreeing << "/" << q4.positions << ", " << q4.worst_logit);
  // The float cache against itself: the same arithmetic, the same tokens.
  CHECK(same.agreeing == same.positions);
  CHECK(same.worst_logit == 0.0);
  // The quantized caches, against it.
  CHECK(q8.fraction() >= 0.95);
  CHECK(q8.worst_logit <= 0.05);
  CHECK(fp8.fraction() >= 0.85);
  CHECK(fp8.worst_logit <= 0.5);
  CHECK(q4.fraction() >= 0.6);
  CHECK(q4.worst_logit <= 1.0);
  // More bits, closer: the ordering the formats promise.
  CHECK(q8.worst_logit <= fp8.worst_logit);
  CHECK(q8.worst_logit <= q4.worst_logit);
}

}  // namespace quantized_decoder_tests
