#include "../scenarios.hpp"
namespace ghostlink::bench {
void decode_step(const options&, report&) {}
}
