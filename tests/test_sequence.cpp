// Placeholder replaced by the real tests of this area.
#include "support.hpp"

TEST_CASE("placeholder", "[placeholder]") { CHECK(ghostlink::half(1.0f).bits == 0x3c00); }
