#pragma once
// Redis for the Redis-tier scenarios (redis_store, attach_from_redis): a
// redis-server of the benchmark's own on a unix socket in a temporary
// directory, stopped by its process id; and the baseline's client, plain
// pipelining on blocking sockets, one thread a connection: every command
// of a connection written at once, then every reply read in order, a bulk
// reply read straight into its destination.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>  // NOLINT(modernize-deprecated-headers): POSIX kill
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <optional>
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

/// A blocking connection to a unix socket; fails the scenario if it cannot.
class connection {
 public:
  connection(const std::filesystem::path& socket, std::string scenario)
      : scenario_(std::move(scenario)), fd_(connect_unix(socket)) {
    if (fd_ < 0) fail(scenario_, "cannot connect to " + socket.string());
  }
  connection(const connection&) = delete;
  connection& operator=(const connection&) = delete;
  ~connection() { ::close(fd_); }

  void write_all(std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
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
      const ssize_t n = ::recv(fd_, out.data() + done, out.size() - done, 0);
      if (n <= 0) fail(scenario_, "a read from Redis failed");
      done += std::size_t(n);
    }
    if (!line().empty()) fail(scenario_, "a bulk reply of Redis was not followed by CRLF");
  }

 private:
  void fill() {
    start_ = 0;
    const ssize_t n = ::recv(fd_, buffer_.data(), buffer_.size(), 0);
    if (n <= 0) fail(scenario_, "a read from Redis failed");
    end_ = std::size_t(n);
  }

  std::string scenario_;
  int fd_ = -1;
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

/// A redis-server on a unix socket of a temporary directory, with no
/// persistence and no TCP port, stopped by its process id.
class server {
 public:
  explicit server(const std::string& scenario) : dir_(scenario) {
    const std::filesystem::path program = find_server();
    if (program.empty()) fail(scenario, "redis-server is not on PATH (Debian: redis-server)");
    std::vector<std::string> args{
        program.string(), "--port", "0",     "--unixsocket",     socket().string(), "--save", "",
        "--appendonly",   "no",     "--dir", dir_.path.string(), "--loglevel",      "warning"};
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

 private:
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
  pid_t pid_ = 0;
};

/// The baseline: `values` SET under `keys` (SET key value), pipelined
/// over `connections` connections (value i on connection i % connections),
/// one thread each: each command written as it is made, its value straight
/// from `values` (no copy), then every reply read; each must be +OK.
inline void raw_set(const std::filesystem::path& socket, std::size_t connections, const std::vector<std::string>& keys,
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
inline void raw_get(const std::filesystem::path& socket, std::size_t connections, const std::vector<std::string>& keys,
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
