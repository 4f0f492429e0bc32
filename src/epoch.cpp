#include "epoch.hpp"
#include "ghostlink/detail/flavour.hpp"

#include <new>

#include "fault_countdown.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

std::atomic<std::size_t>& metadata_countdown() noexcept {
  static std::atomic<std::size_t> countdown{0};
  return countdown;
}

void* metadata_new(std::size_t size) {
  if (count_down(metadata_countdown()) == 1) throw std::bad_alloc();  // the one the countdown reaches fails
  return ::operator new(size);
}

void epoch_registry::add(epoch* e) noexcept {
  std::lock_guard lock(mutex_);
  e->older = newest_;
  (newest_ ? newest_->newer : oldest_) = e;
  newest_ = e;
  ++count_;
}

void epoch_registry::remove(epoch* e) noexcept {
  std::lock_guard lock(mutex_);
  (e->older ? e->older->newer : oldest_) = e->newer;
  (e->newer ? e->newer->older : newest_) = e->older;
  --count_;
}

epoch_registry::reading epoch_registry::read() const noexcept {
  std::lock_guard lock(mutex_);
  return {count_, oldest_ ? oldest_->number : 0};
}

std::size_t stored_runs(const epoch& e, std::size_t first, std::size_t end, std::span<stored_run> out) noexcept {
  const block_layout& layout = *e.layout;
  std::size_t n = 0;
  while (first < end && n < out.size()) {
    const block* last = &e.block_of(first);
    const std::size_t position = first % layout.block_tokens;
    stored_run r{first, e.run_from(first, end), layout.keys(*last, position), layout.values(*last, position)};
    first += r.count;
    // The blocks in the next slots of the same extent, whose keys and
    // values lie right after: the same run. Told from the table's pointers
    // alone, without reading their headers.
    while (first < end && first < e.stored) {
      const block* next = &e.block_of(first);
      if (!last->followed_by(*next)) break;
      const std::size_t count = e.run_from(first, end);
      r.count += count;
      first += count;
      last = next;
    }
    out[n++] = r;
  }
  return n;
}

void unpin(const epoch& e) noexcept {
  if (e.registry) e.registry->snapshot_closed();
  e.release();
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
