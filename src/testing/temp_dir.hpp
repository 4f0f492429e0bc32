#pragma once
// A fresh directory under the system's temporary one, removed with
// everything in it: for the tests and the benchmark, which both write
// files (header-only; not part of the library).

#include <stdlib.h>  // NOLINT(modernize-deprecated-headers): POSIX mkdtemp

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace ghostlink::testing {

class temp_dir {
 public:
  /// `std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")`, made
  /// by mkdtemp (mode 0700).
  /// @throws std::system_error if it cannot be made.
  explicit temp_dir(const std::string& prefix = "ghostlink-test") {
    std::string name = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    if (::mkdtemp(name.data()) == nullptr) throw std::system_error(errno, std::generic_category(), "mkdtemp " + name);
    path = name;
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }

  /// The names of the files and directories in it, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

  std::filesystem::path path;
};

}  // namespace ghostlink::testing
