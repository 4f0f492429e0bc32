// Saving and loading sequences (persist.hpp): round trips bit for bit in
// every element type, one layer read alone, every refusal (with nothing
// made and no block taken), the atomic replacement of a file, snapshot
// isolation under a concurrent writer, where the I/O and the handlers run,
// and cancellation.
#include "common/files.hpp"
#include "common/sequence_support.hpp"
#include "io/checksum.hpp"

#include <fcntl.h>
#include <signal.h>  // NOLINT(modernize-deprecated-headers): POSIX sigaction
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace persist_tests {

using namespace ghostlink;
namespace fs = std::filesystem;
using ghostlink::test::wait_ec;
using ghostlink::test::seq::str;

namespace {

using ghostlink::test::read_file;
using ghostlink::test::temp_dir;
using ghostlink::test::write_file;

std::uint64_t u64_at(const std::vector<std::byte>& bytes, std::size_t at) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < 8; ++i) v |= std::uint64_t{std::to_integer<unsigned>(bytes[at + i])} << (8 * i);
  return v;
}
std::uint32_t u32_at(const std::vector<std::byte>& bytes, std::size_t at) {
  return static_cast<std::uint32_t>(u64_at(bytes, at) & 0xffff'ffffu);
}
void put_u32(std::vector<std::byte>& bytes, std::size_t at, std::uint32_t v) {
  for (std::size_t i = 0; i < 4; ++i) bytes[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xffu);
}
void put_u64(std::vector<std::byte>& bytes, std::size_t at, std::uint64_t v) {
  for (std::size_t i = 0; i < 8; ++i) bytes[at + i] = static_cast<std::byte>((v >> (8 * i)) & 0xffu);
}
std::uint64_t round_up(std::uint64_t n, std::uint64_t to) { return (n + to - 1) / to * to; }

/// The format version 1 file of what the version 2 or 3 file `v2` (of a
/// full layout) holds: the same header (version 1, its offsets and length
/// moved), token ids and layers, without the layout section, each
/// checksum made again (docs/FORMAT.md, version 1).
std::vector<std::byte> as_version_1(const std::vector<std::byte>& v2) {
  const std::size_t header_bytes = u32_at(v2, 12), num_layers = u64_at(v2, 24), tokens = u64_at(v2, 56);
  const std::uint64_t tokens_at = u64_at(v2, 64), table_at = u64_at(v2, 72);
  const std::uint64_t tokens_end = tokens_at + 4 * tokens + 8;
  const std::uint64_t table_v1 = round_up(tokens_end, 8), first_v1 = round_up(table_v1 + 24 * num_layers + 8, 64);
  const std::uint64_t first_v2 = round_up(table_at + 24 * num_layers + 8, 64), shift = first_v2 - first_v1;
  std::vector<std::byte> v1(v2.begin(), v2.begin() + static_cast<std::ptrdiff_t>(tokens_end));
  v1.resize(first_v1);  // zeros: the padding
  v1.insert(v1.end(), v2.begin() + static_cast<std::ptrdiff_t>(first_v2), v2.end());
  put_u32(v1, 8, 1);
  put_u64(v1, 72, table_v1);
  put_u64(v1, 80, v1.size());
  put_u64(v1, header_bytes - 8, ghostlink::detail::xxh3_64(std::span(v1).first(header_bytes - 8)));
  for (std::size_t l = 0; l < num_layers; ++l) {
    std::copy_n(v2.begin() + static_cast<std::ptrdiff_t>(table_at + 24 * l), 24,
                v1.begin() + static_cast<std::ptrdiff_t>(table_v1 + 24 * l));
    put_u64(v1, table_v1 + 24 * l, u64_at(v2, table_at + 24 * l) - shift);
  }
  put_u64(v1, table_v1 + 24 * num_layers, ghostlink::detail::xxh3_64(std::span(v1).subspan(table_v1, 24 * num_layers)));
  return v1;
}

/// The format version 2 file of what the version 3 file `v3` holds: the
/// layout section without the scales (16 fixed bytes, not 24), the table
/// and the layers moved up to follow it, every offset and checksum made
/// again (docs/FORMAT.md, version 2).
std::vector<std::byte> as_version_2(const std::vector<std::byte>& v3) {
  const std::size_t header_bytes = u32_at(v3, 12), num_layers = u64_at(v3, 24), tokens = u64_at(v3, 56);
  const std::uint64_t tokens_at = u64_at(v3, 64), table_at = u64_at(v3, 72);
  const std::uint64_t layout_at = round_up(tokens_at + 4 * tokens + 8, 8);
  const std::uint64_t layout_v2 = 16 + 24 * num_layers;  // the section's bytes before its checksum
  const std::uint64_t table_v2 = round_up(layout_at + layout_v2 + 8, 8);
  const std::uint64_t first_v3 = round_up(table_at + 24 * num_layers + 8, 64);
  const std::uint64_t first_v2 = round_up(table_v2 + 24 * num_layers + 8, 64), shift = first_v3 - first_v2;
  std::vector<std::byte> v2(v3.begin(), v3.begin() + static_cast<std::ptrdiff_t>(layout_at + 16));
  v2.insert(v2.end(), v3.begin() + static_cast<std::ptrdiff_t>(layout_at + 24),
            v3.begin() + static_cast<std::ptrdiff_t>(layout_at + 24 + 24 * num_layers));
  v2.resize(first_v2);  // zeros: the checksums, the table and the padding, filled below
  v2.insert(v2.end(), v3.begin() + static_cast<std::ptrdiff_t>(first_v3), v3.end());
  put_u64(v2, layout_at + layout_v2, ghostlink::detail::xxh3_64(std::span(v2).subspan(layout_at, layout_v2)));
  for (std::size_t l = 0; l < num_layers; ++l) {
    std::copy_n(v3.begin() + static_cast<std::ptrdiff_t>(table_at + 24 * l), 24,
                v2.begin() + static_cast<std::ptrdiff_t>(table_v2 + 24 * l));
    put_u64(v2, table_v2 + 24 * l, u64_at(v3, table_at + 24 * l) - shift);
  }
  put_u64(v2, table_v2 + 24 * num_layers, ghostlink::detail::xxh3_64(std::span(v2).subspan(table_v2, 24 * num_layers)));
  put_u32(v2, 8, 2);
  put_u64(v2, 72, table_v2);
  put_u64(v2, 80, v2.size());
  put_u64(v2, header_bytes - 8, ghostlink::detail::xxh3_64(std::span(v2).first(header_bytes - 8)));
  return v2;
}

/// The test geometry: 3 layers of 2 heads * 4 dims, blocks of 4 tokens.
kv_cache_config test_config() { return {.max_tokens_per_seq = 64, .num_heads = 2, .head_dim = 4, .block_tokens = 4}; }
constexpr std::size_t layers = 3;
const std::string model = "test-model/7b@rev1";

kv_sequence_expectation expectation(kv_cache_config config = test_config()) { return {layers, config, model}; }
kv_save_options save_options(kv_cache_config config = test_config()) { return {config, model, std::nullopt}; }

/// The values 16-bit storage is most likely to get wrong: signed zeros,
/// subnormals, the largest finite values, infinities and NaNs.
std::vector<float> special_values(std::size_t width) {
  const std::array<float, 10> specials = {-0.0f,
                                          0.0f,
                                          std::numeric_limits<float>::denorm_min(),
                                          -5.96e-8f,
                                          65504.0f,
                                          -3.0e38f,
                                          std::numeric_limits<float>::infinity(),
                                          -std::numeric_limits<float>::infinity(),
                                          std::numeric_limits<float>::quiet_NaN(),
                                          -std::numeric_limits<float>::quiet_NaN()};
  std::vector<float> v(width);
  for (std::size_t i = 0; i < width; ++i) v[i] = specials[i % specials.size()];
  return v;
}

/// A 3-layer sequence of test_config() on a pool of its own, on 2 threads.
template <class T>
struct fixture {
  fixture() = default;
  explicit fixture(kv_pool_limits limits) : pool(kv_block_pool::for_caches<T>(test_config(), limits)) {}
  fixture(const fixture&) = delete;
  fixture& operator=(const fixture&) = delete;
  /// Ends `threads` as Asio wants a pool that other threads post to ended:
  /// joined once its work is done. A load completes from the I/O thread,
  /// which lets go of its hold on the handler's executor (`threads`) just
  /// after queueing the handler, so the handler may have run before that;
  /// destroying the pool unjoined would race with it.
  ~fixture() {
    seq = {};
    threads.join();
  }

  asio::thread_pool threads{2};
  kv_block_pool pool = kv_block_pool::for_caches<T>(test_config());
  basic_sequence_kv_cache<T> seq{threads.get_executor(), layers, test_config(), pool};
  std::size_t width = test_config().token_width();
  temp_dir dir;
  fs::path file = dir.path / "seq.glkv";

  /// Appends `n` tokens as one chunk (tags from `size()` + 1), with ids
  /// 1000 + index unless `with_ids` is false.
  void append(std::size_t n, bool with_ids = true) { REQUIRE_FALSE(append_quietly(n, with_ids)); }
  /// As append(), asserting nothing (for another thread).
  ghostlink::error_code append_quietly(std::size_t n, bool with_ids = true) {
    const ghostlink::test::seq::step st(layers, width, seq.size(), 1, n);
    std::vector<token_id> ids(n);
    for (std::size_t t = 0; t < n; ++t) ids[t] = static_cast<token_id>(1000 + seq.size() + t);
    return wait_ec([&](auto tk) {
      return with_ids ? seq.async_append(ids, st.key_spans, st.value_spans, tk)
                      : seq.async_append(st.key_spans, st.value_spans, tk);
    });
  }
  /// Appends one token of special values in every layer (id 7).
  void append_specials() {
    const std::vector<float> k = special_values(width);
    std::vector<float> v(k.rbegin(), k.rend());
    const std::vector<std::span<const float>> ks(layers, k), vs(layers, v);
    const token_id id[] = {7};
    REQUIRE_FALSE(wait_ec([&](auto tk) { return seq.async_append(id, ks, vs, tk); }));
  }

  ghostlink::error_code save(const fs::path& to, kv_save_options options = save_options()) {
    return wait_ec([&](auto tk) { return async_save(seq.snapshot(), to, options, tk); });
  }
  ghostlink::error_code save() { return save(file); }
  std::size_t blocks_in_use() const { return pool.stats().blocks_in_use; }
};

/// What a load completed with.
template <class T>
struct loaded {
  ghostlink::error_code ec;
  basic_sequence_kv_cache<T> seq;
  std::vector<token_id> ids;
  bool on_ex = false;  // the handler ran on the sequence's executor
};

/// Loads `path` on `threads` and waits for the handler (which has no associated
/// executor, so runs there).
template <class T>
loaded<T> load(asio::thread_pool& threads, const fs::path& path, const kv_block_pool& pool,
               kv_sequence_expectation expected = expectation(), kv_load_options options = {}) {
  std::promise<loaded<T>> done;
  const auto ex = threads.get_executor();
  async_load<T>(ex, path, pool, std::move(expected), std::move(options),
                [&done, ex](ghostlink::error_code ec, basic_sequence_kv_cache<T> seq, std::vector<token_id> ids) {
                  done.set_value({ec, std::move(seq), std::move(ids), ex.running_in_this_thread()});
                });
  return done.get_future().get();
}

/// Reads one layer of `path` and waits for the handler.
template <class T>
std::pair<ghostlink::error_code, kv_range> read_layer(const fs::path& path, std::size_t layer,
                                                      kv_sequence_expectation expected = expectation()) {
  std::promise<std::pair<ghostlink::error_code, kv_range>> done;
  async_read_layer<T>(path, layer, std::move(expected), [&done](ghostlink::error_code ec, kv_range r) {
    done.set_value({ec, std::move(r)});
  });
  return done.get_future().get();
}

/// The first `n` tokens of layer `l` of `s`, keys then values, as raw bits.
template <class T>
std::vector<std::uint32_t> stored_bits(const basic_sequence_snapshot<T>& s, std::size_t l, std::size_t n) {
  using bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>;
  std::vector<std::uint32_t> keys, values;
  (void)s.layer(l).for_each_block(0, n, [&](std::size_t, std::size_t, auto k, auto v) {
    for (const T& x : k) keys.push_back(std::bit_cast<bits>(x));
    for (const T& x : v) values.push_back(std::bit_cast<bits>(x));
  });
  keys.insert(keys.end(), values.begin(), values.end());
  return keys;
}

/// "" if `a` holds the first `n` tokens of `b` (all of them by default), bit
/// for bit (every layer, every token, every id), else the first difference.
template <class T>
std::string diff_sequences(const basic_sequence_snapshot<T>& a, const basic_sequence_snapshot<T>& b,
                           std::optional<std::size_t> n = std::nullopt) {
  const std::size_t tokens = n.value_or(b.size());
  if (a.size() != tokens || b.size() < tokens) return str("sizes ", a.size(), " and ", b.size(), ", expected ", tokens);
  if (a.num_layers() != b.num_layers()) return str("layers ", a.num_layers(), " and ", b.num_layers());
  std::vector<token_id> ids = b.token_ids();
  ids.resize(tokens);
  if (a.token_ids() != ids) return "token ids differ";
  for (std::size_t l = 0; l < a.num_layers(); ++l) {
    const auto x = stored_bits(a, l, tokens), y = stored_bits(b, l, tokens);
    if (x.size() != y.size()) return str("layer ", l, ": ", x.size(), " and ", y.size(), " elements");
    for (std::size_t i = 0; i < x.size(); ++i)
      if (x[i] != y[i]) return str("layer ", l, " element ", i, ": bits ", x[i], " and ", y[i]);
  }
  return {};
}

template <class T>
void check_round_trip() {
  fixture<T> f;
  f.append(5);
  f.append_specials();
  f.append(6);
  f.append_specials();  // the 13th token: a partial last block, widened and appended as a load ends
  const auto before = f.seq.snapshot();
  REQUIRE(before.size() == 13);
  REQUIRE_FALSE(f.save());

  const loaded<T> got = load<T>(f.threads, f.file, f.pool);
  REQUIRE_FALSE(got.ec);
  REQUIRE(got.seq.valid());
  CHECK(got.on_ex);
  CHECK(got.seq.num_layers() == layers);
  CHECK(got.seq.config() == test_config());
  CHECK(got.seq.pool() == f.pool);
  CHECK(got.seq.size() == 13);
  CHECK(got.ids == before.token_ids());
  CHECK(got.ids[5] == 7);
  CHECK(got.ids[11] == 1011);
  CHECK(got.ids[12] == 7);
  const std::string d = diff_sequences(before, got.seq.snapshot());
  INFO(d);
  CHECK(d.empty());
  // The loaded sequence is like any other: it takes appends.
  const ghostlink::test::seq::step st(layers, f.width, got.seq.size(), 2);
  CHECK_FALSE(wait_ec([&](auto tk) { return got.seq.async_append(st.key_spans, st.value_spans, tk); }));
  CHECK(got.seq.size() == 14);
}

/// Loads `path` expecting `expected_error`; checks nothing was made and no
/// block taken.
template <class T>
void check_refused(fixture<T>& f, const fs::path& path, ghostlink::error_code expected_error,
                   kv_sequence_expectation expected = expectation()) {
  const std::size_t blocks = f.blocks_in_use();
  const loaded<T> got = load<T>(f.threads, path, f.pool, std::move(expected));
  INFO("got: " << got.ec.message() << "; expected: " << expected_error.message());
  CHECK(got.ec == expected_error);
  CHECK_FALSE(got.seq.valid());
  CHECK(got.ids.empty());
  CHECK(f.blocks_in_use() == blocks);
}

ghostlink::error_code errno_error(int e) {
#if GHOSTLINK_ASIO_BOOST
  return {e, boost::system::generic_category()};
#else
  return {e, std::generic_category()};
#endif
}

}  // namespace

