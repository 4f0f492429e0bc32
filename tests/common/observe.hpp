#pragma once
// What a reader can observe of a layer cache or a sequence, to compare
// before and after an operation that must change nothing.

#include <ghostlink/kv_cache.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <stdexcept>
#include <utility>
#include <vector>

namespace ghostlink::test {

/// A snapshot's epoch, size, what its window dropped, and the keys and
/// values of every token it still holds (widened to float).
struct observed {
  std::uint64_t epoch = 0;
  std::size_t size = 0;
  std::size_t kept_from = 0;
  std::vector<float> keys, values;
  bool operator==(const observed&) const = default;
};

/// What `snap` shows, its epoch left 0 (for caches whose epochs may
/// legitimately move while their contents do not): its sinks' tokens and
/// those from kept_from() on (every token, without a window).
template <storage_element T>
observed contents(const basic_kv_snapshot<T>& snap) {
  observed o{0, snap.size(), snap.kept_from(), {}, {}};
  const std::size_t sinks = std::min(snap.sink_tokens(), snap.size());
  for (auto [begin, end] :
       {std::pair(std::size_t{0}, sinks), std::pair(std::max(sinks, snap.kept_from()), snap.size())}) {
    kv_range part;
    if (snap.read_range(begin, end, part)) throw std::logic_error("read_range of what a snapshot holds failed");
    o.keys.insert(o.keys.end(), part.keys.begin(), part.keys.end());
    o.values.insert(o.values.end(), part.values.begin(), part.values.end());
  }
  return o;
}

/// Everything a reader sees of `cache` now (a layer cache, or a sequence's
/// read-only view of a layer), its epoch included.
template <class Cache>
  requires requires(const Cache& c) { c.snapshot().epoch(); }
observed observe(const Cache& cache) {
  const auto snap = cache.snapshot();
  observed o = contents(snap);
  o.epoch = snap.epoch();
  return o;
}

/// A sequence: its size, its snapshot's, and each layer's contents.
struct observed_sequence {
  std::size_t size = 0, snapshot_size = 0;
  std::vector<observed> layers;
  bool operator==(const observed_sequence&) const = default;
};

template <storage_element T>
observed_sequence observe(const basic_sequence_kv_cache<T>& s) {
  observed_sequence o{s.size(), s.snapshot().size(), {}};
  for (std::size_t l = 0; l < s.num_layers(); ++l) o.layers.push_back(contents(s.layer(l).snapshot()));
  return o;
}

inline std::ostream& operator<<(std::ostream& os, const observed_sequence& o) {
  os << "size " << o.size << ", snapshot " << o.snapshot_size << ", layers";
  for (const observed& l : o.layers) os << ' ' << l.size;
  return os;
}

}  // namespace ghostlink::test
