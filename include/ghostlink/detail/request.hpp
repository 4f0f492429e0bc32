#pragma once
// A write request travelling through the actor's mailbox, and how its
// completion handler is invoked.
//
// Lifetime: the initiating function allocates a request with the handler's
// associated allocator and hands it to the actor (actor::submit). From then
// on the actor owns it until it calls complete() (the handler is posted to
// its associated executor and the request freed first, as Asio requires) or
// discard() (the handler is destroyed unrun, as Asio destroys handlers of a
// destroyed execution context).

#include <atomic>
#include <cstddef>
#include <memory>
#include <span>
#include <system_error>
#include <type_traits>
#include <utility>

#include "ghostlink/detail/asio_config.hpp"

#include <asio/associated_allocator.hpp>
#include <asio/associated_cancellation_slot.hpp>
#include <asio/associated_executor.hpp>
#include <asio/bind_allocator.hpp>
#include <asio/cancellation_type.hpp>
#include <asio/defer.hpp>
#include <asio/execution/blocking.hpp>
#include <asio/execution/executor.hpp>
#include <asio/execution/outstanding_work.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/is_executor.hpp>
#include <asio/post.hpp>
#include <asio/prefer.hpp>
#include <asio/recycling_allocator.hpp>
#include <asio/require.hpp>

#include "ghostlink/detail/ref_ptr.hpp"
#include "ghostlink/types.hpp"

namespace ghostlink::detail {

/// The allocator for a handler's intermediate storage: its associated
/// allocator, else Asio's per-thread recycling allocator (as Asio's own
/// operations use).
template <class Handler>
auto handler_allocator(const Handler& handler) {
  return asio::get_associated_allocator(handler, asio::recycling_allocator<void>());
}

/// Whether work can be queued on `Executor` (`asio::post` and `asio::defer`
/// accept it): a legacy executor, or a standard one that can be made
/// `blocking.never`. Not so for an executor that only runs work inline:
/// since Asio 1.37 the default associated executor is one (where it was the
/// system executor), e.g. that of `experimental::use_promise`'s handler for
/// an initiation that has no executor.
template <class Executor>
inline constexpr bool can_queue_on =
    std::disjunction_v<asio::is_executor<Executor>,
                       std::conjunction<asio::execution::is_executor<Executor>,
                                        asio::can_require<Executor, asio::execution::blocking_t::never_t>>>;

/// The executor a handler's completion is queued on: its associated
/// executor (default `io_ex`), unless work cannot be queued there; then
/// `io_ex`, and the handler runs inline on it, as with Asio's own
/// operations.
template <class Handler, class IoExecutor>
auto completion_executor(const Handler& handler, const IoExecutor& io_ex) {
  using associated = asio::associated_executor_t<Handler, IoExecutor>;
  if constexpr (can_queue_on<associated>)
    return asio::get_associated_executor(handler, io_ex);
  else
    return io_ex;
}

/// How a completion is queued: `post` from an initiating call; `defer` from
/// a drain, whose completions are its continuations, so that on a thread
/// already running the handler's executor they take that thread's private
/// queue (run right after the drain) instead of the shared, locked one. Never
/// `defer` from an initiating call: the caller may then block this thread.
enum class queueing : bool { post, defer };

/// Queues `handler(args...)` on the handler's associated executor (default
/// `io_ex`; see completion_executor()); never runs it inline. Just before
/// the call, on that executor (where Asio's conventions have cancellation
/// emitted), the handler's cancellation slot is cleared: the operation is
/// over.
template <class Handler, class IoExecutor, class... Args>
void post_completion(queueing how, Handler handler, const IoExecutor& io_ex, Args... args) {
  auto ex = completion_executor(handler, io_ex);
  auto alloc = handler_allocator(handler);
  auto call = asio::bind_allocator(alloc, [h = std::move(handler), ... a = std::move(args)]() mutable {
    if (auto slot = asio::get_associated_cancellation_slot(h); slot.is_connected()) slot.clear();
    std::move(h)(std::move(a)...);
  });
  if (how == queueing::defer)
    asio::defer(ex, std::move(call));
  else
    asio::post(ex, std::move(call));
}

/// Keeps a handler's executor from running out of work while its request
/// waits: Asio's `outstanding_work.tracked` property on standard executors
/// (what Asio's own operations use; `executor_work_guard` cannot take a
/// `strand<any_io_executor>` in Asio 1.22), a work guard on legacy ones.
template <class Executor>
auto track_work(const Executor& ex) {
  if constexpr (asio::execution::is_executor<Executor>::value)
    return asio::prefer(ex, asio::execution::outstanding_work.tracked);
  else
    return asio::executor_work_guard<Executor>(ex);
}

/// The executor behind what track_work() returned.
template <class Executor>
const Executor& executor_of(const asio::executor_work_guard<Executor>& work) {
  return work.get_executor();
}
template <class Executor>
const Executor& executor_of(const Executor& tracked) {
  return tracked;
}

class actor;
class mailbox;

/// Whether a request's cancellation slot was emitted, for a request whose
/// handler has one. Shared between the request and the handler installed in
/// the slot, which may outlive the request (the slot's owner may emit after
/// completion). The actor claims a request once, when it takes it: a
/// cancellation seen then wins; one after it changes nothing. So one state
/// may serve several requests (the layers of a sequence's operation): each
/// is claimed or skipped on its own, as the cancellation finds it.
struct cancel_state : ref_counted<cancel_state> {
  std::atomic<bool> cancelled{false};
  static void destroy(cancel_state* s) noexcept { delete s; }

