// Completion tokens: every async operation works with use_awaitable,
// deferred, use_future, as_tuple(use_awaitable) and a plain callback, for a
// success and for an error.

#include "common/completion_support.hpp"

namespace completion_tokens_tests {

using namespace ghostlink;
using namespace ghostlink::test::completion;
namespace t = ghostlink::test;

namespace {

using ghostlink::test::completion::code_of;
/// a fresh cache, then five that fail. With `Deferred`, each makes a deferred
/// operation and launches it with the token.
template <bool Deferred>
struct calls {
  layer_kv_cache& c;
  const tokens& tk;

  template <class Token, class Start>
  static auto launch(Token tok, Start start) {
    if constexpr (Deferred)
      return start(t::deferred)(std::move(tok));
    else
      return start(std::move(tok));
  }
#define GHOSTLINK_CALL(name, ...)                                         \
  template <class Token>                                                  \
  auto name(Token tok) const {                                            \
    return launch(std::move(tok), [&](auto k) { return c.__VA_ARGS__; }); \
  }
  GHOSTLINK_CALL(initialize, async_initialize(4, std::move(k)))
  GHOSTLINK_CALL(write, async_write(1, tk.k1, tk.v1, std::move(k)))
  GHOSTLINK_CALL(write_batch, async_write_batch(tk.batch, std::move(k)))
  GHOSTLINK_CALL(read_kv, async_read_kv(1, std::move(k)))
  GHOSTLINK_CALL(read_range, async_read_range(1, 4, std::move(k)))
  GHOSTLINK_CALL(bad_initialize, async_initialize(0, std::move(k)))
  GHOSTLINK_CALL(bad_write, async_write(1, tk.too_short, tk.too_short, std::move(k)))
  GHOSTLINK_CALL(bad_write_batch, async_write_batch(tk.bad_batch, std::move(k)))
  GHOSTLINK_CALL(bad_read_kv, async_read_kv(4, std::move(k)))
  GHOSTLINK_CALL(bad_read_range, async_read_range(3, 1, std::move(k)))
#undef GHOSTLINK_CALL
};

/// What those calls completed with.
struct outcome {
  ghostlink::error_code initialize, write, write_batch, read_kv, read_range;
  kv_entry entry;
  kv_range range;
  ghostlink::error_code bad_initialize, bad_write, bad_write_batch, bad_read_kv, bad_read_range;
};

void check(const outcome& o, const fixture& f) {
  const tokens& tk = f.tk;
  const ghostlink::error_code ok;
  const std::tuple<const char*, ghostlink::error_code, ghostlink::error_code> codes[] = {
      {"initialize", o.initialize, ok},
      {"write", o.write, ok},
      {"write_batch", o.write_batch, ok},
      {"read_kv", o.read_kv, ok},
      {"read_range", o.read_range, ok},
      {"initialize(0)", o.bad_initialize, err(kv_errc::zero_length)},
      {"write of a short token", o.bad_write, err(kv_errc::width_mismatch)},
      {"write_batch with index 16", o.bad_write_batch, err(kv_errc::index_out_of_range)},
      {"read_kv(4)", o.bad_read_kv, err(kv_errc::index_out_of_range)},
      {"read_range(3, 1)", o.bad_read_range, err(kv_errc::invalid_range)}};
  for (const auto& [call, got, expected] : codes) {
    INFO("call: " << call);
    CHECK(got == expected);
  }
  INFO("values read back are the ones written");
  CHECK(o.entry.keys == tk.k1);
  CHECK(o.entry.values == tk.v1);
  CHECK((o.range.begin == 1 && o.range.end == 4));
  CHECK(o.range.keys == concat({&tk.k1, &tk.k2, &tk.k3}));
  CHECK(o.range.values == concat({&tk.v1, &tk.v2, &tk.v3}));
  INFO("the failed calls left the stored data alone");
  kv_range stored;
  const std::vector<float> zeros(tk.w, 0.0f);
  CHECK(f.cache.snapshot().read_range(0, 4, stored) == ok);
  CHECK(stored.keys == concat({&zeros, &tk.k1, &tk.k2, &tk.k3}));
  CHECK(f.cache.size() == 4);
}

/// The error of a call: thrown as `std::system_error` (use_awaitable,
/// use_future) or the tuple's first element (as_tuple).
template <class T>
asio::awaitable<ghostlink::error_code> code_of(asio::awaitable<T> op) {
  ghostlink::error_code ec;
  try {
    co_await std::move(op);
  } catch (const ghostlink::test::async_error& e) {
    ec = e.code();
  }
  co_return ec;
}

template <class... T>
asio::awaitable<ghostlink::error_code> code_of(asio::awaitable<std::tuple<ghostlink::error_code, T...>> op) {
  co_return std::get<0>(co_await std::move(op));
}

/// The value of a call that succeeded (a tuple's error is in `ec`).
template <class T>
asio::awaitable<T> value_of(asio::awaitable<T> op, ghostlink::error_code&) {
  co_return co_await std::move(op);
}

template <class T>
asio::awaitable<T> value_of(asio::awaitable<std::tuple<ghostlink::error_code, T>> op, ghostlink::error_code& ec) {
  auto [e, value] = co_await std::move(op);
  ec = e;
  co_return std::move(value);
}

/// Every call, co_awaited: `tok` is use_awaitable or as_tuple(use_awaitable);
/// with `Deferred`, each deferred operation is launched with `tok`.
template <bool Deferred, class Token>
asio::awaitable<outcome> with_awaitable(calls<Deferred> k, Token tok) {
  outcome o;
  o.initialize = co_await code_of(k.initialize(tok));
  o.write = co_await code_of(k.write(tok));
  o.write_batch = co_await code_of(k.write_batch(tok));
  o.entry = co_await value_of(k.read_kv(tok), o.read_kv);
  o.range = co_await value_of(k.read_range(tok), o.read_range);
  o.bad_initialize = co_await code_of(k.bad_initialize(tok));
  o.bad_write = co_await code_of(k.bad_write(tok));
  o.bad_write_batch = co_await code_of(k.bad_write_batch(tok));
  o.bad_read_kv = co_await code_of(k.bad_read_kv(tok));
  o.bad_read_range = co_await code_of(k.bad_read_range(tok));
  co_return o;
}

template <bool Deferred = false, class Token>
outcome awaited(fixture& f, Token tok) {
  return t::run(f.pool.get_executor(), with_awaitable(calls<Deferred>{f.cache, f.tk}, tok));
}

/// Starts a call with a plain callback lambda, waits for it and returns the
/// callback's arguments.
template <class... T, class Start>
std::tuple<ghostlink::error_code, T...> wait_callback(Start start) {
  auto p = std::make_shared<std::promise<std::tuple<ghostlink::error_code, T...>>>();
  auto result = p->get_future();
  start([p](ghostlink::error_code ec, T... v) { p->set_value({ec, std::move(v)...}); });
  return result.get();
}

/// Every call with a plain callback (with `Deferred`: the deferred operation
/// is launched with it).
template <bool Deferred>
outcome with_callbacks(calls<Deferred> k) {
  outcome o;
  std::tie(o.initialize) = wait_callback([&](auto h) { k.initialize(h); });
  std::tie(o.write) = wait_callback([&](auto h) { k.write(h); });
  std::tie(o.write_batch) = wait_callback([&](auto h) { k.write_batch(h); });
  std::tie(o.read_kv, o.entry) = wait_callback<kv_entry>([&](auto h) { k.read_kv(h); });
  std::tie(o.read_range, o.range) = wait_callback<kv_range>([&](auto h) { k.read_range(h); });
  std::tie(o.bad_initialize) = wait_callback([&](auto h) { k.bad_initialize(h); });
  std::tie(o.bad_write) = wait_callback([&](auto h) { k.bad_write(h); });
  std::tie(o.bad_write_batch) = wait_callback([&](auto h) { k.bad_write_batch(h); });
  std::tie(o.bad_read_kv, std::ignore) = wait_callback<kv_entry>([&](auto h) { k.bad_read_kv(h); });
  std::tie(o.bad_read_range, std::ignore) = wait_callback<kv_range>([&](auto h) { k.bad_read_range(h); });
  return o;
}

/// One call of the "never inline" check.

}  // namespace

TEST_CASE("every operation completes through asio::use_awaitable; errors throw system_error", "[completion]") {
  fixture f;
  const auto tok = asio::use_awaitable;
  static_assert(std::is_same_v<decltype(f.cache.async_initialize(1, tok)), asio::awaitable<void>>);
  static_assert(std::is_same_v<decltype(f.cache.async_read_kv(0, tok)), asio::awaitable<kv_entry>>);
  INFO("token: asio::use_awaitable");
  check(awaited(f, tok), f);
}

TEST_CASE("every operation completes through deferred, co_awaited and launched with a callback", "[completion]") {
  fixture f;
  SECTION("co_await") {
    // Asio 1.22 cannot co_await a deferred operation itself: launch it with use_awaitable.
    INFO("token: deferred, then co_await op(asio::use_awaitable)");
    check(awaited<true>(f, asio::use_awaitable), f);
  }
  SECTION("callback") {
    INFO("token: deferred, then op(callback)");
    check(with_callbacks(calls<true>{f.cache, f.tk}), f);
  }
}

TEST_CASE("every operation completes through asio::use_future; errors throw system_error from get()", "[completion]") {
  fixture f;
  calls<false> k{f.cache, f.tk};
  const auto tok = asio::use_future;
  static_assert(std::is_same_v<decltype(k.write(tok)), std::future<void>>);
  static_assert(std::is_same_v<decltype(k.read_kv(tok)), std::future<kv_entry>>);
  static_assert(std::is_same_v<decltype(k.read_range(tok)), std::future<kv_range>>);
  INFO("token: asio::use_future");
  outcome o;
  o.initialize = code_of(k.initialize(tok));
  o.write = code_of(k.write(tok));
  o.write_batch = code_of(k.write_batch(tok));
  o.entry = k.read_kv(tok).get();
  o.range = k.read_range(tok).get();
  o.bad_initialize = code_of(k.bad_initialize(tok));
  o.bad_write = code_of(k.bad_write(tok));
  o.bad_write_batch = code_of(k.bad_write_batch(tok));
  o.bad_read_kv = code_of(k.bad_read_kv(tok));
  o.bad_read_range = code_of(k.bad_read_range(tok));
  check(o, f);
}

TEST_CASE("every operation completes through as_tuple(asio::use_awaitable)", "[completion]") {
  fixture f;
  const auto tok = t::as_tuple(asio::use_awaitable);
  using ghostlink::error_code, std::tuple;
  static_assert(std::is_same_v<decltype(f.cache.async_initialize(1, tok)), asio::awaitable<tuple<error_code>>>);
  static_assert(std::is_same_v<decltype(f.cache.async_read_kv(0, tok)), asio::awaitable<tuple<error_code, kv_entry>>>);
  INFO("token: as_tuple(asio::use_awaitable)");
  check(awaited(f, tok), f);
}

TEST_CASE("every operation completes through a plain callback", "[completion]") {
  fixture f;
  INFO("token: a lambda");
  check(with_callbacks(calls<false>{f.cache, f.tk}), f);
}

}  // namespace completion_tokens_tests
