// Both flavours of ghostlink linked into one process: each part runs a
// cache of its flavour (part.cpp) and checks what it reads back. Their
// inline namespaces keep the two libraries' symbols apart. Exit status 0 if
// both parts work and each ran in its own flavour.
#include <cstdio>
#include <string>

#include "part.hpp"

int main() {
  std::string standalone_name, boost_name;
  const std::string standalone = run_standalone_part(standalone_name);
  const std::string boost = run_boost_part(boost_name);
  int failed = 0;
  if (!standalone.empty()) std::printf("standalone part: %s\n", standalone.c_str()), failed = 1;
  if (!boost.empty()) std::printf("boost part: %s\n", boost.c_str()), failed = 1;
  if (standalone_name.find("standalone_asio") == std::string::npos ||
      boost_name.find("boost_asio") == std::string::npos)
    std::printf("the parts ran in %s and %s\n", standalone_name.c_str(), boost_name.c_str()), failed = 1;
  if (failed == 0)
    std::printf("both flavours in one process: %s and %s work\n", standalone_name.c_str(), boost_name.c_str());
  return failed;
}
