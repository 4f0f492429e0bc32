// The Redis tier's security and read cap (redis_store.hpp): AUTH with a
// password or an ACL user, SELECT, TLS (CA, server name, client
// certificate, verification off), a cluster with a password, every
// refusal counted and recorded as the store's last error and reported by
// async_wait_ready(); options refused at construction; a value planted
// larger than the read cap is a miss skipped without being buffered.
//
// Each test starts its own redis-server (common/redis_process.hpp) on a
// unix socket (and a loopback TLS port) in a temporary directory, its TLS
// certificates made by the `openssl` command there, and stops it by its
// process id.
#include "common/files.hpp"
#include "common/redis_process.hpp"
#include "common/store_values.hpp"

#include <ghostlink/error.hpp>
#include <ghostlink/redis_store.hpp>

#include "store/redis/connection.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace redis_security_tests {

using namespace ghostlink;
namespace fs = std::filesystem;
using ghostlink::test::temp_dir;
using ghostlink::test::redis::call;
using ghostlink::test::redis::cluster_nodes;
using ghostlink::test::redis::port_free;
using ghostlink::test::redis::redis_server;
using ghostlink::test::redis::run_program;
using ghostlink::test::redis::text;
using std::chrono::milliseconds;
using bytes = std::vector<std::byte>;
using reply_type = detail::redis_reply::type;

