#include "../scenarios.hpp"
namespace ghostlink::bench {
void write_concurrent(const options&, report&) {}
}
