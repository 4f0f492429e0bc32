#pragma once
// redis-server processes of a test's own, and commands sent to them: the
// Redis store's tests (test_redis_store: one server on a unix socket;
// test_redis_cluster: a cluster of three on loopback TCP ports;
// test_redis_security: servers with passwords, ACL users, TLS). A server
// or cluster with a password is given it, and so are the commands sent.
//
// A server is found on PATH (without one the tests fail, saying so), run
// without persistence, and stopped by its process id.

#include <netinet/in.h>
#include <poll.h>
#include <signal.h>  // NOLINT(modernize-deprecated-headers): POSIX kill
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ghostlink/redis_store.hpp>

#include "store/redis/connection.hpp"
#include "testing/temp_dir.hpp"

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#ifdef GHOSTLINK_CATCH2_V3
#include <catch2/catch_test_macros.hpp>
#else
#include <catch2/catch.hpp>
#endif

namespace ghostlink::test::redis {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

/// `name` on PATH, or empty.
inline fs::path find_program(std::string_view name) {
  const char* path = std::getenv("PATH");  // NOLINT(concurrency-mt-unsafe)
  std::string_view rest = path != nullptr ? path : "";
  while (!rest.empty()) {
    const std::size_t colon = rest.find(':');
    fs::path candidate = fs::path(rest.substr(0, colon)) / name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
  }
  return {};
}

/// A connected socket to `where` (its unix socket, else 127.0.0.1:port), or -1.
inline int connect_to(const kv_redis_endpoint& where) {
  const bool unix_socket = !where.unix_socket.empty();
  const int fd = ::socket(unix_socket ? AF_UNIX : AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  int connected = -1;
  if (unix_socket) {
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, where.unix_socket.c_str(), sizeof address.sun_path - 1);
    connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address);
  } else {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(where.port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected = ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address);
  }
  if (connected != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

/// One command on a connection of its own (after `AUTH password` if a
/// password is given, its reply skipped), its reply read with our RESP
/// parser; a `failed` reply if the server does not answer within `wait`.
inline detail::redis_reply call(const kv_redis_endpoint& where, std::initializer_list<std::string_view> args,
                                milliseconds wait = milliseconds(2000), std::string_view password = {}) {
  using clock_type = std::chrono::steady_clock;
  detail::redis_reply reply;
  const int fd = connect_to(where);
  if (fd < 0) return reply;
  const std::string command =
      (password.empty() ? std::string() : detail::redis_command({"AUTH", password})) + detail::redis_command(args);
  std::size_t skip = password.empty() ? 0 : 1;  // replies before the one wanted
  std::size_t written = 0;
  while (written < command.size()) {
    const ssize_t n = ::send(fd, command.data() + written, command.size() - written, MSG_NOSIGNAL);
    if (n <= 0) break;
    written += static_cast<std::size_t>(n);
  }
  std::string in;
  const auto deadline = clock_type::now() + wait;
  while (written == command.size() && clock_type::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    char buffer[65536];
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n <= 0) break;
    in.append(buffer, static_cast<std::size_t>(n));
    detail::redis_reply parsed;
    std::size_t took = 0;
    while ((took = detail::parse_redis_reply(in, parsed)) != 0 && skip > 0) {
      in.erase(0, took);
      --skip;
    }
    if (took != 0) {
      reply = std::move(parsed);
      break;
    }
  }
  ::close(fd);
  return reply;
}

/// `call` on a unix socket.
inline detail::redis_reply call(const fs::path& socket, std::initializer_list<std::string_view> args,
                                milliseconds wait = milliseconds(2000), std::string_view password = {}) {
  return call(kv_redis_endpoint{.unix_socket = socket.string()}, args, wait, password);
}

inline std::string text(const detail::redis_reply& r) { return std::string(r.text()); }

/// Spawns `args` (the program first) with its output to a pipe; its pid,
/// or 0. `*output` receives the pipe's reading end.
inline pid_t spawn(std::vector<std::string> args, int* output) {
  int out[2];
  if (::pipe(out) != 0) return 0;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_adddup2(&actions, out[1], 2);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = ::posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  if (spawned != 0) {
    ::close(out[0]);
    return 0;
  }
  *output = out[0];
  return pid;
}

/// Runs `args` to its end: its exit status (-1: not run, or killed) and
/// its output (standard output and error).
inline std::pair<int, std::string> run_program(std::vector<std::string> args) {
  int output = -1;
  const pid_t pid = spawn(std::move(args), &output);
  if (pid == 0) return {-1, {}};
  std::string text;
  char buffer[4096];
  for (ssize_t n = 0; (n = ::read(output, buffer, sizeof buffer)) > 0;)
    text.append(buffer, static_cast<std::size_t>(n));
  ::close(output);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, text};
}

