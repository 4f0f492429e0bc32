#include "../scenarios.hpp"
namespace ghostlink::bench {
void memory(const options&, report&) {}
}
