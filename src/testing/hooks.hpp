#pragma once
// Test hooks: fault injection and leak accounting. Only tests include this
// header (its directory is on no consumer's include path); the library
// defines these functions, and production code never calls them.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/block_pool.hpp"
#include "memory/block_pool.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// The next `n` requests of `pool` for a block's memory, or for an extent's
/// in `preallocate`, fail as if the system had none.
void fail_next_allocations(const kv_block_pool& pool, std::size_t n) noexcept;
/// Extents of `pool` holding memory now, and of them those no block uses
/// and no cursor fills (what trim() returns to the system).
extent_census census(const kv_block_pool& pool) noexcept;
/// Bytes of `pool`'s reserved extents that are memory now, by the kernel's
/// count (mincore); 0 for a pool with a memory resource.
std::size_t resident_bytes(const kv_block_pool& pool) noexcept;
/// Of the allocations of block tables, table chunks and epochs (by any
/// cache) from now on, `after` succeed and the next throws std::bad_alloc.
void fail_metadata_allocation(std::size_t after) noexcept;
/// Disarms fail_metadata_allocation(); whether the failure was still pending.
bool cancel_metadata_failure() noexcept;

/// Calls `hook` in every submit that queues its request (not one that a
/// drain carries), after queueing it and before counting it: a test holds a
/// submitter there, so that a drain takes a request its submitter has not
/// counted yet. Null removes it.
void set_enqueued_hook(void (*hook)()) noexcept;

/// Calls `hook` in every sequence step's write(), after it claimed its
/// layer and before it stores the tokens: a test holds a writer there, so
/// that a commit finds the write running. Null removes it.
void set_step_write_hook(void (*hook)()) noexcept;

/// Calls `hook` each time a file store reserves room (for a write, or a
/// file a lookup found), under the store's lock, with its bytes then
/// indexed plus reserved and its budget. Null removes it.
void set_file_store_reserved_hook(void (*hook)(std::uint64_t used, std::uint64_t budget)) noexcept;

/// The clock retention durations run on (kv_retention): `now` from this
/// call on, std::chrono::steady_clock again when null. Read by every
/// prefix cache in the process.
void set_retention_clock(std::chrono::steady_clock::time_point (*now)()) noexcept;

/// Block pools alive in this process. Every block holds its pool, so none
/// alive once every cache and snapshot is gone means no block leaked.
std::size_t pools_alive() noexcept;
/// Pools destroyed while still counting blocks in use (an accounting error).
std::size_t pools_destroyed_unbalanced() noexcept;
/// Bytes the mailboxes of every cache in the process hold (moodycamel's
/// blocks); a mailbox keeps the blocks it grew to until its cache dies.
std::uint64_t mailbox_bytes_allocated() noexcept;

}  // namespace detail
GHOSTLINK_NAMESPACE_END
