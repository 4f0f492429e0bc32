#pragma once
// Files for the disk-tier scenarios (save_load, decode_with_offload,
// attach_from_disk): a temporary directory removed with everything in it,
// and the plain POSIX I/O their baselines do, each call checked (a failed
// baseline ends the benchmark, as fail() does).

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <system_error>

#include "testing/temp_dir.hpp"
#include "workload.hpp"

namespace ghostlink::bench {

/// A fresh temporary directory for `scenario`, removed with everything in
/// it (the tests' src/testing/temp_dir.hpp); one that cannot be made ends
/// the benchmark, as fail() does.
struct temp_dir : testing::temp_dir {
  explicit temp_dir(const std::string& scenario) try : testing
    ::temp_dir("ghostlink-bench-" + scenario) {}
  catch (const std::system_error& e) {
    fail(scenario, e.what());
  }
};

namespace raw {

/// The largest single read or write of the baselines.
inline constexpr std::size_t chunk_bytes = std::size_t{4} << 20;

[[noreturn]] inline void fail_errno(const char* what, const std::filesystem::path& p) {
  fail("raw I/O", std::string(what) + " " + p.string() + ": " + std::generic_category().message(errno));
}

/// fsync of the directory `dir`, as a rename reaches the disk with it.
inline void sync_directory(const std::filesystem::path& dir) {
  const int d = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);  // NOLINT(cppcoreguidelines-pro-type-vararg)
  if (d < 0) fail_errno("open", dir);
  if (::fsync(d) != 0) fail_errno("fsync", dir);
  ::close(d);
}

/// syncfs of the file system holding `dir`: what earlier unlinks left to
/// do reaches the disk before a timed write starts.
inline void sync_filesystem(const std::filesystem::path& dir) {
  const int d = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);  // NOLINT(cppcoreguidelines-pro-type-vararg)
  if (d < 0) fail_errno("open", dir);
  if (::syncfs(d) != 0) fail_errno("syncfs", dir);
  ::close(d);
}

/// Writes `bytes` bytes to `target` the plain way: a temporary file beside
/// it, written in chunks of at most chunk_bytes taken from `source` over
/// and over, then (if `durable`) fsync, close, rename over `target`, and
/// (if `durable`) fsync of the directory.
inline void write_file(const std::filesystem::path& target, std::size_t bytes, std::span<const std::byte> source,
                       bool durable) {
  std::string name = ".";  // appended, not "." + string: GCC 12's -Wrestrict false positive (bug 105329)
  name += target.filename().string();
  name += ".tmp";
  const std::filesystem::path tmp = target.parent_path() / name;
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-vararg): open's mode argument
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) fail_errno("open", tmp);
  for (std::size_t done = 0, at = 0; done < bytes;) {
    const std::size_t n = std::min({chunk_bytes, bytes - done, source.size() - at});
    const ssize_t w = ::write(fd, source.data() + at, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail_errno("write", tmp);
    done += std::size_t(w);
    at = (at + std::size_t(w)) % source.size();
  }
  if (durable && ::fsync(fd) != 0) fail_errno("fsync", tmp);
  if (::close(fd) != 0) fail_errno("close", tmp);
  if (::rename(tmp.c_str(), target.c_str()) != 0) fail_errno("rename", tmp);
  if (durable) sync_directory(target.parent_path());
}

/// Reads the whole of `path` into the front of `out` in chunks of at most
/// chunk_bytes: open, read to the end, close. Returns the bytes read; a
/// file longer than `out` fails.
inline std::size_t read_file(const std::filesystem::path& path, std::span<std::byte> out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);  // NOLINT(cppcoreguidelines-pro-type-vararg)
  if (fd < 0) fail_errno("open", path);
  std::size_t done = 0;
  for (;;) {
    const std::size_t n = std::min(chunk_bytes, out.size() - done);
    const ssize_t r = n == 0 ? 0 : ::read(fd, out.data() + done, n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail_errno("read", path);
    if (r == 0) break;
    done += std::size_t(r);
  }
  char extra = 0;
  if (done == out.size() && ::read(fd, &extra, 1) > 0) fail("raw I/O", path.string() + " is larger than its buffer");
  ::close(fd);
  return done;
}

}  // namespace raw
}  // namespace ghostlink::bench