  // acquire/release: whatever the canceller did before is seen by the actor.
  bool claim() const noexcept { return !cancelled.load(std::memory_order_acquire); }
  void cancel() noexcept { cancelled.store(true, std::memory_order_release); }
};

/// What a request's handler's cancellation slot holds: any cancellation
/// (terminal, partial or total: an unapplied request has done nothing)
/// cancels the request unless the actor has claimed it.
struct cancel_handler {
  ref_ptr<cancel_state> state;
  void operator()(asio::cancellation_type type) const noexcept {
    if (type != asio::cancellation_type::none) state->cancel();
  }
};

/// A cancel_state that `slot` cancels, installed in it; null if the slot
/// is not connected (nothing can cancel).
template <class Slot>
ref_ptr<cancel_state> watch_slot(Slot slot) {
  if (!slot.is_connected()) return {};
  auto state = ref_ptr<cancel_state>::adopt(new cancel_state);
  slot.template emplace<cancel_handler>(cancel_handler{state});
  return state;
}

/// A layer request's handler whose cancellation comes from a composed
/// operation (a sequence's fan-out) instead of an associated slot: `state`,
/// which the composed operation's slot cancels, becomes the request's
/// (null: not cancellable).
template <class Handler>
struct cancelled_by_group {
  Handler handler;
  ref_ptr<cancel_state> state;
  template <class... Args>
  void operator()(Args&&... args) {
    std::move(handler)(std::forward<Args>(args)...);
  }
};
template <class Handler>
inline constexpr bool is_cancelled_by_group = false;
template <class Handler>
inline constexpr bool is_cancelled_by_group<cancelled_by_group<Handler>> = true;

/// The argument of an initialize request.
struct initialize_args {
  std::size_t length;
};
/// The argument of a truncate request.
struct truncate_args {
  std::size_t length;
};
/// The argument of a fork request.
struct fork_args {};

/// What a request asks of the actor. A single write is a batch of one (held
/// in `single`), so the actor has one write path.
class request {
 public:
  enum class kind : unsigned char { initialize, write_batch, truncate, fork };

  request(const request&) = delete;
  request& operator=(const request&) = delete;

  kind op() const noexcept { return op_; }
  /// For `initialize` and `truncate`: the requested length.
  std::size_t length() const noexcept { return length_; }
  /// For `write_batch`: the entries, in order.
  std::span<const kv_write> entries() const noexcept { return entries_; }
  /// For `fork`: the new cache's actor, handed to the handler.
  void set_forked(std::shared_ptr<actor> child) noexcept { forked_ = std::move(child); }
  /// The actor takes the request to apply it: false if it was cancelled
  /// first (it must then complete it with operation_aborted, unapplied).
  /// Called once per request.
  bool claim() noexcept { return !cancel_ || cancel_->claim(); }

