// kv_retention checked into a retention_rule (prefix/retention.hpp).

#include "prefix/retention.hpp"

#include <chrono>
#include "ghostlink/detail/flavour.hpp"

#include "base/throw_errc.hpp"
#include "ghostlink/error.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

retention_rule::retention_rule(const kv_retention& r, std::size_t block_tokens)
    : default_(r.default_priority), block_tokens_(block_tokens) {
  if (r.default_priority > kv_retention::max_priority) throw_errc(kv_errc::invalid_retention);
  for (const kv_retention::range& g : r.ranges)
    if (g.priority > kv_retention::max_priority || g.first > g.last || g.duration.count() < 0)
      throw_errc(kv_errc::invalid_retention);
  ranges_.reserve(r.ranges.size());
  for (const kv_retention::range& g : r.ranges) {
    if (g.first == g.last) continue;  // holds no token
    // A duration past what the clock can add is as good as none.
    const auto longest =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::duration::max() / 4);
    const auto d = g.duration > longest ? std::chrono::steady_clock::duration{0}
                                        : std::chrono::duration_cast<std::chrono::steady_clock::duration>(g.duration);
    ranges_.push_back({g.first, g.last, g.priority, d});
    timed_ = timed_ || d.count() != 0;
  }
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