TEST_CASE("a saved float sequence loads back bit for bit, with its token ids", "[persist]") {
  check_round_trip<float>();
}

TEST_CASE("a saved half sequence loads back bit for bit, with its token ids", "[persist]") { check_round_trip<half>(); }

TEST_CASE("a saved bfloat16 sequence loads back bit for bit, with its token ids", "[persist]") {
  check_round_trip<bfloat16>();
}

TEST_CASE("a loaded sequence with a partial last block is exact, and a truncate and appends into its blocks "
          "change it alone",
          "[persist]") {
  fixture<float> f;
  f.append(9);  // full blocks of 4: two, and a partial one of 1 token
  f.append(5);
  REQUIRE(f.seq.size() == 14);
  REQUIRE_FALSE(f.save());
  const auto saved = f.seq.snapshot();

  const loaded<float> a = load<float>(f.threads, f.file, f.pool);
  REQUIRE_FALSE(a.ec);
  CHECK(a.ids == saved.token_ids());
  CHECK(diff_sequences(a.seq.snapshot(), saved).empty());
  // Truncated inside its second full block, then written past there: the
  // loaded blocks are shared with no one else, and this writes nothing into
  // another load of the same file or into the saved sequence.
  const loaded<float> b = load<float>(f.threads, f.file, f.pool);
  REQUIRE_FALSE(b.ec);
  REQUIRE_FALSE(wait_ec([&](auto tk) { return a.seq.async_truncate(6, tk); }));
  REQUIRE_FALSE(wait_ec([&](auto tk) { return f.seq.async_truncate(6, tk); }));
  const ghostlink::test::seq::step st(layers, f.width, 50, 1, 3);
  REQUIRE_FALSE(wait_ec([&](auto tk) { return a.seq.async_append(st.key_spans, st.value_spans, tk); }));
  REQUIRE_FALSE(wait_ec([&](auto tk) { return f.seq.async_append(st.key_spans, st.value_spans, tk); }));
  CHECK(a.seq.size() == 9);
  const std::string changed = diff_sequences(a.seq.snapshot(), f.seq.snapshot());
  INFO(changed);
  CHECK(changed.empty());
  const std::string intact = diff_sequences(b.seq.snapshot(), saved);
  INFO(intact);
  CHECK(intact.empty());
}

