#pragma once
// The untyped interface between a layer cache's templates and its actor,
// which lives in src/core/actor.hpp: the request the templates build (one shape
// for every operation) and the functions through which a handle, which
// holds a `std::shared_ptr<actor>`, reaches the actor.

#include <cstddef>
#include <iosfwd>
#include <memory>
#include <span>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/config.hpp"
#include "ghostlink/detail/completion.hpp"
#include "ghostlink/detail/pinned_epoch.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/stats.hpp"
#include "ghostlink/types.hpp"

GHOSTLINK_NAMESPACE_BEGIN
class kv_block_pool;
GHOSTLINK_NAMESPACE_END

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

class actor;
class mailbox;

/// The operations an actor applies. An actor owns one layer (a layer cache)
/// or a group of layers (a sequence's layers and its token ids); every
/// request applies to all of its layers at once.
enum class request_kind : unsigned char { initialize, write_batch, append, truncate, fork, begin_step, commit_step };

/// The argument of an initialize request: the size asked for.
struct initialize_args {
  std::size_t size;
};
/// The argument of a truncate request: the size to keep.
struct truncate_args {
  std::size_t size;
};
/// The argument of a fork request: the tokens to keep first (a
/// sequence's size; by default, all of them).
struct fork_args {
  std::size_t size = static_cast<std::size_t>(-1);
};
/// The argument of a group's append: every layer takes `tokens` tokens at
/// its end, layer `l` from the `l`th write's spans (`tokens` tokens each).
struct append_args {
  std::size_t tokens;
};
/// The argument of a step's begin: drop any token from `index` on, make
/// positions `[index, index + tokens)` of every layer the step's, and stage
/// the epochs that show them (src/core/actor.hpp, group_request).
struct begin_step_args {
  std::size_t index;
  std::size_t tokens;
};
/// The argument of a step's commit: publish the epochs its begin staged.
struct commit_step_args {};

/// One request to an actor. A single write is a batch of one (held in the
/// request), so the actor has one write path.
class request : public operation {
 public:
  request_kind kind() const noexcept { return kind_; }
  /// `initialize`, `truncate` and `fork`: the size asked for; `begin_step`: the index.
  std::size_t size() const noexcept { return size_; }
  /// `append`, `begin_step`: the tokens each layer takes.
  std::size_t tokens() const noexcept { return tokens_; }
  /// `write_batch`: the writes, in order; `append`: one per layer, of
  /// `tokens()` tokens each; `begin_step`: the last layer's (a sequence's
  /// token ids), one of `tokens()` tokens, held in the request.
  std::span<const kv_write> writes() const noexcept { return writes_; }

  /// `fork`: the new cache's actor, set by the actor when the fork succeeds.
  std::shared_ptr<actor> forked;

 protected:
  request(finish_fn finish, initialize_args a) noexcept
      : operation(finish), kind_(request_kind::initialize), size_(a.size) {}
  request(finish_fn finish, truncate_args a) noexcept
      : operation(finish), kind_(request_kind::truncate), size_(a.size) {}
  request(finish_fn finish, fork_args a) noexcept : operation(finish), kind_(request_kind::fork), size_(a.size) {}
  request(finish_fn finish, begin_step_args a, const kv_write& last_layer) noexcept
      : operation(finish),
        kind_(request_kind::begin_step),
        size_(a.index),
        tokens_(a.tokens),
        single_(last_layer),
        writes_(&single_, 1) {}
  request(finish_fn finish, commit_step_args) noexcept : operation(finish), kind_(request_kind::commit_step) {}
  request(finish_fn finish, append_args a, std::span<const kv_write> per_layer) noexcept
      : operation(finish), kind_(request_kind::append), tokens_(a.tokens), writes_(per_layer) {}
  request(finish_fn finish, std::span<const kv_write> writes) noexcept
      : operation(finish), kind_(request_kind::write_batch), writes_(writes) {}
  request(finish_fn finish, const kv_write& single) noexcept
      : operation(finish), kind_(request_kind::write_batch), single_(single), writes_(&single_, 1) {}
  ~request() = default;

 private:
  request_kind kind_;
  std::size_t size_ = 0;
  std::size_t tokens_ = 0;
  kv_write single_{};
  std::span<const kv_write> writes_;
  friend class mailbox;
  request* next_waiting_ = nullptr;  // the mailbox's list of requests waiting for room
};

/// How soon a request's drain should start when it finds the actor idle.
/// `now`: dispatched to the strand, so a caller already on the strand's
/// executor runs the drain at once, on the strand, without a thread hop (its
/// handler is still only queued). `batch`: posted, so requests that arrive
/// meanwhile are applied and published together. `here`: run by the
/// submitting thread inside submit(), as a lock's holder would do the work
/// (its handler is still only queued); the actor's count of pending
/// requests, not the strand, makes it the only drain running.
enum class urgency : unsigned char { now, batch, here };

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
/// The config of the actor's first layer (a sequence's model layers all have it).
const kv_cache_config& config_of(const actor& a) noexcept;
/// Tokens in layer `layer`'s latest published epoch.
std::size_t size_of(const actor& a, std::size_t layer) noexcept;
/// Layer `layer`'s latest published epoch, pinned.
pinned_epoch pin(const actor& a, std::size_t layer) noexcept;
/// Layer `layer`'s statistics; the counters of requests and drains are the actor's.
kv_cache_stats stats_of(const actor& a, std::size_t layer) noexcept;
kv_block_pool pool_of(const actor& a) noexcept;
/// Prints `layer_kv_cache{config=..., size=...}` of layer `layer`.
std::ostream& print(std::ostream& os, const actor& a, std::size_t layer);

}  // namespace detail
GHOSTLINK_NAMESPACE_END