/// A redis-server of this test's own, without persistence, stopped by its
/// process id.
class redis_server {
 public:
  /// Started on unix socket `socket` (no TCP port), in its directory.
  explicit redis_server(const fs::path& socket)
      : redis_server({"--port", "0", "--unixsocket", socket.string(), "--dir", socket.parent_path().string()},
                     {.unix_socket = socket.string()}) {
    start();
  }
  /// Not started yet: with `args` (besides no persistence), answering PING
  /// at `where` (after `AUTH password` if given).
  redis_server(std::vector<std::string> args, kv_redis_endpoint where, std::string password = {})
      : args_(std::move(args)), where_(std::move(where)), password_(std::move(password)) {}
  redis_server(const redis_server&) = delete;
  redis_server& operator=(const redis_server&) = delete;
  ~redis_server() { stop(SIGTERM); }

  /// Starts it and waits (10 s at most) until it answers PING.
  void start() {
    if (!try_start()) FAIL("redis-server did not answer PING on " << describe() << " within 10 s");
  }
  /// Starts it; whether it answered PING within 10 s (else it is stopped).
  bool try_start() {
    using clock_type = std::chrono::steady_clock;
    const fs::path program = find_program("redis-server");
    if (program.empty()) FAIL("redis-server is not on PATH: the Redis store tests need it (Debian: redis-server)");
    std::vector<std::string> args{program.string(), "--save", "", "--appendonly", "no", "--loglevel", "warning"};
    args.insert(args.end(), args_.begin(), args_.end());
    pid_ = spawn(std::move(args), &output_);
    REQUIRE(pid_ != 0);
    const auto deadline = clock_type::now() + std::chrono::seconds(10);
    bool ready = false;
    while (!ready && clock_type::now() < deadline) {
      ready = text(call(where_, {"PING"}, milliseconds(200), password_)) == "PONG";
      if (ready) break;
      pollfd p{output_, POLLIN, 0};  // its output (or its exit) ends the wait early
      if (::poll(&p, 1, 50) > 0) {
        char buffer[4096];
        if (::read(output_, buffer, sizeof buffer) <= 0) break;  // exited
      }
    }
    if (!ready) stop(SIGKILL);
    return ready;
  }

  /// Sends `sig` (after SIGCONT for a stopped server, unless SIGKILL) and reaps it.
  void stop(int sig) {
    if (pid_ <= 0) return;
    // A stopped server acts on SIGTERM only once continued; SIGKILL ends it
    // stopped, and must: continued first, it could still answer what waits.
    if (sig != SIGKILL) ::kill(pid_, SIGCONT);
    ::kill(pid_, sig);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = 0;
    if (output_ >= 0) ::close(output_);
    output_ = -1;
  }
  void pause() const { REQUIRE(::kill(pid_, SIGSTOP) == 0); }
  void resume() const { REQUIRE(::kill(pid_, SIGCONT) == 0); }
  const kv_redis_endpoint& endpoint() const noexcept { return where_; }

 private:
  std::string describe() const {
    return where_.unix_socket.empty() ? where_.host + ":" + std::to_string(where_.port) : where_.unix_socket;
  }

  std::vector<std::string> args_;
  kv_redis_endpoint where_;
  std::string password_;
  pid_t pid_ = 0;
  int output_ = -1;
};

/// Whether 127.0.0.1:`port` can be bound now.
inline bool port_free(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool bound = ::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0;
  ::close(fd);
  return bound;
}

/// Three redis-server masters of one Redis Cluster on loopback ports (each
/// with its cluster bus on port + 10000), every slot assigned, the state
/// ok on all three. A master's slots stay served while another is down
/// (node timeout 30 s, full coverage not required).
class cluster_nodes {
 public:
  /// With `password`: every master's `requirepass` and `masterauth`.
  explicit cluster_nodes(std::string password = {}) : password_(std::move(password)) {
    using clock_type = std::chrono::steady_clock;
    const fs::path cli = find_program("redis-cli");
    if (cli.empty()) FAIL("redis-cli is not on PATH: the Redis Cluster tests need it (Debian: redis-tools)");
    // Ports below 22050, so the bus ports stay below the ephemeral range.
    auto port = static_cast<std::uint16_t>(20000 + std::random_device()() % 2000);
    for (std::size_t tries = 0; servers_.size() < 3 && tries < 50; ++tries, ++port) {
      if (!port_free(port) || !port_free(static_cast<std::uint16_t>(port + 10000))) continue;
      const std::string p = std::to_string(port);
      std::vector<std::string> args{"--port",
                                    p,
                                    "--bind",
                                    "127.0.0.1",
                                    "--cluster-enabled",
                                    "yes",
                                    "--cluster-config-file",
                                    (dir_.path / ("nodes-" + p + ".conf")).string(),
                                    "--dir",
                                    dir_.path.string(),
                                    "--cluster-node-timeout",
                                    "30000",
                                    "--cluster-require-full-coverage",
                                    "no"};
      if (!password_.empty()) args.insert(args.end(), {"--requirepass", password_, "--masterauth", password_});
      auto server = std::make_unique<redis_server>(std::move(args),
                                                   kv_redis_endpoint{.host = "127.0.0.1", .port = port}, password_);
      if (server->try_start()) servers_.push_back(std::move(server));  // else taken meanwhile: the next port
    }
    REQUIRE(servers_.size() == 3);
    std::vector<std::string> create = cli_args(cli);
    for (const char* a : {"--cluster", "create"}) create.emplace_back(a);
    for (const auto& s : servers_) create.push_back("127.0.0.1:" + std::to_string(s->endpoint().port));
    for (const char* a : {"--cluster-replicas", "0", "--cluster-yes"}) create.emplace_back(a);
    const auto [status, output] = run_program(create);
    INFO(output);
    REQUIRE(status == 0);
    // Each poll is one redis-cli run (its own pacing), a bounded number of
    // them: a master turns ok about 2 s after it started (Redis's writable delay).
    const auto deadline = clock_type::now() + std::chrono::seconds(30);
    for (const auto& s : servers_) {
      bool ok = false;
      for (int poll = 0; !ok && poll < 20000 && clock_type::now() < deadline; ++poll) {
        std::vector<std::string> info = cli_args(cli);
        for (std::string a :
             {std::string("-p"), std::to_string(s->endpoint().port), std::string("cluster"), std::string("info")})
          info.push_back(std::move(a));
        ok = run_program(std::move(info)).second.find("cluster_state:ok") != std::string::npos;
      }
      REQUIRE(ok);
    }
  }

