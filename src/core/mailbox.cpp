#include "core/mailbox.hpp"
#include "ghostlink/detail/flavour.hpp"

#include <cstdlib>
#include <new>

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

std::atomic<std::uint64_t> mailbox_bytes{0};

// Each block moodycamel allocates carries its size in front, so free() can
// count it back; the header keeps malloc's alignment.
constexpr std::size_t header = alignof(std::max_align_t);

}  // namespace

std::uint64_t mailbox::bytes_allocated() noexcept { return mailbox_bytes.load(std::memory_order_relaxed); }

void* mailbox_traits::malloc(std::size_t size) {
  auto* raw = static_cast<unsigned char*>(std::malloc(header + size));
  if (!raw) return nullptr;
  *reinterpret_cast<std::size_t*>(raw) = size;
  mailbox_bytes.fetch_add(size, std::memory_order_relaxed);
  return raw + header;
}

void mailbox_traits::free(void* p) {
  if (!p) return;
  unsigned char* raw = static_cast<unsigned char*>(p) - header;
  mailbox_bytes.fetch_sub(*reinterpret_cast<std::size_t*>(raw), std::memory_order_relaxed);
  std::free(raw);
}

bool mailbox::try_hold_place() noexcept {
  std::size_t n = queued_.load(std::memory_order_relaxed);
  while (n < max_pending_)
    if (queued_.compare_exchange_weak(n, n + 1, std::memory_order_acq_rel, std::memory_order_relaxed)) return true;
  return false;
}

bool mailbox::enqueue_held(request* r) noexcept {
  if (queue_.enqueue(r)) return true;
  queued_.fetch_sub(1, std::memory_order_acq_rel);
  return false;
}

void mailbox::park(request* r) noexcept {
  r->next_waiting_ = nullptr;
  if (waiting_tail_)
    waiting_tail_->next_waiting_ = r;
  else
    waiting_head_ = r;
  waiting_tail_ = r;
  waiting_count_.fetch_add(1, std::memory_order_relaxed);
  delayed_.fetch_add(1, std::memory_order_relaxed);
}

bool mailbox::push(request* r) noexcept {
  // Ordering rests on queued_ and the mutex (see the invariants).
  if (waiting() == 0 && try_hold_place()) return enqueue_held(r);
  {
    std::lock_guard lock(mutex_);
    if (waiting_head_ || !try_hold_place()) {
      park(r);
      return true;
    }
  }
  return enqueue_held(r);
}

std::size_t mailbox::take(request** out, std::size_t n) noexcept {
  std::size_t taken = queue_.try_dequeue_bulk(out, n);
  if (taken) queued_.fetch_sub(taken, std::memory_order_acq_rel);
  if (taken == n || waiting() == 0) return taken;
  std::lock_guard lock(mutex_);
  if (!waiting_head_ || queued_.load(std::memory_order_acquire) != 0) return taken;  // queued requests go first
  while (taken < n && waiting_head_) {
    request* r = waiting_head_;
    waiting_head_ = r->next_waiting_;
    out[taken++] = r;
    waiting_count_.fetch_sub(1, std::memory_order_relaxed);
  }
  if (!waiting_head_) waiting_tail_ = nullptr;
  return taken;
}

bool mailbox::hold_carried_place() noexcept {
  // Only into an empty mailbox: with no place held and none waiting, every
  // request queued before was taken by a drain, which runs on the strand
  // before the one a carried request rides.
  if (waiting() != 0) return false;
  std::size_t none = 0;
  return queued_.compare_exchange_strong(none, 1, std::memory_order_acq_rel, std::memory_order_relaxed);
}

void mailbox::release_carried() noexcept { queued_.fetch_sub(1, std::memory_order_acq_rel); }

bool mailbox::enqueue_carried(request* r) noexcept { return enqueue_held(r); }

std::size_t mailbox::queued() const noexcept { return queued_.load(std::memory_order_relaxed); }

}  // namespace detail
GHOSTLINK_NAMESPACE_END
