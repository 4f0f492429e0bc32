#include "testing/hooks.hpp"
#include "ghostlink/detail/flavour.hpp"

#include "base/fault_countdown.hpp"
#include "core/mailbox.hpp"
#include "memory/block_pool.hpp"
#include "prefix/retention.hpp"
#include "store/hooks.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

void fail_next_allocations(const kv_block_pool& pool, std::size_t n) noexcept {
  if (const ref_ptr<block_pool> state = pool_access::state(pool)) state->fail_next_allocations(n);
}

void fail_metadata_allocation(std::size_t after) noexcept {
  metadata_countdown().store(after + 1, std::memory_order_relaxed);
}

bool cancel_metadata_failure() noexcept { return metadata_countdown().exchange(0, std::memory_order_relaxed) != 0; }

void set_enqueued_hook(void (*hook)()) noexcept { enqueued_hook.store(hook, std::memory_order_relaxed); }
void set_step_write_hook(void (*hook)()) noexcept { step_write_hook.store(hook, std::memory_order_relaxed); }

void set_file_store_reserved_hook(void (*hook)(std::uint64_t used, std::uint64_t budget)) noexcept {
  file_store_reserved_hook.store(hook, std::memory_order_relaxed);
}

void set_retention_clock(std::chrono::steady_clock::time_point (*now)()) noexcept {
  retention_clock_hook.store(now, std::memory_order_relaxed);
}

extent_census census(const kv_block_pool& pool) noexcept {
  const ref_ptr<block_pool> state = pool_access::state(pool);
  return state ? state->census() : extent_census{};
}
std::size_t resident_bytes(const kv_block_pool& pool) noexcept {
  const ref_ptr<block_pool> state = pool_access::state(pool);
  return state ? state->resident_bytes() : 0;
}
std::size_t pools_alive() noexcept { return block_pool::pools_alive(); }
std::size_t pools_destroyed_unbalanced() noexcept { return block_pool::pools_destroyed_unbalanced(); }
std::uint64_t mailbox_bytes_allocated() noexcept { return mailbox::bytes_allocated(); }

}  // namespace detail
GHOSTLINK_NAMESPACE_END
