#pragma once
// What a pool asks of the one cache that may keep its blocks while nobody
// uses them (the prefix cache, src/prefix/index.hpp): give budget back by
// evicting, and hear that a kept block became idle. The pool knows nothing
// else of it (includes point down: docs/ARCHITECTURE.md). What the
// reclaimer keeps it reports the other way, to block_pool::set_kept, so that
// the pool's stats() and blocks_available() stay lock-free.
//
// The pool calls every member under its reclaimer mutex
// (block_pool::reclaimer_mutex_), so a reclaimer never dies while a call
// into it runs; a reclaimer takes its own locks after that one.

#include <cstddef>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class block;

/// What a reclaimer keeps, as kv_pool_stats reports it.
struct kept_blocks {
  std::size_t cached = 0;       // blocks it holds
  std::size_t idle = 0;         // of them, those nobody else holds
  std::size_t reclaimable = 0;  // of them, those evicting would free now
};

class reclaimer {
 public:
  // Public and virtual, as clang-tidy's cppcoreguidelines-virtual-class-destructor
  // asks: the pool never deletes a reclaimer, and its one kind is final.
  virtual ~reclaimer() = default;
  reclaimer() = default;
  reclaimer(const reclaimer&) = delete;
  reclaimer& operator=(const reclaimer&) = delete;

  /// Evicts one entry, least recently used first, so that some budget
  /// comes back; false when nothing can be evicted.
  virtual bool evict_one() noexcept = 0;
  /// A kept block's last outside reference went (block::release). `b` is
  /// only looked up, never read: it may be gone.
  virtual void block_idle(const block* b) noexcept = 0;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