TEST_CASE("tokens appended without ids load back as no_token_id", "[persist]") {
  fixture<half> f;
  f.append(3, false);
  f.append(2);
  const auto before = f.seq.snapshot();
  REQUIRE_FALSE(f.save());
  const loaded<half> got = load<half>(f.threads, f.file, f.pool);
  REQUIRE_FALSE(got.ec);
  CHECK(got.ids == std::vector<token_id>{no_token_id, no_token_id, no_token_id, 1003, 1004});
  CHECK(got.seq.snapshot().token_ids() == got.ids);
  const std::string d = diff_sequences(before, got.seq.snapshot());
  INFO(d);
  CHECK(d.empty());
}

TEST_CASE("an empty sequence saves and loads as an empty sequence, taking no block", "[persist]") {
  fixture<float> f;
  REQUIRE_FALSE(f.save());
  const loaded<float> got = load<float>(f.threads, f.file, f.pool);
  REQUIRE_FALSE(got.ec);
  REQUIRE(got.seq.valid());
  CHECK(got.seq.size() == 0);
  CHECK(got.seq.num_layers() == layers);
  CHECK(got.ids.empty());
  CHECK(f.blocks_in_use() == 0);
  const auto [ec, range] = read_layer<float>(f.file, 2);
  CHECK_FALSE(ec);
  CHECK(range.end == 0);
  CHECK(range.keys.empty());
}

