#pragma once
// Redis for the Redis-tier scenarios (redis_store, redis_store_tls,
// attach_from_redis): a redis-server of the benchmark's own on a unix
// socket in a temporary directory (and, for TLS, on a loopback TLS port
// with a CA and certificate the `openssl` command makes there), stopped by
// its process id; and the baseline's client, plain pipelining on blocking
// sockets (TLS: OpenSSL's SSL_read and SSL_write on them), one thread a
// connection: every command of a connection written at once, then every
// reply read in order, a bulk reply read straight into its destination.

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <signal.h>  // NOLINT(modernize-deprecated-headers): POSIX kill
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "files.hpp"
#include "workload.hpp"

extern char** environ;  // NOLINT(readability-redundant-declaration): POSIX declares it nowhere

namespace ghostlink::bench::redis {

/// redis-server on PATH, or empty.
inline std::filesystem::path find_server() {
  const char* path = std::getenv("PATH");  // NOLINT(concurrency-mt-unsafe)
  std::string_view rest = path != nullptr ? path : "";
  while (!rest.empty()) {
    const std::size_t colon = rest.find(':');
    std::filesystem::path candidate = std::filesystem::path(rest.substr(0, colon)) / "redis-server";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
  }
  return {};
}

/// A blocking socket connected to the unix socket `path`, or -1.
inline int connect_unix(const std::filesystem::path& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof address.sun_path - 1);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0) return fd;
  if (fd >= 0) ::close(fd);
  return -1;
}

/// A blocking TCP socket connected to 127.0.0.1:`port` (TCP_NODELAY), or -1.
inline int connect_loopback(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
  }
  if (fd >= 0) ::close(fd);
  return -1;
}

/// Where the baseline connects: the unix socket, or (`tls` set) TLS to
/// 127.0.0.1:`tls_port`, its certificate verified against `ca_file`.
struct target {
  std::filesystem::path socket{};
  std::uint16_t tls_port = 0;
  std::string ca_file{};
  bool tls() const noexcept { return tls_port != 0; }
};

/// A blocking connection to a target; fails the scenario if it cannot.
class connection {
 public:
  connection(const target& where, std::string scenario)
      : scenario_(std::move(scenario)),
        fd_(where.tls() ? connect_loopback(where.tls_port) : connect_unix(where.socket)) {
    if (fd_ < 0) fail(scenario_, "cannot connect to Redis");
    if (where.tls()) handshake(where.ca_file);
  }
  connection(const std::filesystem::path& socket, std::string scenario)
      : connection(target{.socket = socket}, std::move(scenario)) {}
  connection(const connection&) = delete;
  connection& operator=(const connection&) = delete;
  ~connection() {
    if (ssl_ != nullptr) SSL_free(ssl_);
    if (ctx_ != nullptr) SSL_CTX_free(ctx_);
    ::close(fd_);
  }

  void write_all(std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ssl_ != nullptr
                            ? SSL_write(ssl_, bytes.data(), int(std::min<std::size_t>(bytes.size(), 1 << 30)))
                            : ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) fail(scenario_, "a write to Redis failed");
      bytes.remove_prefix(std::size_t(n));
    }
  }
  /// One reply line (without its CRLF).
  std::string line() {
    std::string out;
    for (;;) {
      if (start_ == end_) fill();
      const char* at = static_cast<const char*>(std::memchr(buffer_.data() + start_, '\n', end_ - start_));
      const std::size_t stop = at ? std::size_t(at - buffer_.data()) + 1 : end_;
      out.append(buffer_.data() + start_, stop - start_);
      start_ = stop;
      if (at) break;
    }
    out.resize(out.size() - 2);
    return out;
  }
  /// A bulk reply's `n` bytes and its CRLF, the bytes into `out` (sized n).
  void bulk(std::span<std::byte> out) {
    std::size_t done = std::min(out.size(), end_ - start_);
    std::memcpy(out.data(), buffer_.data() + start_, done);
    start_ += done;
    while (done < out.size()) {  // the rest straight from the socket
      const ssize_t n = receive(out.data() + done, out.size() - done);
      if (n <= 0) fail(scenario_, "a read from Redis failed");
      done += std::size_t(n);
    }
    if (!line().empty()) fail(scenario_, "a bulk reply of Redis was not followed by CRLF");
  }

 private:
  void handshake(const std::string& ca_file) {
    ctx_ = SSL_CTX_new(TLS_client_method());
    if (ctx_ == nullptr || SSL_CTX_set_min_proto_version(ctx_, TLS1_2_VERSION) != 1 ||
        SSL_CTX_load_verify_locations(ctx_, ca_file.c_str(), nullptr) != 1)
      fail(scenario_, "cannot make a TLS context");
    SSL_CTX_set_verify(ctx_, SSL_VERIFY_PEER, nullptr);
    ssl_ = SSL_new(ctx_);
    if (ssl_ == nullptr || SSL_set1_host(ssl_, "127.0.0.1") != 1 || SSL_set_fd(ssl_, fd_) != 1 ||
        SSL_connect(ssl_) != 1)
      fail(scenario_, "the TLS handshake with Redis failed");
  }
  ssize_t receive(void* into, std::size_t n) {
    if (ssl_ != nullptr) return SSL_read(ssl_, into, int(std::min<std::size_t>(n, 1 << 30)));
    return ::recv(fd_, into, n, 0);
  }
  void fill() {
    start_ = 0;
    const ssize_t n = receive(buffer_.data(), buffer_.size());
    if (n <= 0) fail(scenario_, "a read from Redis failed");
    end_ = std::size_t(n);
  }

  std::string scenario_;
  int fd_ = -1;
  SSL_CTX* ctx_ = nullptr;
  SSL* ssl_ = nullptr;
  std::vector<char> buffer_ = std::vector<char>(std::size_t{1} << 16);
  std::size_t start_ = 0, end_ = 0;
};

