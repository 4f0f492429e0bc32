#include "../scenarios.hpp"
namespace ghostlink::bench {
void read_under_write(const options&, report&) {}
}
