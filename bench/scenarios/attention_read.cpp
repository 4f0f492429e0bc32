#include "../scenarios.hpp"
namespace ghostlink::bench {
void attention_read(const options&, report&) {}
}