/// `*N\r\n$len\r\narg\r\n...` appended to `out`.
inline void command(std::string& out, std::initializer_list<std::string_view> args) {
  // Appended piece by piece, not "*" + string: GCC 12's -Wrestrict false positive (bug 105329).
  out += '*';
  out += std::to_string(args.size());
  out += "\r\n";
  for (std::string_view a : args) {
    out += '$';
    out += std::to_string(a.size());
    out += "\r\n";
    out += a;
    out += "\r\n";
  }
}

/// Runs `args` (the program first, found on PATH) to its end, its output
/// to /dev/null; whether it exited with 0.
inline bool run_quietly(std::vector<std::string> args) {
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t quiet;
  posix_spawn_file_actions_init(&quiet);
  posix_spawn_file_actions_addopen(&quiet, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&quiet, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int spawned = ::posix_spawnp(&pid, argv[0], &quiet, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&quiet);
  int status = 0;
  return spawned == 0 && ::waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/// A loopback port nothing listens on now (below the ephemeral range).
inline std::uint16_t free_port(const std::string& scenario) {
  auto port = static_cast<std::uint16_t>(24200 + std::random_device()() % 4000);
  for (int tries = 0; tries < 200; ++tries, ++port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const bool bound = fd >= 0 && ::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0;
    if (fd >= 0) ::close(fd);
    if (bound) return port;
  }
  fail(scenario, "no free loopback port");
}

/// A redis-server on a unix socket of a temporary directory, with no
/// persistence and no TCP port, stopped by its process id. With `tls`,
/// also TLS on a loopback port (`tls-auth-clients no`), its certificate
/// for 127.0.0.1 signed by a CA made there (`ca_file()`).
class server {
 public:
  explicit server(const std::string& scenario, bool tls = false) : dir_(scenario) {
    const std::filesystem::path program = find_server();
    if (program.empty()) fail(scenario, "redis-server is not on PATH (Debian: redis-server)");
    std::vector<std::string> args{
        program.string(), "--port", "0",     "--unixsocket",     socket().string(), "--save", "",
        "--appendonly",   "no",     "--dir", dir_.path.string(), "--loglevel",      "warning"};
    if (tls) {
      make_certificates(scenario);
      tls_port_ = free_port(scenario);
      for (const std::string& a :
           {std::string("--tls-port"), std::to_string(tls_port_), std::string("--bind"), std::string("127.0.0.1"),
            std::string("--tls-cert-file"), file("server.crt"), std::string("--tls-key-file"), file("server.key"),
            std::string("--tls-ca-cert-file"), ca_file(), std::string("--tls-auth-clients"), std::string("no")})
        args.push_back(a);
    }
    std::vector<char*> argv;
    argv.reserve(args.size() + 1);
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t quiet;  // its output to /dev/null
    posix_spawn_file_actions_init(&quiet);
    posix_spawn_file_actions_addopen(&quiet, 1, "/dev/null", O_WRONLY, 0);
    const int spawned = ::posix_spawn(&pid_, program.c_str(), &quiet, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&quiet);
    if (spawned != 0) fail(scenario, "cannot start redis-server");
    // Until it answers PING: 10 s at most, a connection attempt each 10 ms.
    for (int attempt = 0; attempt < 1000; ++attempt) {
      if (answers()) return;
      ::poll(nullptr, 0, 10);
    }
    stop();
    fail(scenario, "redis-server did not answer on " + socket().string());
  }
  server(const server&) = delete;
  server& operator=(const server&) = delete;
  ~server() { stop(); }

  std::filesystem::path socket() const { return dir_.path / "redis.sock"; }
  /// The TLS port; 0 without TLS.
  std::uint16_t tls_port() const noexcept { return tls_port_; }
  std::string ca_file() const { return file("ca.crt"); }
  /// Where the baseline connects: TLS if the server has it, else the unix socket.
  redis::target target() const { return {.socket = socket(), .tls_port = tls_port_, .ca_file = ca_file()}; }

 private:
  std::string file(const std::string& name) const { return (dir_.path / name).string(); }
  void make_certificates(const std::string& scenario) const {
    {
      std::FILE* ext = std::fopen(file("server.ext").c_str(), "w");
      if (ext == nullptr) fail(scenario, "cannot write the certificate's extensions");
      std::fputs("subjectAltName=IP:127.0.0.1\n", ext);
      std::fclose(ext);
    }
    const std::string ec = "ec_paramgen_curve:prime256v1";
    if (!run_quietly({"openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", ec, "-nodes", "-keyout", file("ca.key"),
                      "-out", ca_file(), "-days", "2", "-subj", "/CN=ghostlink bench CA"}) ||
        !run_quietly({"openssl", "req", "-newkey", "ec", "-pkeyopt", ec, "-nodes", "-keyout", file("server.key"),
                      "-out", file("server.csr"), "-subj", "/CN=127.0.0.1"}) ||
        !run_quietly({"openssl", "x509", "-req", "-in", file("server.csr"), "-CA", ca_file(), "-CAkey", file("ca.key"),
                      "-CAcreateserial", "-out", file("server.crt"), "-days", "2", "-extfile", file("server.ext")}))
      fail(scenario, "the openssl command could not make the TLS certificates");
  }

  bool answers() const {
    const int fd = connect_unix(socket());
    bool up = fd >= 0;
    if (up) {
      char reply[8] = {};
      up = ::send(fd, "PING\r\n", 6, MSG_NOSIGNAL) == 6 && ::recv(fd, reply, sizeof reply, 0) > 0 &&
           std::string_view(reply).starts_with("+PONG");
    }
    if (fd >= 0) ::close(fd);
    return up;
  }
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = 0;
  }

  temp_dir dir_;
  std::uint16_t tls_port_ = 0;
  pid_t pid_ = 0;
};

/// The baseline: `values` SET under `keys` (SET key value), pipelined
/// over `connections` connections (value i on connection i % connections),
/// one thread each: each command written as it is made, its value straight
/// from `values` (no copy), then every reply read; each must be +OK.
inline void raw_set(const target& socket, std::size_t connections, const std::vector<std::string>& keys,
                    const std::vector<std::span<const std::byte>>& values, const std::string& scenario) {
  std::vector<std::thread> threads;
  for (std::size_t c = 0; c < connections; ++c)
    threads.emplace_back([&, c] {
      connection link(socket, scenario);
      std::size_t sent = 0;
      for (std::size_t i = c; i < keys.size(); i += connections, ++sent) {
        std::string header;
        command(header, {"SET", keys[i]});
        header[1] = '3';  // three arguments: the value follows
        header += '$';
        header += std::to_string(values[i].size());
        header += "\r\n";
        link.write_all(header);
        link.write_all({reinterpret_cast<const char*>(values[i].data()), values[i].size()});
        link.write_all("\r\n");
      }
      for (std::size_t i = 0; i < sent; ++i)
        if (link.line() != "+OK") fail(scenario, "a raw SET failed");
    });
  for (auto& t : threads) t.join();
}

/// The baseline: GET of each of `keys` into `out[i]` (sized as the value),
/// pipelined as raw_set.
inline void raw_get(const target& socket, std::size_t connections, const std::vector<std::string>& keys,
                    std::vector<std::vector<std::byte>>& out, const std::string& scenario) {
  std::vector<std::thread> threads;
  for (std::size_t c = 0; c < connections; ++c)
    threads.emplace_back([&, c] {
      connection link(socket, scenario);
      std::string commands;
      for (std::size_t i = c; i < keys.size(); i += connections) command(commands, {"GET", keys[i]});
      link.write_all(commands);
      for (std::size_t i = c; i < keys.size(); i += connections) {
        std::string header = "$";
        header += std::to_string(out[i].size());
        if (link.line() != header) fail(scenario, "a raw GET found another value");
        link.bulk(out[i]);
      }
    });
  for (auto& t : threads) t.join();
}

}  // namespace ghostlink::bench::redis