TEST_CASE("a save to a name of 250 bytes works: its temporary name stays within NAME_MAX", "[persist]") {
  fixture<float> f;
  f.append(5);
  const fs::path target = f.dir.path / std::string(250, 'n');
  REQUIRE_FALSE(f.save(target));
  const loaded<float> got = load<float>(f.threads, target, f.pool);
  REQUIRE_FALSE(got.ec);
  CHECK(got.seq.size() == 5);
  CHECK(f.dir.names() == std::vector<std::string>{target.filename().string()});
}

TEST_CASE("a saved file is private (0600) whatever the umask, or exactly its file_mode", "[persist]") {
  fixture<float> f;
  f.append(5);
  kv_save_options shared = save_options();
  shared.file_mode = fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read;
  const auto mode_of = [](const fs::path& p) {
    struct stat st {};
    REQUIRE(::stat(p.c_str(), &st) == 0);
    return static_cast<unsigned>(st.st_mode) & 07777u;
  };
  // The umask is the process's: opened wide only around the two saves.
  const ::mode_t old = ::umask(0);
  const ghostlink::error_code private_save = f.save(f.file);
  const ghostlink::error_code shared_save = f.save(f.dir.path / "shared.glkv", shared);
  ::umask(old);
  REQUIRE_FALSE(private_save);
  REQUIRE_FALSE(shared_save);
  CHECK(mode_of(f.file) == 0600u);
  CHECK(mode_of(f.dir.path / "shared.glkv") == 0640u);
  // A narrow umask does not narrow it either.
  const ::mode_t narrow = ::umask(0077);
  const ghostlink::error_code narrow_save = f.save(f.dir.path / "shared.glkv", shared);
  ::umask(narrow);
  REQUIRE_FALSE(narrow_save);
  CHECK(mode_of(f.dir.path / "shared.glkv") == 0640u);
}