namespace {

constexpr std::string_view password = "s3cret-Pa55";

using ghostlink::test::bytes_value;

kv_block_hash hash_of(unsigned seed) {
  kv_block_hash h;
  for (std::size_t i = 0; i < h.bytes.size(); ++i)
    h.bytes[i] = static_cast<std::uint8_t>(std::size_t{seed} * 131 + i * 7 + 1);
  return h;
}

bytes bytes_of(unsigned seed, std::size_t n = 100) {
  bytes b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>(seed + i);
  return b;
}

/// What async_wait_ready() completed with (10 s at most).
ghostlink::error_code wait_ready(kv_redis_store& store) {
  auto done = std::make_shared<std::promise<ghostlink::error_code>>();
  std::future<ghostlink::error_code> result = done->get_future();
  store.async_wait_ready([done](ghostlink::error_code ec) { done->set_value(ec); });
  REQUIRE(result.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  return result.get();
}

/// The values a fetch of `hashes` delivered by index (a miss: empty), or
/// none if they did not all come within 10 s. No assertion: safe from any
/// thread (Catch2's are for the test's own thread).
std::optional<std::vector<bytes>> try_fetch_all(kv_block_store& store, const std::vector<kv_block_hash>& hashes) {
  struct state {
    std::mutex mutex;
    std::vector<bytes> got;
    std::size_t left = 0;
    std::promise<void> done;
  };
  auto s = std::make_shared<state>();
  s->got.resize(hashes.size());
  s->left = hashes.size();
  std::future<void> done = s->done.get_future();
  store.fetch(hashes, [s](std::size_t i, bytes b) {
    std::lock_guard lock(s->mutex);
    s->got[i] = std::move(b);
    if (--s->left == 0) s->done.set_value();
    return true;
  });
  if (done.wait_for(std::chrono::seconds(10)) != std::future_status::ready) return std::nullopt;
  std::lock_guard lock(s->mutex);
  return s->got;
}

/// try_fetch_all, required to answer in time.
std::vector<bytes> fetch_all(kv_block_store& store, const std::vector<kv_block_hash>& hashes) {
  std::optional<std::vector<bytes>> got = try_fetch_all(store, hashes);
  REQUIRE(got.has_value());
  return *std::move(got);
}

/// Puts `value` under `hash`, flushed: whether the store counted it stored.
bool put_flushed(kv_redis_store& store, const kv_block_hash& hash, const bytes& value) {
  const std::uint64_t stored = store.stats().stored;
  store.put(std::make_shared<bytes_value>(hash, value));
  store.flush();
  return store.stats().stored == stored + 1;
}

/// A put and a fetch back of the same bytes.
void check_round_trip(kv_redis_store& store, unsigned seed) {
  REQUIRE(put_flushed(store, hash_of(seed), bytes_of(seed)));
  CHECK(fetch_all(store, {hash_of(seed)}).at(0) == bytes_of(seed));
}

/// The store refused with `e`: the wait says so, the counters and last error too.
void check_refused(kv_redis_store& store, kv_errc e) {
  CHECK(wait_ready(store) == ghostlink::error_code(e));
  const kv_store_stats s = store.stats();
  CHECK(s.last_error == make_error_code(e));
  CHECK(s.last_error_time > std::chrono::system_clock::time_point{});
  CHECK(s.last_error.message().find(password) == std::string::npos);
  if (e == kv_errc::store_auth_failed) CHECK(s.auth_errors > 0);
  if (e == kv_errc::store_tls_failed) CHECK(s.tls_errors > 0);
  // Nothing stored, nothing found.
  CHECK(!put_flushed(store, hash_of(7), bytes_of(7)));
  CHECK(store.stats().write_errors >= 1);
  CHECK(fetch_all(store, {hash_of(7)}).at(0).empty());
}

/// A server on a unix socket in `dir` with `args`, `admin` its password for
/// the test's own commands.
redis_server unix_server(const temp_dir& dir, std::vector<std::string> args, std::string admin = {}) {
  const fs::path socket = dir.path / "redis.sock";
  args.insert(args.end(), {"--port", "0", "--unixsocket", socket.string(), "--dir", dir.path.string()});
  return redis_server(std::move(args), {.unix_socket = socket.string()}, std::move(admin));
}

kv_redis_endpoint unix_endpoint(const temp_dir& dir) { return {.unix_socket = (dir.path / "redis.sock").string()}; }

/// Short timeouts: a refusal is seen and retried quickly.
kv_redis_store_options quick(kv_redis_store_options o = {}) {
  o.connect_timeout = milliseconds(1000);
  o.request_timeout = milliseconds(1000);
  o.reconnect_backoff = milliseconds(50);
  return o;
}

}  // namespace

TEST_CASE("a password: the right one round-trips; a wrong one, or none, is store_auth_failed and stores nothing") {
  temp_dir dir;
  redis_server server = unix_server(dir, {"--requirepass", std::string(password)}, std::string(password));
  server.start();
  kv_redis_store_options o = quick();
  SECTION("the right password, the store and its waits used from 2 threads") {
    o.password = password;
    kv_redis_store store({unix_endpoint(dir)}, o);
    std::vector<std::thread> threads;
    std::vector<ghostlink::error_code> waited(2);
    std::array<bool, 2> round_trips{};
    for (unsigned t = 0; t < 2; ++t)
      threads.emplace_back([&, t] {
        auto done = std::make_shared<std::promise<ghostlink::error_code>>();
        std::future<ghostlink::error_code> ready = done->get_future();
        store.async_wait_ready([done](ghostlink::error_code ec) { done->set_value(ec); });
        if (ready.wait_for(std::chrono::seconds(10)) == std::future_status::ready) waited[t] = ready.get();
        store.put(std::make_shared<bytes_value>(hash_of(t), bytes_of(t)));
        store.flush();
        const std::optional<std::vector<bytes>> got = try_fetch_all(store, {hash_of(t)});
        round_trips[t] = got && got->at(0) == bytes_of(t);
      });
    for (std::thread& t : threads) t.join();
    CHECK(waited[0] == ghostlink::error_code());
    CHECK(waited[1] == ghostlink::error_code());
    CHECK(round_trips[0]);
    CHECK(round_trips[1]);
    const kv_store_stats s = store.stats();
    CHECK(s.stored == 2);
    CHECK(s.auth_errors == 0);
    CHECK(s.last_error == std::error_code());
    // Stored under the documented key, as the server tells with the password.
    const detail::redis_reply raw =
        call(server.endpoint(), {"GET", kv_redis_store::key_of(hash_of(1))}, milliseconds(2000), password);
    CHECK(raw.bytes == bytes_of(1));
  }
  SECTION("a wrong password") {
    o.password = "not-the-password";
    kv_redis_store store({unix_endpoint(dir)}, o);
    check_refused(store, kv_errc::store_auth_failed);
    CHECK(store.stats().last_error.message().find("not-the-password") == std::string::npos);
  }
  SECTION("no password: the server says NOAUTH") {
    kv_redis_store store({unix_endpoint(dir)}, o);
    check_refused(store, kv_errc::store_auth_failed);
  }
  // Nothing the refused stores put reached the server.
  CHECK(call(server.endpoint(), {"GET", kv_redis_store::key_of(hash_of(7))}, milliseconds(2000), password).kind ==
        reply_type::nil);
}

TEST_CASE("an ACL user limited to ghostlink:* and GET/SET round-trips; one without SET gets NOPERM write errors") {
  temp_dir dir;
  redis_server server = unix_server(dir, {"--requirepass", std::string(password)}, std::string(password));
  server.start();
  const kv_redis_endpoint admin = server.endpoint();
  REQUIRE(text(call(admin, {"ACL", "SETUSER", "ghost", "on", ">ghost-pw", "~ghostlink:*", "+get", "+set"},
                    milliseconds(2000), password)) == "OK");
  REQUIRE(text(call(admin, {"ACL", "SETUSER", "reader", "on", ">reader-pw", "~ghostlink:*", "+get"}, milliseconds(2000),
                    password)) == "OK");
  kv_redis_store_options o = quick();
  SECTION("the minimal ACL") {
    o.username = "ghost";
    o.password = "ghost-pw";
    kv_redis_store store({unix_endpoint(dir)}, o);
    CHECK(wait_ready(store) == ghostlink::error_code());
    check_round_trip(store, 3);
    CHECK(store.stats().auth_errors == 0);
  }
  SECTION("a user without +set: connected, but every put refused (NOPERM)") {
    o.username = "reader";
    o.password = "reader-pw";
    kv_redis_store store({unix_endpoint(dir)}, o);
    CHECK(wait_ready(store) == ghostlink::error_code());
    CHECK(!put_flushed(store, hash_of(4), bytes_of(4)));
    const kv_store_stats s = store.stats();
    CHECK(s.write_errors == 1);
    CHECK(s.auth_errors >= 1);
    CHECK(s.last_error == make_error_code(kv_errc::store_auth_failed));
    CHECK(fetch_all(store, {hash_of(4)}).at(0).empty());  // GET allowed: a plain miss
  }
  SECTION("a user's wrong password") {
    o.username = "ghost";
    o.password = "reader-pw";
    kv_redis_store store({unix_endpoint(dir)}, o);
    check_refused(store, kv_errc::store_auth_failed);
  }
}

TEST_CASE("SELECT: the database asked for is the one written; one the server lacks is store_auth_failed") {
  temp_dir dir;
  redis_server server = unix_server(dir, {"--databases", "4"});
  server.start();
  SECTION("database 3") {
    kv_redis_store store({unix_endpoint(dir)}, quick({.database = 3}));
    CHECK(wait_ready(store) == ghostlink::error_code());
    check_round_trip(store, 5);
    CHECK(call(server.endpoint(), {"DBSIZE"}).integer == 0);  // database 0 untouched
  }
  SECTION("database 9 of 4") {
    kv_redis_store store({unix_endpoint(dir)}, quick({.database = 9}));
    check_refused(store, kv_errc::store_auth_failed);
  }
}

namespace {

/// Certificates made by `openssl` in a directory: a CA, a server's for
/// localhost and 127.0.0.1 signed by it, a client's signed by it, and
/// another CA that signed none of them.
struct certificates {
  certificates() {
    write(dir.path / "server.ext", "subjectAltName=DNS:localhost,IP:127.0.0.1\n");
    make_ca("ca");
    make_ca("other-ca");
    make_signed("server", "localhost", "server.ext");
    make_signed("client", "ghostlink-client", "");
  }
  std::string path(std::string_view name) const { return (dir.path / name).string(); }

