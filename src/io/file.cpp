#include "io/file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <string>
#include <utility>

#include "ghostlink/error.hpp"

#if GHOSTLINK_ASIO_BOOST
#include <boost/system/error_category.hpp>
#endif

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

error_code errno_code(int e) noexcept {
#if GHOSTLINK_ASIO_BOOST
  return {e, boost::system::generic_category()};
#else
  return {e, std::generic_category()};
#endif
}

namespace {
error_code last_error() noexcept { return errno_code(errno); }
}  // namespace

file_descriptor& file_descriptor::operator=(file_descriptor&& other) noexcept {
  if (this != &other) {
    (void)close();
    fd_ = other.release();
  }
  return *this;
}

file_descriptor::~file_descriptor() { (void)close(); }

error_code file_descriptor::close() noexcept {
  if (fd_ < 0) return {};
  // Linux frees the descriptor even when close() fails (EINTR included):
  // never retry it.
  const int result = ::close(release());
  return result == 0 ? error_code() : last_error();
}

error_code open_for_reading(const std::filesystem::path& path, file_descriptor& out, std::uint64_t& file_bytes) {
  // O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer
  // before the S_ISREG check refuses it; it changes nothing for a regular
  // file, whose reads never block on it.
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-vararg)
  file_descriptor file(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (file.get() < 0) return last_error();
  struct stat st {};
  if (::fstat(file.get(), &st) != 0) return last_error();
  if (!S_ISREG(st.st_mode)) return errno_code(S_ISDIR(st.st_mode) ? EISDIR : EINVAL);
  file_bytes = static_cast<std::uint64_t>(st.st_size);
  out = std::move(file);
  return {};
}

error_code read_at(const file_descriptor& file, std::uint64_t offset, std::span<std::byte> out) {
  const std::array<std::span<std::byte>, 1> one{out};
  return read_scattered(file, offset, one);
}

error_code read_scattered(const file_descriptor& file, std::uint64_t offset,
                          std::span<const std::span<std::byte>> parts) {
  constexpr std::size_t batch = 64;  // well below IOV_MAX (1024); 1 KiB of iovecs cleared a call
  std::array<iovec, batch> vectors{};
  std::size_t skip = 0;  // bytes of parts.front() already read
  for (;;) {
    while (!parts.empty() && parts.front().size() == skip) {  // read whole (or empty)
      parts = parts.subspan(1);
      skip = 0;
    }
    if (parts.empty()) return {};
    const std::size_t n = std::min(batch, parts.size());
    for (std::size_t i = 0; i < n; ++i) {
      const std::span<std::byte> part = parts[i].subspan(i == 0 ? skip : 0);
      vectors[i] = {.iov_base = part.data(), .iov_len = part.size()};
    }
    const ssize_t got = ::preadv(file.get(), vectors.data(), static_cast<int>(n), static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return last_error();
    if (got == 0) return kv_errc::file_truncated;
    offset += static_cast<std::uint64_t>(got);
    for (auto left = static_cast<std::size_t>(got); left != 0;) {  // past the parts read
      const std::size_t step = std::min(left, parts.front().size() - skip);
      skip += step;
      left -= step;
      if (skip == parts.front().size()) {
        parts = parts.subspan(1);
        skip = 0;
      }
    }
  }
}

error_code write_at(const file_descriptor& file, std::uint64_t offset, std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::pwrite(file.get(), bytes.data(), bytes.size(), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return last_error();
    if (n == 0) return errno_code(EIO);  // no progress: retrying would loop forever
    bytes = bytes.subspan(static_cast<std::size_t>(n));
    offset += static_cast<std::uint64_t>(n);
  }
  return {};
}

replacement_file::~replacement_file() {
  (void)file_.close();
  if (created_) (void)::unlink(temporary_.c_str());
}

std::filesystem::perms directory_mode(std::filesystem::perms file_mode) noexcept {
  using std::filesystem::perms;
  perms mode = file_mode & perms::mask;
  for (const auto& [read, exec] :
       {std::pair{perms::owner_read, perms::owner_exec}, std::pair{perms::group_read, perms::group_exec},
        std::pair{perms::others_read, perms::others_exec}})
    if ((mode & read) != perms::none) mode |= exec;
  return mode;
}

error_code make_directories(const std::filesystem::path& directory, std::filesystem::perms mode) {
  struct stat st {};
  if (::stat(directory.c_str(), &st) == 0) return S_ISDIR(st.st_mode) ? error_code() : errno_code(ENOTDIR);
  if (errno != ENOENT) return last_error();
  const std::filesystem::path parent = directory.lexically_normal().parent_path();
  // Parents first (bounded by the path's depth: each call is one level up).
  if (!parent.empty() && parent != directory.lexically_normal())
    if (error_code ec = make_directories(parent, mode)) return ec;
  if (::mkdir(directory.c_str(), mode_bits(mode)) != 0) {
    if (errno != EEXIST) return last_error();
    return make_directories(directory, mode);  // made meanwhile: is it a directory?
  }
  // Only a directory made here: the umask may have narrowed its bits.
  if (::chmod(directory.c_str(), mode_bits(mode)) != 0) return last_error();
  return {};
}

error_code replacement_file::create(const std::filesystem::path& target, std::uint64_t bytes,
                                    std::filesystem::perms mode) {
  // A name no other save (of this process or another) uses: the target's,
  // hidden, with the process id and a counter; O_EXCL makes sure.
  static std::atomic<std::uint64_t> counter{0};
  target_ = target;
  // The target's name cut to 200 bytes: the temporary name stays within
  // NAME_MAX (255) whatever the target's length.
  std::string name = target.filename().string();
  if (name.size() > 200) name.resize(200);
  const std::string stem = "." + name + ".tmp." + std::to_string(::getpid()) + ".";
  for (int attempt = 0; attempt < 100; ++attempt) {
    temporary_ = target.parent_path() / (stem + std::to_string(counter.fetch_add(1, std::memory_order_relaxed)));
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-vararg): open's mode argument
    file_ = file_descriptor(::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode_bits(mode)));
    if (file_.get() >= 0) break;
    if (errno != EEXIST) return last_error();
  }
  if (file_.get() < 0) return errno_code(EEXIST);
  created_ = true;
  // Exactly `mode`: the umask only took bits away at open().
  if (::fchmod(file_.get(), mode_bits(mode)) != 0) return last_error();
  if (::ftruncate(file_.get(), static_cast<off_t>(bytes)) != 0) return last_error();
  return {};
}

error_code replacement_file::sync() noexcept { return ::fsync(file_.get()) == 0 ? error_code() : last_error(); }

error_code replacement_file::rename() {
  if (error_code ec = file_.close()) return ec;
  if (::rename(temporary_.c_str(), target_.c_str()) != 0) return last_error();
  created_ = false;
  return {};
}

error_code replacement_file::sync_directory() const {
  const std::filesystem::path dir = target_.parent_path().empty() ? std::filesystem::path(".") : target_.parent_path();
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-vararg)
  const file_descriptor d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.get() < 0) return last_error();
  if (::fsync(d.get()) != 0) return last_error();
  return {};
}

error_code replacement_file::commit() {
  if (error_code ec = sync()) return ec;
  if (error_code ec = rename()) return ec;
  return sync_directory();  // the rename reaches the disk with the directory
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