TEST_CASE("the file is laid out as docs/FORMAT.md says", "[persist]") {
  fixture<bfloat16> f;
  f.append(5);
  REQUIRE_FALSE(f.save());
  const std::vector<std::byte> bytes = read_file(f.file);
  const std::array<unsigned char, 8> magic = {0x89, 'G', 'L', 'K', 'V', '\r', '\n', 0x1a};
  CHECK(std::memcmp(bytes.data(), magic.data(), magic.size()) == 0);
  CHECK(u32_at(bytes, 8) == 3);                         // version
  CHECK(u32_at(bytes, 12) == 96 + model.size() + 8);    // header length
  CHECK(u32_at(bytes, 16) == 2);                        // bfloat16
  CHECK(u32_at(bytes, 20) == 2);                        // bytes per element
  CHECK(u64_at(bytes, 24) == layers);
  CHECK(u64_at(bytes, 32) == 2);
  CHECK(u64_at(bytes, 40) == 4);
  CHECK(u64_at(bytes, 48) == 4);
  CHECK(u64_at(bytes, 56) == 5);
  CHECK(u64_at(bytes, 80) == bytes.size());
  CHECK(u32_at(bytes, 88) == model.size());
  CHECK(std::string(reinterpret_cast<const char*>(bytes.data()) + 96, model.size()) == model);
  const std::uint64_t tokens_at = u64_at(bytes, 64), table_at = u64_at(bytes, 72);
  CHECK(tokens_at % 8 == 0);
  CHECK(u32_at(bytes, tokens_at) == 1000);
  CHECK(u32_at(bytes, tokens_at + 16) == 1004);
  // The layout section: rollback_tokens, flags, the fp8 scales (f32 1.0
  // for other types), then (window, sinks, kept_from) a layer, all 0 for
  // full layers; its checksum; then the table.
  const std::uint64_t layout_at = round_up(tokens_at + std::uint64_t{4} * 5 + 8, 8);
  CHECK(u64_at(bytes, layout_at) == 0);
  CHECK(u64_at(bytes, layout_at + 8) == 0);
  CHECK(u32_at(bytes, layout_at + 16) == 0x3f80'0000u);
  CHECK(u32_at(bytes, layout_at + 20) == 0x3f80'0000u);
  for (std::size_t i = 0; i < 3 * layers; ++i) CHECK(u64_at(bytes, layout_at + 24 + 8 * i) == 0);
  CHECK(table_at == round_up(layout_at + 24 + 24 * layers + 8, 8));
  CHECK(table_at % 8 == 0);
  const std::uint64_t layer_bytes = std::uint64_t{2} * 5 * 8 * sizeof(bfloat16);
  for (std::size_t l = 0; l < layers; ++l) {
    INFO("layer " << l);
    const std::uint64_t at = u64_at(bytes, table_at + 24 * l);
    CHECK(at % 64 == 0);
    CHECK(u64_at(bytes, table_at + 24 * l + 8) == layer_bytes);
    // Keys then values, the stored bits as they are: token 0's first key.
    const float key = static_cast<float>(bfloat16(ghostlink::test::key_of(l, 0, 1, 0)));
    CHECK(std::bit_cast<std::uint32_t>(key) >> 16 == (u32_at(bytes, at) & 0xffffu));
    const float value = static_cast<float>(bfloat16(-ghostlink::test::key_of(l, 0, 1, 0)));
    CHECK(std::bit_cast<std::uint32_t>(value) >> 16 == (u32_at(bytes, at + layer_bytes / 2) & 0xffffu));
  }
}

TEST_CASE("a file of format version 1 loads as a full layout, bit for bit", "[persist]") {
  fixture<half> f;
  f.append(9);
  const auto before = f.seq.snapshot();
  REQUIRE_FALSE(f.save());
  const fs::path old = f.dir.path / "version1.glkv";
  write_file(old, as_version_1(read_file(f.file)));
  const loaded<half> got = load<half>(f.threads, old, f.pool);
  REQUIRE_FALSE(got.ec);
  CHECK(got.seq.layout() == kv_model_layout::full(layers));
  CHECK(ghostlink::test::observe(got.seq) == ghostlink::test::observe(f.seq));
  CHECK(got.ids == before.token_ids());
  // Expecting a windowed layout, it is refused as another layout.
  kv_sequence_expectation windowed = expectation();
  windowed.layout = kv_model_layout::interleaved(layers, 3, 8);
  check_refused(f, old, kv_errc::layout_mismatch, windowed);
  const auto [layer_ec, layer] = read_layer<half>(old, 1);
  CHECK_FALSE(layer_ec);
  CHECK(layer.end == 9);
}

TEST_CASE("a file of format version 2 (no scales) loads bit for bit, its layout and scales 1", "[persist]") {
  fixture<half> f;
  f.append(9);
  const auto before = f.seq.snapshot();
  REQUIRE_FALSE(f.save());
  const std::vector<std::byte> v3 = read_file(f.file);
  const std::vector<std::byte> v2 = as_version_2(v3);
  CHECK(v2.size() <= v3.size());
  const fs::path old = f.dir.path / "version2.glkv";
  write_file(old, v2);
  const loaded<half> got = load<half>(f.threads, old, f.pool);
  REQUIRE_FALSE(got.ec);
  CHECK(got.seq.layout() == kv_model_layout::full(layers));
  CHECK(ghostlink::test::observe(got.seq) == ghostlink::test::observe(f.seq));
  CHECK(got.ids == before.token_ids());
  const auto [layer_ec, layer] = read_layer<half>(old, 2);
  CHECK_FALSE(layer_ec);
  CHECK(layer.end == 9);
  // A version 2 file stands for scales 1: an fp8 expectation of other
  // scales would refuse it, and a half file's scales are 1 anyway.
  kv_cache_config scaled = test_config();
  scaled.key_scale = 2.0f;
  check_refused(f, old, kv_errc::invalid_config, expectation(scaled));
}

TEST_CASE("one layer reads alone through the offset table", "[persist]") {
  fixture<half> f;
  f.append(7);
  f.append_specials();
  const auto before = f.seq.snapshot();
  REQUIRE_FALSE(f.save());
  for (std::size_t l = 0; l < layers; ++l) {
    INFO("layer " << l);
    const auto [ec, got] = read_layer<half>(f.file, l);
    REQUIRE_FALSE(ec);
    kv_range want;
    REQUIRE_FALSE(before.layer(l).read_range(0, before.size(), want));
    CHECK(got.begin == 0);
    CHECK(got.end == 8);
    REQUIRE(got.keys.size() == want.keys.size());
    REQUIRE(got.values.size() == want.values.size());
    CHECK(std::memcmp(got.keys.data(), want.keys.data(), want.keys.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(got.values.data(), want.values.data(), want.values.size() * sizeof(float)) == 0);
  }
  CHECK(read_layer<half>(f.file, layers).first == kv_errc::layer_mismatch);
  CHECK(read_layer<float>(f.file, 0).first == kv_errc::element_type_mismatch);

  // A damaged layer 2 spoils layer 2 only: layer 0 is read without it.
  std::vector<std::byte> bytes = read_file(f.file);
  const std::uint64_t table_at = u64_at(bytes, 72);
  bytes[u64_at(bytes, table_at + std::uint64_t{24} * 2) + 3] ^= std::byte{0x10};
  write_file(f.file, bytes);
  CHECK_FALSE(read_layer<half>(f.file, 0).first);
  CHECK(read_layer<half>(f.file, 2).first == kv_errc::file_corrupt);
}

TEST_CASE("a load refuses a damaged file, making no sequence and taking no block", "[persist]") {
  fixture<float> f;
  f.append(9);
  REQUIRE_FALSE(f.save());
  const std::vector<std::byte> good = read_file(f.file);
  const std::uint64_t tokens_at = u64_at(good, 64), table_at = u64_at(good, 72);
  const std::size_t header_bytes = u32_at(good, 12);
  const fs::path bad = f.dir.path / "bad.glkv";
  const auto damaged = [&](std::size_t at) {
    std::vector<std::byte> b = good;
    b[at] ^= std::byte{0xff};
    write_file(bad, b);
  };

  SECTION("any header byte") {
    for (std::size_t at = 0; at < header_bytes; ++at) {
      INFO("byte " << at);
      damaged(at);
      const bool version = at >= 8 && at < 12;
      check_refused(f, bad, version ? kv_errc::file_version_unsupported : kv_errc::file_corrupt);
    }
  }
  SECTION("the token ids, or their checksum") {
    damaged(tokens_at + 1);
    check_refused(f, bad, kv_errc::file_corrupt);
    damaged(tokens_at + std::uint64_t{4} * 9 + 2);
    check_refused(f, bad, kv_errc::file_corrupt);
  }
  SECTION("the layer table, or its checksum") {
    damaged(table_at + 24 + 17);
    check_refused(f, bad, kv_errc::file_corrupt);
    damaged(table_at + 24 * layers + 1);
    check_refused(f, bad, kv_errc::file_corrupt);
  }
  SECTION("a layer's payload, first or last byte") {
    for (std::size_t l = 0; l < layers; ++l) {
      INFO("layer " << l);
      const std::uint64_t at = u64_at(good, table_at + 24 * l), n = u64_at(good, table_at + 24 * l + 8);
      damaged(at);
      check_refused(f, bad, kv_errc::file_corrupt);
      damaged(at + n - 1);
      check_refused(f, bad, kv_errc::file_corrupt);
    }
  }
  SECTION("bytes after the end") {
    std::vector<std::byte> b = good;
    b.push_back(std::byte{0});
    write_file(bad, b);
    check_refused(f, bad, kv_errc::file_corrupt);
  }
  SECTION("not a saved sequence at all") {
    write_file(bad, std::vector<std::byte>(200, std::byte{'x'}));
    check_refused(f, bad, kv_errc::file_corrupt);
  }
}

TEST_CASE("a load refuses a file with any one byte changed, padding included", "[persist]") {
  // One half token in 3 layers: every kind of padding is there (after the
  // header, the ids and the table, and 32 bytes after each layer but the
  // last), in a file small enough to damage byte by byte.
  fixture<half> f;
  f.append(1);
  REQUIRE_FALSE(f.save());
  const std::vector<std::byte> good = read_file(f.file);
  REQUIRE(good.size() < 1024);
  const std::uint64_t table_at = u64_at(good, 72);
  const std::uint64_t layer0 = u64_at(good, table_at), layer1 = u64_at(good, table_at + 24);
  const std::uint64_t layer0_end = layer0 + u64_at(good, table_at + 8);
  REQUIRE(layer0_end < layer1);  // the test needs padding after a layer
  const fs::path bad = f.dir.path / "bad.glkv";
  const std::size_t blocks = f.blocks_in_use();
  for (std::size_t at = 0; at < good.size(); ++at) {
    std::vector<std::byte> b = good;
    b[at] ^= std::byte{0x01};
    write_file(bad, b);
    const loaded<half> got = load<half>(f.threads, bad, f.pool);
    if (!got.ec || got.seq.valid() || !got.ids.empty() || f.blocks_in_use() != blocks)
      FAIL_CHECK("byte " << at << " of " << good.size() << " changed, yet the load gave: " << got.ec.message());
  }
  // A layer read checks the padding it passes and its own layer's tail.
  for (const std::uint64_t at : {std::uint64_t{u32_at(good, 12)}, table_at - 1, layer0 - 1, layer0_end, layer1 - 1}) {
    INFO("byte " << at);
    std::vector<std::byte> b = good;
    b[at] ^= std::byte{0x80};  // (a padding byte becomes 0x80; any other byte changes)
    write_file(bad, b);
    CHECK(read_layer<half>(bad, 0).first == kv_errc::file_corrupt);
  }
}

TEST_CASE("a load refuses a truncated file at any length", "[persist]") {
  fixture<half> f;
  f.append(9);
  REQUIRE_FALSE(f.save());
  const std::vector<std::byte> good = read_file(f.file);
  const std::size_t lengths[] = {0,
                                 1,
                                 7,
                                 8,
                                 11,
                                 50,
                                 96,
                                 u32_at(good, 12) - 1,
                                 u32_at(good, 12),
                                 u64_at(good, 64) + 3,
                                 u64_at(good, 72) + 10,
                                 u64_at(good, 72) + 24 * layers + 8,
                                 good.size() / 2,
                                 good.size() - 1};
  const fs::path cut = f.dir.path / "cut.glkv";
  for (std::size_t n : lengths) {
    INFO("cut to " << n << " of " << good.size() << " bytes");
    write_file(cut, std::vector<std::byte>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)));
    check_refused(f, cut, kv_errc::file_truncated);
    CHECK(read_layer<half>(cut, 0).first == kv_errc::file_truncated);
  }
}

TEST_CASE("a load refuses another version, geometry, element type or model", "[persist]") {
  fixture<float> f;
  f.append(5);
  REQUIRE_FALSE(f.save());

  SECTION("a later format version") {
    std::vector<std::byte> b = read_file(f.file);
    put_u32(b, 8, 4);
    write_file(f.file, b);
    check_refused(f, f.file, kv_errc::file_version_unsupported);
  }
  SECTION("another number of layers") {
    check_refused(f, f.file, kv_errc::geometry_mismatch, {layers + 1, test_config(), model});
  }
  SECTION("the same token width split into other heads") {
    kv_cache_config other = test_config();
    other.num_heads = 4;
    other.head_dim = 2;
    check_refused(f, f.file, kv_errc::geometry_mismatch, expectation(other));
  }
  SECTION("another block size") {
    kv_cache_config other = test_config();
    other.block_tokens = 8;
    kv_block_pool pool = kv_block_pool::for_caches<float>(other);
    const loaded<float> got = load<float>(f.threads, f.file, pool, expectation(other));
    CHECK(got.ec == kv_errc::geometry_mismatch);
    CHECK(pool.stats().blocks_in_use == 0);
  }
  SECTION("another element type") {
    kv_block_pool pool = kv_block_pool::for_caches<half>(test_config());
    const loaded<half> got = load<half>(f.threads, f.file, pool);
    CHECK(got.ec == kv_errc::element_type_mismatch);
    CHECK_FALSE(got.seq.valid());
    CHECK(pool.stats().blocks_in_use == 0);
  }
  SECTION("another model") {
    check_refused(f, f.file, kv_errc::model_mismatch, {layers, test_config(), "test-model/7b@rev2"});
    check_refused(f, f.file, kv_errc::model_mismatch, {layers, test_config(), ""});
  }
  SECTION("more tokens than the config allows") {
    kv_cache_config small = test_config();
    small.max_tokens_per_seq = 4;
    check_refused(f, f.file, kv_errc::index_out_of_range, expectation(small));
    CHECK(read_layer<float>(f.file, 0, expectation(small)).first == kv_errc::index_out_of_range);
  }
  SECTION("a config that does not fit the pool") {
    kv_cache_config other = test_config();
    other.max_blocks = 10;  // the pool holds the budget
    check_refused(f, f.file, kv_errc::invalid_config, expectation(other));
    check_refused(f, f.file, kv_errc::invalid_config, {0, test_config(), model});
  }
}

TEST_CASE("a load the pool cannot hold fails whole, taking no block", "[persist]") {
  fixture<float> f(kv_pool_limits{.max_blocks = 12});
  f.append(9);  // 3 blocks in each of 3 layers
  REQUIRE_FALSE(f.save());
  check_refused(f, f.file, kv_errc::capacity_exhausted);  // 9 more blocks: 3 are left
  CHECK(f.blocks_in_use() == 9);
}

TEST_CASE("a missing file or an impossible path is the operating system's error", "[persist]") {
  fixture<float> f;
  f.append(2);
  check_refused(f, f.dir.path / "missing.glkv", errno_error(ENOENT));
  CHECK(read_layer<float>(f.dir.path / "missing.glkv", 0).first == errno_error(ENOENT));

  // A path through a regular file fails to open (ENOTDIR) as root too.
  const fs::path not_a_dir = f.dir.path / "plain";
  write_file(not_a_dir, {std::byte{1}});
  const ghostlink::error_code ec = f.save(not_a_dir / "seq.glkv");
  INFO(ec.message());
  CHECK(ec == errno_error(ENOTDIR));
  CHECK(f.dir.names() == std::vector<std::string>{"plain"});
  check_refused(f, not_a_dir / "seq.glkv", errno_error(ENOTDIR));
}

TEST_CASE("a FIFO is refused as not a regular file (EINVAL), without waiting for a writer", "[persist]") {
  fixture<float> f;
  const fs::path fifo = f.dir.path / "fifo.glkv";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // Bounded: if the open blocked, a writer is opened to release it, so the
  // test fails instead of hanging.
  const auto bounded = [&](auto start) {
    auto done = std::async(std::launch::async, start);
    if (done.wait_for(std::chrono::seconds(10)) == std::future_status::timeout) {
      const int writer = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);  // NOLINT(*-vararg)
      FAIL_CHECK("the open of a FIFO blocked");
      if (writer >= 0) ::close(writer);
    }
    return done.get();
  };
  const std::size_t blocks = f.blocks_in_use();
  const loaded<float> got = bounded([&] { return load<float>(f.threads, fifo, f.pool); });
  INFO(got.ec.message());
  CHECK(got.ec == errno_error(EINVAL));
  CHECK_FALSE(got.seq.valid());
  CHECK(f.blocks_in_use() == blocks);
  const ghostlink::error_code layer_ec = bounded([&] { return read_layer<float>(fifo, 0).first; });
  INFO(layer_ec.message());
  CHECK(layer_ec == errno_error(EINVAL));
}