  /// Queues the handler with `ec` (and a fork's result) and frees the request.
  void complete(std::error_code ec, queueing how) { finish_(this, &ec, how); }
  /// Destroys the handler unrun and frees the request.
  void discard() noexcept { finish_(this, nullptr, queueing::post); }

 protected:
  using finish_fn = void (*)(request*, const std::error_code*, queueing);

  request(finish_fn finish, initialize_args a) noexcept : finish_(finish), op_(kind::initialize), length_(a.length) {}
  request(finish_fn finish, truncate_args a) noexcept : finish_(finish), op_(kind::truncate), length_(a.length) {}
  request(finish_fn finish, fork_args) noexcept : finish_(finish), op_(kind::fork) {}
  request(finish_fn finish, std::span<const kv_write> entries) noexcept
      : finish_(finish), op_(kind::write_batch), entries_(entries) {}
  request(finish_fn finish, const kv_write& single) noexcept
      : finish_(finish), op_(kind::write_batch), single_(single), entries_(&single_, 1) {}
  ~request() = default;

  std::shared_ptr<actor> take_forked() noexcept { return std::move(forked_); }
  /// Makes the request cancellable through `state` (if not null).
  void watch(ref_ptr<cancel_state> state) noexcept { cancel_ = std::move(state); }

 private:
  finish_fn finish_;
  kind op_;
  std::size_t length_ = 0;
  kv_write single_{};
  std::span<const kv_write> entries_;
  std::shared_ptr<actor> forked_;
  ref_ptr<cancel_state> cancel_;  // null unless the handler has a cancellation slot
  friend class mailbox;
  request* next_waiting_ = nullptr;  // the mailbox's list of requests waiting for room
};

/// A request carrying its completion handler and a work guard on the
/// handler's executor (so that executor's context does not run out of work
/// while the request waits in the mailbox). `MakeResult`, if not void,
/// turns a fork's actor into the handler's second argument.
template <class Handler, class IoExecutor, class MakeResult = void>
class request_op final : public request {
 public:
  using handler_executor =
      decltype(completion_executor(std::declval<const Handler&>(), std::declval<const IoExecutor&>()));
  using work_type = decltype(track_work(std::declval<const handler_executor&>()));
  using allocator_type = typename std::allocator_traits<decltype(handler_allocator(
      std::declval<const Handler&>()))>::template rebind_alloc<request_op>;

  /// Allocates the request with the handler's associated allocator.
  template <class Arg>
  static request* make(Handler&& handler, const IoExecutor& io_ex, const Arg& arg) {
    allocator_type alloc(handler_allocator(handler));
    request_op* p = std::allocator_traits<allocator_type>::allocate(alloc, 1);
    try {
      return ::new (static_cast<void*>(p)) request_op(std::move(handler), io_ex, arg);
    } catch (...) {
      std::allocator_traits<allocator_type>::deallocate(alloc, p, 1);
      throw;
    }
  }

 private:
  template <class Arg>
  request_op(Handler&& handler, const IoExecutor& io_ex, const Arg& arg)
      : request(&finish, arg), work_(track_work(completion_executor(handler, io_ex))), handler_(std::move(handler)) {
    if constexpr (is_cancelled_by_group<Handler>)
      watch(handler_.state);
    else
      watch(watch_slot(asio::get_associated_cancellation_slot(handler_)));
  }

  static void finish(request* base, const std::error_code* ec, queueing how) {
    auto* self = static_cast<request_op*>(base);
    allocator_type alloc(handler_allocator(self->handler_));
    Handler handler(std::move(self->handler_));
    work_type work(std::move(self->work_));
    std::shared_ptr<actor> forked = self->take_forked();
    self->~request_op();
    std::allocator_traits<allocator_type>::deallocate(alloc, self, 1);
    if (!ec) return;
    if constexpr (std::is_void_v<MakeResult>)
      post_completion(how, std::move(handler), executor_of(work), *ec);
    else
      post_completion(how, std::move(handler), executor_of(work), *ec, MakeResult{}(std::move(forked)));
  }

  work_type work_;
  Handler handler_;
};

}  // namespace ghostlink::detail
