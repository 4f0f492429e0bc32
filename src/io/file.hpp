#pragma once
// The file I/O every tier shares (POSIX): saving and loading sequences, the
// file store, an attach from it. Whole reads and writes at an offset, and
// the atomic replacement of a file by a new one; how a job starts on the I/O
// executor. Everything here blocks: it runs on the I/O executor only
// (io_pool_executor, or the one the caller gave), never on a cache's strand.

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <new>
#include <span>
#include <utility>
#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/detail/io_op.hpp"
#include "ghostlink/error.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// `errno` value `e` as the flavour's error code, in the generic category.
error_code errno_code(int e) noexcept;

/// An open file descriptor, closed on destruction.
class file_descriptor {
 public:
  file_descriptor() noexcept = default;
  explicit file_descriptor(int fd) noexcept : fd_(fd) {}
  file_descriptor(file_descriptor&& other) noexcept : fd_(other.release()) {}
  file_descriptor& operator=(file_descriptor&& other) noexcept;
  ~file_descriptor();

  int get() const noexcept { return fd_; }
  int release() noexcept {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  /// Closes it now, reporting close()'s error.
  error_code close() noexcept;

 private:
  int fd_ = -1;
};

/// Opens `path` to read, and its length: `EISDIR` for a directory, `EINVAL`
/// for anything else that is not a regular file (a FIFO, a device), refused
/// without waiting for a writer.
error_code open_for_reading(const std::filesystem::path& path, file_descriptor& out, std::uint64_t& file_bytes);
/// Reads exactly `out.size()` bytes at `offset`; `file_truncated` if the
/// file ends first (it shrank since it was opened).
error_code read_at(const file_descriptor& file, std::uint64_t offset, std::span<std::byte> out);
/// Reads consecutive bytes at `offset` into each of `parts` in turn (as
/// read_at into one buffer, in as few system calls as the parts allow).
error_code read_scattered(const file_descriptor& file, std::uint64_t offset,
                          std::span<const std::span<std::byte>> parts);
/// Writes all of `bytes` at `offset`; `EIO` if a write makes no progress.
error_code write_at(const file_descriptor& file, std::uint64_t offset, std::span<const std::byte> bytes);

/// The permission bits of `mode` as `open`, `mkdir` and `fchmod` take them.
inline ::mode_t mode_bits(std::filesystem::perms mode) noexcept {
  return static_cast<::mode_t>(mode & std::filesystem::perms::mask);
}
/// A directory's mode for files of `file_mode`: those bits plus the execute
/// bit of each class that may read (0600 -> 0700, 0640 -> 0750).
std::filesystem::perms directory_mode(std::filesystem::perms file_mode) noexcept;
/// Makes `directory` and each missing parent with exactly `mode` (a
/// `chmod` after `mkdir`, whatever the umask); an existing one is left as
/// it is. `ENOTDIR` if something other than a directory is in the way.
error_code make_directories(const std::filesystem::path& directory, std::filesystem::perms mode);

/// A new file that replaces `target` atomically: created beside it under a
/// unique name, it takes `target`'s name only in commit(), after reaching
/// the disk. Removed on destruction unless committed.
class replacement_file {
 public:
  replacement_file() = default;
  replacement_file(const replacement_file&) = delete;
  replacement_file& operator=(const replacement_file&) = delete;
  ~replacement_file();

  /// Creates the temporary file, of `bytes` bytes (zeros), with exactly
  /// the permission bits `mode` (an `fchmod` after `open`: the umask
  /// neither narrows nor widens them).
  error_code create(const std::filesystem::path& target, std::uint64_t bytes, std::filesystem::perms mode);
  const file_descriptor& file() const noexcept { return file_; }
  /// sync(), rename(), sync_directory(): the new file reaches the disk,
  /// then takes the target's name, then the name reaches the disk.
  error_code commit();
  /// fsync of the temporary file.
  error_code sync() noexcept;
  /// Closes the file and renames it over the target. Without the syncs a
  /// killed process still leaves the old file or the new one, never a torn
  /// one; a power loss may not.
  error_code rename();
  /// fsync of the target's directory (after rename()).
  error_code sync_directory() const;

 private:
  std::filesystem::path target_, temporary_;
  file_descriptor file_;
  bool created_ = false;  // temporary_ exists under its name, ours to remove
};

/// A job's start on the I/O executor: `work()` unless `op` was cancelled
/// first (then `operation_aborted`); memory refused is `capacity_exhausted`.
template <class Work>
error_code run_claimed(const io_op& op, Work&& work) noexcept {
  try {
    return op.claim() ? std::forward<Work>(work)() : error_code(asio::error::operation_aborted);
  } catch (const std::bad_alloc&) {
    return kv_errc::capacity_exhausted;
  }
}

/// A started operation that no job owns yet: discarded (its handler
/// destroyed unrun, its work released) if an exception (memory refused,
/// queueing) unwinds past it before take() hands it on.
class unstarted_op {
 public:
  explicit unstarted_op(io_op* op) noexcept : op_(op) {}
  unstarted_op(const unstarted_op&) = delete;
  unstarted_op& operator=(const unstarted_op&) = delete;
  ~unstarted_op() {
    if (op_) op_->discard();
  }

  io_op* take() noexcept { return std::exchange(op_, nullptr); }
  /// Ends it early, with `ec` (posted).
  void complete(error_code ec) { take()->complete(ec, queueing::post); }

 private:
  io_op* op_;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