TEST_CASE("a save checks its arguments before any I/O", "[persist]") {
  fixture<float> f;
  f.append(2);
  CHECK(wait_ec([&](auto tk) { return async_save(sequence_snapshot(), f.file, save_options(), tk); }) ==
        kv_errc::layer_mismatch);
  kv_cache_config wide = test_config();
  wide.head_dim = 8;
  CHECK(f.save(f.file, save_options(wide)) == kv_errc::width_mismatch);
  kv_cache_config zero = test_config();
  zero.block_tokens = 0;
  CHECK(f.save(f.file, save_options(zero)) == kv_errc::invalid_config);
  CHECK(f.save(f.file, {test_config(), std::string(65537, 'm'), std::nullopt}) == kv_errc::invalid_config);
  CHECK(f.dir.names().empty());
}

TEST_CASE("a save replaces a file atomically; a failed one leaves it intact and no temporary file", "[persist]") {
  fixture<float> f;
  f.append(3);
  REQUIRE_FALSE(f.save());
  f.append(20);
  REQUIRE_FALSE(f.save());
  CHECK(f.dir.names() == std::vector<std::string>{"seq.glkv"});
  const loaded<float> first = load<float>(f.threads, f.file, f.pool);
  REQUIRE_FALSE(first.ec);
  CHECK(first.seq.size() == 23);
  const std::vector<std::byte> before = read_file(f.file);
  REQUIRE(before.size() > 2048);

  // A write past RLIMIT_FSIZE fails with EFBIG (SIGXFSZ ignored): a real
  // I/O failure after the temporary file was made. Root is bound by it too.
  struct sigaction ignore {};
  struct sigaction old_action {};
  ignore.sa_handler = SIG_IGN;  // NOLINT(cppcoreguidelines-pro-type-union-access)
  REQUIRE(::sigaction(SIGXFSZ, &ignore, &old_action) == 0);
  rlimit old_limit{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old_limit) == 0);
  rlimit small = old_limit;
  small.rlim_cur = 1024;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  f.append(1);
  const ghostlink::error_code ec = f.save();
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &old_limit) == 0);
  REQUIRE(::sigaction(SIGXFSZ, &old_action, nullptr) == 0);
  INFO(ec.message());
  CHECK(ec == errno_error(EFBIG));
  CHECK(f.dir.names() == std::vector<std::string>{"seq.glkv"});
  CHECK(read_file(f.file) == before);
  CHECK(load<float>(f.threads, f.file, f.pool).seq.size() == 23);
}

