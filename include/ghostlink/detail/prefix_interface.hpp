#pragma once
// The functions a prefix cache handle reaches its index through (compiled,
// in src/prefix/): untyped, so that a change behind them recompiles no user.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/block_hash.hpp"
#include "ghostlink/block_pool.hpp"
#include "ghostlink/config.hpp"
#include "ghostlink/detail/io_op.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/events.hpp"
#include "ghostlink/layout.hpp"
#include "ghostlink/stats.hpp"
#include "ghostlink/types.hpp"

GHOSTLINK_NAMESPACE_BEGIN

struct kv_prefix_options;
struct kv_attach_options;
struct kv_retention;
class kv_block_store;

namespace detail {

class prefix_index;
class sequence_state;

// The untyped machinery (src/prefix/cache.cpp).
std::shared_ptr<prefix_index> make_prefix_index(const kv_model_layout& layout, const kv_cache_config& config,
                                                element_codec codec, const kv_block_pool& pool,
                                                kv_prefix_options options);
std::size_t num_layers(const prefix_index& p) noexcept;
const kv_model_layout& layout_of(const prefix_index& p) noexcept;
const kv_cache_config& config_of(const prefix_index& p) noexcept;
kv_block_pool pool_of(const prefix_index& p) noexcept;
const std::shared_ptr<kv_block_store>& store_of(const prefix_index& p) noexcept;
std::vector<kv_block_hash> block_hashes(const prefix_index& p, std::span<const token_id> tokens, std::string_view salt);
std::size_t prefix_match(const prefix_index& p, std::span<const token_id> tokens, std::string_view salt);
std::shared_ptr<sequence_state> prefix_attach(prefix_index& p, asio::any_io_executor ex,
                                              std::span<const token_id> tokens, std::string_view salt);
/// `tokens` null: the token ids `seq` stores; `retention` null: the default priority.
std::size_t prefix_insert(prefix_index& p, const sequence_state* seq, const std::span<const token_id>* tokens,
                          std::string_view salt, const kv_retention* retention);
/// Caches `seq`'s blocks as its drains fill them (src/prefix/track.cpp).
void prefix_track(const std::shared_ptr<prefix_index>& p, const sequence_state* seq, std::string_view salt,
                  const kv_retention* retention);
void prefix_untrack(const sequence_state* seq) noexcept;
void prefix_clear(prefix_index& p) noexcept;
kv_prefix_stats prefix_stats(const prefix_index& p) noexcept;
void prefix_set_event_handler(prefix_index& p, kv_prefix_event_handler handler);
kv_prefix_dump prefix_dump(const prefix_index& p);
/// Wakes an attach that waits on its store when its handler's cancellation
/// slot is emitted (src/prefix/attach.cpp).
class attach_wakeup;
std::shared_ptr<attach_wakeup> make_attach_wakeup();
/// Queues the cancellation of the attach `w` wakes, if it is still running.
void wake(attach_wakeup& w) noexcept;

/// Takes ownership of `op` and completes it exactly once, never inside this
/// call (src/prefix/attach.cpp). Throws only if memory is refused, then
/// discarding `op` first.
void start_attach(const std::shared_ptr<prefix_index>& p, const asio::any_io_executor& ex,
                  std::span<const token_id> tokens, std::string_view salt, const kv_attach_options& options,
                  const std::shared_ptr<attach_wakeup>& wakeup, io_op* op);

/// Hands the store every entry not in it yet, then completes `op` (taking
/// ownership) when the store has settled those puts (kv_block_store::
/// when_flushed), never inside this call: `kv_errc::capacity_exhausted` if
/// memory was refused for some entry, else success (also without a store).
/// Throws only if memory is refused for the wait, then discarding `op`
/// first (src/prefix/cache.cpp).
void start_flush(const std::shared_ptr<prefix_index>& p, io_op* op);

/// Starts an `async_flush` (impl/prefix_cache.hpp); a template, as the
/// member using it must not need it complete.
template <storage_element T>
struct initiate_flush;

/// Starts an `async_attach` (impl/prefix_cache.hpp).
template <storage_element T>
struct initiate_attach;

}  // namespace detail
GHOSTLINK_NAMESPACE_END
