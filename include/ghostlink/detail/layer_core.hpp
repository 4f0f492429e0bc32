#pragma once
// The untyped interface between a layer cache's templates and its actor,
// which lives in src/actor.hpp: a handle holds a `std::shared_ptr<actor>`
// and reaches it only through these functions.

#include <cstddef>
#include <iosfwd>
#include <memory>

#include "ghostlink/detail/asio_config.hpp"

#include <asio/any_io_executor.hpp>
#include <asio/strand.hpp>

#include "ghostlink/config.hpp"
#include "ghostlink/detail/pinned_epoch.hpp"
#include "ghostlink/detail/request.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/stats.hpp"

namespace ghostlink {
class kv_block_pool;
}  // namespace ghostlink

namespace ghostlink::detail {

class actor;

/// How soon a request's drain should start when it finds the actor idle.
/// `now`: dispatched to the strand, so a caller already on the strand's
/// executor runs the drain at once, on the strand, without a thread hop (its
/// handler is still only queued). `batch`: posted, so requests that arrive
/// meanwhile are applied and published together.
enum class urgency : bool { now, batch };

/// A new, empty cache whose actor runs on a new strand of `ex`, storing
/// elements as `codec` says, with blocks from `pool` (a private pool with
/// `config.max_blocks` as its budget if null); `initialized` makes it accept
/// writes before any initialize.
/// @throws std::system_error(kv_errc::invalid_config) for a bad config, a
///         pool whose blocks do not fit it, or a pool given together with a
///         `max_blocks` (the pool holds the budget then).
std::shared_ptr<actor> make_actor(asio::any_io_executor ex, const kv_cache_config& config, element_codec codec,
                                  const kv_block_pool* pool, bool initialized);

/// Hands `r` to the actor, which owns it from now on: its handler runs after
/// the epoch holding its result is published, never inside this call.
void submit(actor& a, request* r, urgency u) noexcept;

/// The executor the cache was made from: where a handler without an
/// associated executor completes (not the strand).
const asio::any_io_executor& io_executor(const actor& a) noexcept;
/// The actor's strand.
asio::strand<asio::any_io_executor> strand_of(const actor& a) noexcept;
const kv_cache_config& config_of(const actor& a) noexcept;
/// Tokens in the latest published epoch.
std::size_t size_of(const actor& a) noexcept;
/// The latest published epoch, pinned.
pinned_epoch pin(const actor& a) noexcept;
kv_cache_stats stats_of(const actor& a) noexcept;
kv_block_pool pool_of(const actor& a) noexcept;
/// Prints `layer_kv_cache{config=..., size=...}`.
std::ostream& print(std::ostream& os, const actor& a);

}  // namespace ghostlink::detail