TEST_CASE("a save taken while a writer appends holds exactly its snapshot's tokens", "[persist]") {
  fixture<half> f;
  constexpr std::size_t total = 48;
  constexpr std::size_t saves = 6;
  std::atomic<std::size_t> failed_appends{0};
  std::thread writer([&] {
    for (std::size_t i = 0; i < total; ++i)
      if (f.append_quietly(1)) failed_appends.fetch_add(1);
  });
  // Each save pins a snapshot of whatever the writer has published so far
  // and writes it while the writer goes on.
  std::vector<std::size_t> sizes;
  for (std::size_t k = 0; k < saves; ++k) {
    auto snap = f.seq.snapshot();
    sizes.push_back(snap.size());
    const fs::path p = f.dir.path / str("seq", k, ".glkv");
    CHECK_FALSE(wait_ec([&](auto tk) { return async_save(std::move(snap), p, save_options(), tk); }));
  }
  writer.join();
  CHECK(failed_appends.load() == 0);
  REQUIRE(f.seq.size() == total);
  const auto full = f.seq.snapshot();
  for (std::size_t k = 0; k < saves; ++k) {
    INFO("save " << k << " of a snapshot of " << sizes[k] << " tokens");
    const loaded<half> got = load<half>(f.threads, f.dir.path / str("seq", k, ".glkv"), f.pool);
    REQUIRE_FALSE(got.ec);
    CHECK(got.seq.size() == sizes[k]);
    const std::string d = diff_sequences(got.seq.snapshot(), full, sizes[k]);
    INFO(d);
    CHECK(d.empty());
  }
}

