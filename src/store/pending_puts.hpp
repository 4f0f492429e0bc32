#pragma once
// The puts of a store not yet settled (stored, dropped or failed), and what
// waits for them: a blocking flush() and kv_block_store::when_flushed().
//
// Each put takes a ticket, in order; a wait is for the tickets issued
// before it (`issued()` when it starts), so puts made after it never delay
// it, however steady. Not thread-safe: the store uses it under its own
// mutex, and runs the callbacks that settle() hands back after unlocking.

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class pending_puts {
 public:
  using ticket = std::uint64_t;
  /// Callbacks whose puts have all settled, to be called after unlocking.
  using ready_list = std::multimap<ticket, std::function<void()>>;

  /// A ticket for a new put (never 0).
  /// @throws std::bad_alloc, having issued nothing.
  ticket add() {
    pending_.insert(issued_ + 1);
    return ++issued_;
  }
  /// The last ticket issued (0: none yet).
  ticket issued() const noexcept { return issued_; }
  /// Whether every put up to ticket `last` has settled.
  bool settled(ticket last) const noexcept { return pending_.empty() || *pending_.begin() > last; }

  /// Settles put `t`; moves the callbacks that waited for it last into
  /// `ready` (no allocation: map nodes move).
  void settle(ticket t, ready_list& ready) noexcept {
    pending_.erase(t);
    while (!waiters_.empty() && settled(waiters_.begin()->first)) ready.insert(waiters_.extract(waiters_.begin()));
  }

  /// Keeps `done` to be handed back by settle() once every put issued so
  /// far has settled; false, keeping nothing, if they all have now.
  /// @throws std::bad_alloc, having kept nothing.
  bool wait(std::function<void()>& done) {
    if (settled(issued_)) return false;
    waiters_.emplace(issued_, std::move(done));
    return true;
  }

 private:
  std::set<ticket> pending_;  // issued, not yet settled
  ticket issued_ = 0;
  std::multimap<ticket, std::function<void()>> waiters_;  // by the last ticket each waits for
};

/// A store's flush(): blocks until every put of `puts` (guarded by
/// `mutex`; `settled` notified after each settle()) issued before the call
/// has settled.
inline void wait_settled(std::mutex& mutex, std::condition_variable& settled, const pending_puts& puts) {
  std::unique_lock lock(mutex);
  const pending_puts::ticket last = puts.issued();
  settled.wait(lock, [&] { return puts.settled(last); });
}

/// A store's when_flushed(): `done` kept in `puts` (guarded by `mutex`)
/// until the puts issued so far settle, or called now if they all have.
/// @throws std::bad_alloc, having kept nothing.
inline void call_when_settled(std::mutex& mutex, pending_puts& puts, std::function<void()> done) {
  {
    std::lock_guard lock(mutex);
    if (puts.wait(done)) return;
  }
  done();
}

/// Calls every callback of `ready`, swallowing what they throw.
inline void run_ready(pending_puts::ready_list& ready) noexcept {
  for (auto& [t, done] : ready) {
    try {
      done();
    } catch (...) {  // when_flushed's callbacks do not throw; a user's may
    }
  }
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