  std::vector<kv_redis_endpoint> endpoints() const {
    std::vector<kv_redis_endpoint> out;
    for (const auto& s : servers_) out.push_back(s->endpoint());
    return out;
  }
  const kv_redis_endpoint& endpoint(std::size_t i) const { return servers_.at(i)->endpoint(); }
  std::size_t size() const { return servers_.size(); }
  void stop(std::size_t i, int sig) { servers_.at(i)->stop(sig); }

  /// The master that holds `key` (answers its GET without a redirect).
  std::size_t owner_of(const std::string& key) const {
    for (std::size_t i = 0; i < size(); ++i)
      if (call(endpoint(i), {"GET", key}, milliseconds(2000), password_).kind != detail::redis_reply::type::error)
        return i;
    FAIL("no master answers GET " << key);
    return 0;
  }
  /// `key`'s value on master `i` (a nil or an error: empty).
  std::vector<std::byte> value_at(std::size_t i, const std::string& key) const {
    detail::redis_reply r = call(endpoint(i), {"GET", key}, milliseconds(2000), password_);
    return r.kind == detail::redis_reply::type::bulk ? std::move(r.bytes) : std::vector<std::byte>{};
  }
  std::int64_t dbsize(std::size_t i) const {
    return call(endpoint(i), {"DBSIZE"}, milliseconds(2000), password_).integer;
  }
  std::string id(std::size_t i) const {
    return text(call(endpoint(i), {"CLUSTER", "MYID"}, milliseconds(2000), password_));
  }

  /// How many `-<kind>` errors (MOVED, ASK) master `i` has replied.
  std::int64_t errors(std::size_t i, const std::string& kind) const {
    const std::string info = text(call(endpoint(i), {"INFO", "errorstats"}, milliseconds(2000), password_));
    const std::string field = "errorstat_" + kind + ":count=";
    const std::size_t at = info.find(field);
    return at == std::string::npos ? 0 : std::stoll(info.substr(at + field.size()));
  }

  /// Moves `slot` from master `from` to master `to`: importing and
  /// migrating, every key of it migrated; then, if `finish`, the slot
  /// given to `to` on every master (else it stays migrating: ASK).
  void move_slot(std::uint16_t slot, std::size_t from, std::size_t to, bool finish) const {
    const std::string s = std::to_string(slot), from_id = id(from), to_id = id(to);
    REQUIRE(text(call(endpoint(to), {"CLUSTER", "SETSLOT", s, "IMPORTING", from_id})) == "OK");
    REQUIRE(text(call(endpoint(from), {"CLUSTER", "SETSLOT", s, "MIGRATING", to_id})) == "OK");
    const detail::redis_reply keys = call(endpoint(from), {"CLUSTER", "GETKEYSINSLOT", s, "1000"});
    REQUIRE(keys.kind == detail::redis_reply::type::array);
    REQUIRE(!keys.elements.empty());
    const std::string to_port = std::to_string(endpoint(to).port);
    for (const detail::redis_reply& key : keys.elements)
      REQUIRE(text(call(endpoint(from), {"MIGRATE", "127.0.0.1", to_port, key.text(), "0", "5000"})) == "OK");
    if (!finish) return;
    for (std::size_t i : {to, from, 3 - to - from})
      REQUIRE(text(call(endpoint(i), {"CLUSTER", "SETSLOT", s, "NODE", to_id})) == "OK");
  }

 private:
  /// redis-cli, with the password if there is one.
  std::vector<std::string> cli_args(const fs::path& cli) const {
    std::vector<std::string> out{cli.string()};
    if (!password_.empty()) out.insert(out.end(), {"-a", password_, "--no-auth-warning"});
    return out;
  }

  std::string password_;
  ghostlink::testing::temp_dir dir_;
  std::vector<std::unique_ptr<redis_server>> servers_;
};

}  // namespace ghostlink::test::redis