TEST_CASE("the file I/O runs on the given executor, the handlers where Asio's rules put them", "[persist]") {
  fixture<float> f;
  f.append(6);
  asio::io_context io;  // run by this thread only, after the operations start
  const kv_save_options on_io{test_config(), model, io.get_executor()};

  // Nothing happens until `io` runs: the I/O is queued there, not on a
  // strand or the private pool.
  std::promise<std::pair<ghostlink::error_code, bool>> saved;
  async_save(f.seq.snapshot(), f.file, on_io, [&](ghostlink::error_code ec) {
    saved.set_value({ec, io.get_executor().running_in_this_thread()});  // no associated executor: the I/O one
  });
  auto saved_result = saved.get_future();
  CHECK(saved_result.wait_for(std::chrono::seconds(0)) == std::future_status::timeout);
  CHECK_FALSE(fs::exists(f.file));
  io.run();
  const auto [save_ec, save_on_io] = saved_result.get();
  CHECK_FALSE(save_ec);
  CHECK(save_on_io);
  CHECK(fs::exists(f.file));

  // A load reads on `io` and appends on the sequence's strands (the pool's
  // threads); its handler runs on the sequence's executor. `io.run()`
  // returns only once the load is over: it holds work on `io` meanwhile.
  io.restart();
  std::promise<loaded<float>> done;
  const auto ex = f.threads.get_executor();
  async_load<float>(ex, f.file, f.pool, expectation(), kv_load_options{io.get_executor()},
                    [&](ghostlink::error_code ec, sequence_kv_cache seq, std::vector<token_id> ids) {
                      done.set_value({ec, std::move(seq), std::move(ids), ex.running_in_this_thread()});
                    });
  auto result = done.get_future();
  CHECK(result.wait_for(std::chrono::seconds(0)) == std::future_status::timeout);
  CHECK(f.blocks_in_use() == 6);  // nothing read, nothing taken yet
  io.run();
  const loaded<float> got = result.get();
  CHECK_FALSE(got.ec);
  CHECK(got.on_ex);
  CHECK(got.seq.size() == 6);

  // A handler with an executor of its own runs there.
  io.restart();
  std::promise<bool> bound;
  asio::io_context other;
  async_read_layer<float>(f.file, 1, expectation(), kv_load_options{io.get_executor()},
                          asio::bind_executor(other.get_executor(), [&](ghostlink::error_code ec, const kv_range& r) {
                            bound.set_value(!ec && r.end == 6 && other.get_executor().running_in_this_thread());
                          }));
  io.run();
  auto bound_result = bound.get_future();
  CHECK(bound_result.wait_for(std::chrono::seconds(0)) == std::future_status::timeout);
  other.run();
  CHECK(bound_result.get());
}

TEST_CASE("a handler never runs inside the initiating call, even on an early error", "[persist]") {
  fixture<float> f;
  asio::io_context io;
  bool ran = false;
  ghostlink::error_code got;
  kv_cache_config wide = test_config();
  wide.head_dim = 8;
  async_save(f.seq.snapshot(), f.file, {wide, model, io.get_executor()}, [&](ghostlink::error_code ec) {
    ran = true;
    got = ec;
  });
  CHECK_FALSE(ran);
  io.run();
  CHECK(ran);
  CHECK(got == kv_errc::width_mismatch);
}

TEST_CASE("a cancelled save or load does nothing and completes with operation_aborted", "[persist]") {
  fixture<float> f;
  f.append(5);
  REQUIRE_FALSE(f.save());
  const std::vector<std::byte> before = read_file(f.file);
  f.append(3);
  asio::io_context io;
  asio::cancellation_signal signal;

  SECTION("a save: the old file stays, no temporary file") {
    std::optional<ghostlink::error_code> got;
    async_save(f.seq.snapshot(), f.file, {test_config(), model, io.get_executor()},
               asio::bind_cancellation_slot(signal.slot(), [&](ghostlink::error_code ec) { got = ec; }));
    signal.emit(asio::cancellation_type::terminal);
    io.run();
    REQUIRE(got.has_value());
    CHECK(*got == asio::error::operation_aborted);
    CHECK(read_file(f.file) == before);
    CHECK(f.dir.names() == std::vector<std::string>{"seq.glkv"});
  }
  SECTION("a load: no sequence, no block") {
    std::promise<std::pair<ghostlink::error_code, bool>> done;
    async_load<float>(
        f.threads.get_executor(), f.file, f.pool, expectation(), kv_load_options{io.get_executor()},
        asio::bind_cancellation_slot(
            signal.slot(), [&](ghostlink::error_code ec, const sequence_kv_cache& seq, const std::vector<token_id>&) {
              done.set_value({ec, seq.valid()});
            }));
    signal.emit(asio::cancellation_type::partial);
    io.run();
    const auto [ec, made] = done.get_future().get();
    CHECK(ec == asio::error::operation_aborted);
    CHECK_FALSE(made);
    CHECK(f.blocks_in_use() == 2 * layers);
  }
}

#ifdef GHOSTLINK_HAS_CO_AWAIT
TEST_CASE("save and load co_await with the default token", "[persist]") {
  fixture<bfloat16> f;
  f.append(4);
  const auto before = f.seq.snapshot();
  const asio::any_io_executor ex = f.threads.get_executor();
  auto [seq, ids] = ghostlink::test::run(
      ex, [&]() -> asio::awaitable<std::tuple<basic_sequence_kv_cache<bfloat16>, std::vector<token_id>>> {
        co_await async_save(f.seq.snapshot(), f.file, save_options());
        co_return co_await async_load<bfloat16>(ex, f.file, f.pool, expectation());
      }());
  CHECK(ids == before.token_ids());
  const std::string d = diff_sequences(before, seq.snapshot());
  INFO(d);
  CHECK(d.empty());
  // An error arrives as a thrown exception.
  const ghostlink::error_code ec = ghostlink::test::run(ex, [&]() -> asio::awaitable<ghostlink::error_code> {
    ghostlink::error_code thrown;
    // Named, not a braced temporary inside the co_await: GCC 12 copies such
    // a temporary bitwise into the frame (a string's buffer then dangles).
    const kv_sequence_expectation other{layers, test_config(), "other"};
    try {
      co_await async_load<bfloat16>(ex, f.file, f.pool, other);
    } catch (const ghostlink::test::async_error& e) {
      thrown = e.code();
    }
    co_return thrown;
  }());
  CHECK(ec == kv_errc::model_mismatch);
}
#endif

}  // namespace persist_tests
