#pragma once
// One way the tests, the stress test and the fuzzer build messages.

#include <sstream>
#include <string>

namespace ghostlink::test {

/// Every argument streamed into one string.
template <class... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace ghostlink::test