  temp_dir dir;

 private:
  static void write(const fs::path& p, std::string_view text) { std::ofstream(p) << text; }
  static void openssl(std::vector<std::string> args) {
    args.insert(args.begin(), "/usr/bin/openssl");
    if (!fs::exists(args.front())) args.front() = ghostlink::test::redis::find_program("openssl").string();
    const auto [status, output] = run_program(args);
    INFO(output);
    REQUIRE(status == 0);
  }
  void make_ca(const std::string& name) const {
    openssl({"req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             path(name + ".key"), "-out", path(name + ".crt"), "-days", "2", "-subj", "/CN=ghostlink test " + name});
  }
  void make_signed(const std::string& name, const std::string& cn, const std::string& ext) const {
    openssl({"req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             path(name + ".key"), "-out", path(name + ".csr"), "-subj", "/CN=" + cn});
    std::vector<std::string> sign{"x509",
                                  "-req",
                                  "-in",
                                  path(name + ".csr"),
                                  "-CA",
                                  path("ca.crt"),
                                  "-CAkey",
                                  path("ca.key"),
                                  "-CAcreateserial",
                                  "-out",
                                  path(name + ".crt"),
                                  "-days",
                                  "2"};
    if (!ext.empty()) sign.insert(sign.end(), {"-extfile", path(ext)});
    openssl(sign);
  }
};

/// A free loopback port (its bus port unused: none here).
std::uint16_t free_port() {
  auto port = static_cast<std::uint16_t>(22100 + std::random_device()() % 2000);
  for (int tries = 0; tries < 100 && !port_free(port); ++tries) ++port;
  REQUIRE(port_free(port));
  return port;
}

/// A TLS-only server (TCP), administered on its unix socket.
struct tls_server {
  explicit tls_server(bool auth_clients)
      : port(free_port()),
        server(unix_server(dir,
                           {"--tls-port", std::to_string(port), "--bind", "127.0.0.1", "--tls-cert-file",
                            certs.path("server.crt"), "--tls-key-file", certs.path("server.key"), "--tls-ca-cert-file",
                            certs.path("ca.crt"), "--tls-auth-clients", auth_clients ? "yes" : "no"})) {
    server.start();
  }
  kv_redis_endpoint endpoint() const { return {.host = "127.0.0.1", .port = port}; }
  kv_redis_tls_options tls() const { return {.ca_file = certs.path("ca.crt")}; }

  certificates certs;
  temp_dir dir;
  std::uint16_t port;
  redis_server server;
};

}  // namespace

TEST_CASE("TLS: the right CA round-trips; a wrong CA or server name is store_tls_failed; verify off works") {
  tls_server s(false);
  kv_redis_store_options o = quick();
  o.tls = s.tls();
  SECTION("the right CA, the address checked against the certificate's IP") {
    kv_redis_store store({s.endpoint()}, o);
    CHECK(wait_ready(store) == ghostlink::error_code());
    check_round_trip(store, 11);
    CHECK(store.stats().tls_errors == 0);
  }
  SECTION("the right CA and server name localhost (sent as SNI)") {
    o.tls->server_name = "localhost";
    kv_redis_store store({s.endpoint()}, o);
    CHECK(wait_ready(store) == ghostlink::error_code());
    check_round_trip(store, 12);
  }
  SECTION("a CA that did not sign the server's certificate") {
    o.tls->ca_file = s.certs.path("other-ca.crt");
    kv_redis_store store({s.endpoint()}, o);
    check_refused(store, kv_errc::store_tls_failed);
  }
  SECTION("a server name the certificate does not carry") {
    o.tls->server_name = "redis.example.org";
    kv_redis_store store({s.endpoint()}, o);
    check_refused(store, kv_errc::store_tls_failed);
  }
  SECTION("verification off, with the wrong CA") {
    o.tls->ca_file = s.certs.path("other-ca.crt");
    o.tls->verify = false;
    kv_redis_store store({s.endpoint()}, o);
    CHECK(wait_ready(store) == ghostlink::error_code());
    check_round_trip(store, 13);
  }
  SECTION("TLS to a plain TCP server: the handshake fails") {
    // A plain TCP server: the handshake fails.
    temp_dir plain_dir;
    const std::uint16_t port = free_port();
    redis_server plain({"--port", std::to_string(port), "--bind", "127.0.0.1", "--dir", plain_dir.path.string()},
                       {.host = "127.0.0.1", .port = port});
    plain.start();
    kv_redis_store store({{.host = "127.0.0.1", .port = port}}, o);
    check_refused(store, kv_errc::store_tls_failed);
  }
}

TEST_CASE("TLS with client certificates required: the store's certificate is accepted; none is store_tls_failed") {
  tls_server s(true);
  kv_redis_store_options o = quick();
  o.tls = s.tls();
  SECTION("a client certificate signed by the server's CA") {
    o.tls->certificate_file = s.certs.path("client.crt");
    o.tls->private_key_file = s.certs.path("client.key");
    kv_redis_store store({s.endpoint()}, o);
    CHECK(wait_ready(store) == ghostlink::error_code());
    check_round_trip(store, 14);
  }
  SECTION("no client certificate") {
    kv_redis_store store({s.endpoint()}, o);
    check_refused(store, kv_errc::store_tls_failed);
  }
}

TEST_CASE("a cluster with a password: entries round-trip over every master; a wrong password fails clearly") {
  cluster_nodes nodes{std::string(password)};
  kv_redis_store_options o = quick({.cluster = true});
  SECTION("the right password") {
    o.password = password;
    kv_redis_store store(nodes.endpoints(), o);
    CHECK(wait_ready(store) == ghostlink::error_code());
    std::vector<kv_block_hash> hashes;
    for (unsigned i = 0; i < 48; ++i) {
      hashes.push_back(hash_of(100 + i));
      store.put(std::make_shared<bytes_value>(hashes.back(), bytes_of(i)));
    }
    store.flush();
    CHECK(store.stats().stored == 48);
    const std::vector<bytes> got = fetch_all(store, hashes);
    for (unsigned i = 0; i < 48; ++i) CHECK(got[i] == bytes_of(i));
    for (std::size_t n = 0; n < nodes.size(); ++n) CHECK(nodes.dbsize(n) > 0);  // every master holds some
    CHECK(store.stats().auth_errors == 0);
  }
  SECTION("a wrong password") {
    o.password = "wrong";
    kv_redis_store store(nodes.endpoints(), o);
    check_refused(store, kv_errc::store_auth_failed);
  }
}

namespace {

/// The threads of this process now.
std::size_t thread_count() {
  std::size_t n = 0;
  const fs::path task("/proc/self/task");
  std::error_code ec;
  for (auto it = fs::directory_iterator(task, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) ++n;
  return n;
}

/// Constructing a store on `endpoints` with `o` throws invalid_config, having started no thread.
void check_invalid(std::vector<kv_redis_endpoint> endpoints, const kv_redis_store_options& o) {
  const std::size_t threads = thread_count();
  try {
    kv_redis_store store(std::move(endpoints), o);
    FAIL("no exception");
  } catch (const std::system_error& e) {
    CHECK(e.code() == make_error_code(kv_errc::invalid_config));
  }
  CHECK(thread_count() == threads);
}

}  // namespace

TEST_CASE("bad options throw invalid_config (or invalid_argument, as documented) before anything starts") {
  temp_dir dir;
  const kv_redis_endpoint local{.unix_socket = (dir.path / "none.sock").string()};
  const kv_redis_endpoint tcp{.host = "127.0.0.1", .port = 6379};
  check_invalid({local}, {.ttl_seconds = 0});
  check_invalid({local}, {.ttl_seconds = kv_redis_store::max_ttl_seconds + 1});
  check_invalid({{.host = "", .port = 6379}}, {});
  check_invalid({{.host = "127.0.0.1", .port = 0}}, {});
  check_invalid({tcp}, {.database = 1, .cluster = true});
  check_invalid({local}, {.database = kv_redis_store::max_database + 1});
  check_invalid({local}, {.username = "ghost"});
  check_invalid({local}, {.tls = kv_redis_tls_options{}});
  check_invalid({tcp}, {.tls = kv_redis_tls_options{.ca_file = (dir.path / "missing.pem").string()}});
  check_invalid({tcp}, {.tls = kv_redis_tls_options{.ca_directory = (dir.path / "missing").string()}});
  check_invalid({tcp}, {.tls = kv_redis_tls_options{.certificate_file = (dir.path / "missing.crt").string()}});
  check_invalid({tcp}, {.tls = kv_redis_tls_options{.certificate_file = (dir.path / "c.crt").string(),
                                                    .private_key_file = (dir.path / "c.key").string()}});
  check_invalid({local}, {.connect_timeout = milliseconds(0)});
  CHECK_THROWS_AS(kv_redis_store({local}, {.connections = 0}), std::invalid_argument);
  CHECK_THROWS_AS(kv_redis_store({}, {}), std::invalid_argument);
  CHECK_THROWS_AS(kv_redis_store({local}, {.cluster = true}), std::invalid_argument);
  // The bounds themselves are taken.
  CHECK_NOTHROW(kv_redis_store(
      {local}, quick({.database = kv_redis_store::max_database, .ttl_seconds = kv_redis_store::max_ttl_seconds})));
}

namespace {

/// This process's peak resident memory (VmHWM), in bytes.
std::size_t peak_resident() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.starts_with("VmHWM:")) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

/// Resets the peak to the resident memory now (Linux's clear_refs "5"); whether it could.
bool reset_peak() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

}  // namespace

TEST_CASE("a value planted larger than the read cap is a miss, skipped unbuffered; the stream stays in sync") {
  temp_dir dir;
  redis_server server = unix_server(dir, {});
  server.start();
  // A request may take long here: 64 MiB cross the socket to be skipped,
  // slowly under a sanitizer on a busy machine. Past its timeout the
  // connection would be closed and the stream's sync not tested.
  kv_redis_store_options o = quick({.connections = 1});
  o.request_timeout = milliseconds(30000);
  kv_redis_store store({unix_endpoint(dir)}, o);
  constexpr std::size_t big = std::size_t{64} << 20;
  constexpr std::size_t cap = std::size_t{1} << 20;
  store.limit_value_size(cap / 2);
  store.limit_value_size(cap);
  store.limit_value_size(cap / 4);  // the largest holds
  // 64 MiB made by the server itself (SETRANGE pads with zeros): the test
  // never holds it.
  const std::string big_key = kv_redis_store::key_of(hash_of(20));
  REQUIRE(call(server.endpoint(), {"SETRANGE", big_key, std::to_string(big - 1), "x"}).integer ==
          static_cast<std::int64_t>(big));
  const bytes small = bytes_of(21, cap);  // exactly the cap: taken
  REQUIRE(put_flushed(store, hash_of(21), small));
  CHECK(wait_ready(store) == ghostlink::error_code());

  const bool peak_reset = reset_peak();
  const std::size_t before = peak_resident();
  CHECK(fetch_all(store, {hash_of(20)}).at(0).empty());
  // On the one connection: a value, the oversized one, a value again.
  const std::vector<bytes> got = fetch_all(store, {hash_of(21), hash_of(20), hash_of(21)});
  const std::size_t after = peak_resident();
  CHECK(got[0] == small);
  CHECK(got[1].empty());
  CHECK(got[2] == small);
  const kv_store_stats s = store.stats();
  CHECK(s.oversized == 2);
  CHECK(s.hits == 2);
  CHECK(s.last_error == std::error_code());  // a cap is no error
  INFO("peak reset: " << peak_reset << ", before " << before << ", after " << after);
  CHECK(after < before + (std::size_t{16} << 20));
}

}  // namespace redis_security_tests
