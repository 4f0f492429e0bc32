// The seed's tests (seed/kv_cache.rs), ported one for one. Each keeps the
// seed's name and asserts at least what the seed asserted, plus the exact
// error code where the seed only checked is_err().
#include "common/support.hpp"

#include <sstream>
#include <thread>

namespace seed_parity_tests {

using namespace ghostlink;
using ghostlink::test::blocking;
using ghostlink::test::filled;

using fixture = ghostlink::test::cache_fixture;

TEST_CASE("initialize_rejects_zero_len", "[seed]") {
  asio::thread_pool pool{2};
  layer_kv_cache cache(pool);  // the seed's default config
  CHECK(blocking{cache}.initialize(0) == kv_errc::zero_length);
  CHECK(cache.size() == 0);
}

TEST_CASE("initialize_and_round_trip", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(8));
  CHECK(f.cache.size() == 8);
  const auto keys = filled(f.width, 1.0f), values = filled(f.width, 2.0f);
  REQUIRE_FALSE(f.sync.write(2, keys, values));
  auto [ec, entry] = f.sync.read_kv(2);
  REQUIRE_FALSE(ec);
  CHECK(entry.keys == keys);
  CHECK(entry.values == values);
}

TEST_CASE("growing_seq_len_preserves_prior_writes", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(4));
  const auto keys = filled(f.width, 7.0f), values = filled(f.width, 9.0f);
  REQUIRE_FALSE(f.sync.write(1, keys, values));
  REQUIRE_FALSE(f.sync.initialize(10));
  CHECK(f.cache.size() == 10);
  auto [ec, entry] = f.sync.read_kv(1);
  REQUIRE_FALSE(ec);
  CHECK(entry.keys == keys);
  CHECK(entry.values == values);
}

TEST_CASE("write_kv_rejects_wrong_width", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(4));
  const auto wrong = filled(f.width + 1, 0.0f);
  CHECK(f.sync.write(0, wrong, wrong) == kv_errc::width_mismatch);
}

TEST_CASE("write_kv_rejects_out_of_bounds_token", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(4));
  const auto data = filled(f.width, 0.0f);
  CHECK(f.sync.write(999, data, data) == kv_errc::index_out_of_range);
}

TEST_CASE("write_kv_before_initialize_is_rejected", "[seed]") {
  fixture f;
  const auto data = filled(f.width, 0.0f);
  CHECK(f.sync.write(0, data, data) == kv_errc::not_initialized);
  CHECK(f.cache.size() == 0);
}

TEST_CASE("read_range_returns_contiguous_data", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(4));
  for (std::size_t t = 0; t < 4; ++t)
    REQUIRE_FALSE(f.sync.write(t, filled(f.width, float(t)), filled(f.width, float(t * 10))));
  auto [ec, range] = f.sync.read_range(1, 3);
  REQUIRE_FALSE(ec);
  REQUIRE(range.keys.size() == 2 * f.width);
  REQUIRE(range.values.size() == 2 * f.width);
  CHECK(range.keys[0] == 1.0f);
  CHECK(range.values[0] == 10.0f);
  CHECK(range.keys[f.width] == 2.0f);
  CHECK(range.values[f.width] == 20.0f);
}

TEST_CASE("read_range_rejects_end_beyond_current_len", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(4));
  CHECK(f.sync.read_range(0, 100).first == kv_errc::range_out_of_bounds);
}

TEST_CASE("is_empty_and_len_track_initialization", "[seed]") {
  fixture f;
  CHECK(f.cache.empty());
  REQUIRE_FALSE(f.sync.initialize(5));
  CHECK_FALSE(f.cache.empty());
  CHECK(f.cache.size() == 5);
}

TEST_CASE("concurrent_reads_do_not_corrupt_or_deadlock", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(8));
  for (std::size_t t = 0; t < 8; ++t)
    REQUIRE_FALSE(f.sync.write(t, filled(f.width, float(t)), filled(f.width, float(t))));

  // Eight threads read every token; each reports the tokens that were wrong.
  std::vector<std::thread> readers;
  std::vector<std::size_t> wrong(8, 0);
  for (std::size_t r = 0; r < 8; ++r)
    readers.emplace_back([&, r] {
      for (std::size_t t = 0; t < 8; ++t) {
        auto [ec, entry] = f.sync.read_kv(t);
        if (ec || entry.keys.empty() || entry.keys[0] != float(t)) ++wrong[r];
      }
    });
  for (auto& t : readers) t.join();
  for (std::size_t r = 0; r < 8; ++r) {
    INFO("reader " << r);
    CHECK(wrong[r] == 0);
  }
}

TEST_CASE("clone_shares_the_same_underlying_cache", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(4));
  const auto data = filled(f.width, 3.0f);
  layer_kv_cache clone = f.cache;
  REQUIRE_FALSE(blocking{clone}.write(0, data, data));
  CHECK(f.sync.read_kv(0).second.keys == data);
}

TEST_CASE("write_kv_batch_multiple", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(8));
  const auto k0 = filled(f.width, 0.0f), v0 = filled(f.width, 0.0f);
  const auto k1 = filled(f.width, 1.0f), v1 = filled(f.width, 10.0f);
  const kv_write entries[] = {{0, k0, v0}, {1, k1, v1}};
  REQUIRE_FALSE(f.sync.write_batch(entries));
  CHECK(f.sync.read_kv(0).second.keys[0] == 0.0f);
  CHECK(f.sync.read_kv(1).second.values[0] == 10.0f);
}

TEST_CASE("write_kv_batch_empty", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(4));
  CHECK_FALSE(f.sync.write_batch({}));
}

TEST_CASE("write_kv_batch_validation_fails", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(4));
  const auto k0 = filled(f.width, 1.0f), v0 = filled(f.width, 2.0f), bad = filled(f.width + 1, 0.0f);
  const kv_write entries[] = {{0, k0, v0}, {1, bad, v0}};
  CHECK(f.sync.write_batch(entries) == kv_errc::length_mismatch);
}

TEST_CASE("write_kv_batch_is_atomic_on_validation_failure", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(4));
  const auto good = filled(f.width, 5.0f), bad = filled(f.width + 1, 0.0f);
  const kv_write entries[] = {{0, good, good}, {1, bad, good}};
  CHECK(f.sync.write_batch(entries));
  CHECK(f.sync.read_kv(0).second.keys == filled(f.width, 0.0f));
}

TEST_CASE("debug_output_shows_config_and_length_not_buffers", "[seed]") {
  fixture f;
  REQUIRE_FALSE(f.sync.initialize(3));
  REQUIRE_FALSE(f.sync.write(0, filled(f.width, 42.5f), filled(f.width, 42.5f)));
  std::ostringstream os;
  os << f.cache;
  const std::string text = os.str();
  INFO(text);
  CHECK(text.find("max_tokens_per_seq=16") != std::string::npos);
  CHECK(text.find("num_heads=2") != std::string::npos);
  CHECK(text.find("head_dim=4") != std::string::npos);
  CHECK(text.find("size=3") != std::string::npos);
  CHECK(text.find("42.5") == std::string::npos);
}

}  // namespace seed_parity_tests
