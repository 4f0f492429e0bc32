#pragma once
// How an operation stores its completion handler and runs it: the one piece
// of work tracking plus completion that every asynchronous operation of
// ghostlink (a layer's request, a sequence's operation) is built on.
//
// Lifetime: the initiating function allocates an operation with the
// handler's associated allocator (handler_op::make) and hands it to the
// machinery in src/. From then on the machinery owns it until it calls
// complete() (the operation is freed first, then the handler queued on its
// associated executor, as Asio requires) or discard() (the handler is
// destroyed unrun, as Asio destroys handlers of a destroyed execution
// context).

#include <atomic>
#include <memory>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <utility>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/detail/ref_ptr.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// True for the handler of a `co_await` through `asio::use_awaitable`: the
/// coroutine suspends right after the initiating call and can have no other
/// write of its own in flight, so its drain is best started at once (see
/// urgency). Any other handler may belong to a caller that keeps many writes
/// in flight, whose drains should batch them.
template <class Handler>
struct resumes_coroutine : std::false_type {};
#if defined(GHOSTLINK_HAS_CO_AWAIT)
template <class Executor, class... Ts>
struct resumes_coroutine<asio::detail::awaitable_handler<Executor, Ts...>> : std::true_type {};
#endif

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

/// A queued completion: calls the handler with its arguments. It carries the
/// handler's allocator as a member type, not through `asio::bind_allocator`,
/// so it has no associated executor of its own and Asio queues it without
/// wrapping it in a second work-tracking dispatcher.
template <class Handler, class Allocator, class... Args>
struct completion_call {
  using allocator_type = Allocator;
  allocator_type get_allocator() const noexcept { return allocator; }
  void operator()() {
    if (auto slot = asio::get_associated_cancellation_slot(handler); slot.is_connected()) slot.clear();
    std::apply([this](Args&... a) { std::move(handler)(std::move(a)...); }, args);
  }

  Handler handler;
  Allocator allocator;
  std::tuple<Args...> args;
};

/// Queues `handler(args...)` on the handler's associated executor (default
/// `io_ex`; see completion_executor()); never runs it inline. Just before
/// the call, on that executor (where Asio's conventions have cancellation
/// emitted), the handler's cancellation slot is cleared: the operation is
/// over.
template <class Handler, class IoExecutor, class... Args>
void post_completion(queueing how, Handler handler, const IoExecutor& io_ex, Args... args) {
  auto ex = completion_executor(handler, io_ex);
  auto alloc = handler_allocator(handler);
  completion_call<Handler, decltype(alloc), Args...> call{std::move(handler), alloc, {std::move(args)...}};
  if (how == queueing::defer)
    asio::defer(ex, std::move(call));
  else
    asio::post(ex, std::move(call));
}

/// Keeps a handler's executor from running out of work while its operation
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

/// Whether an operation's cancellation slot was emitted. Shared between the
/// operation and the handler installed in the slot, which may outlive the
/// operation (the slot's owner may emit after completion). An actor claims
/// a request once, when it takes it: a cancellation seen then wins; one
/// after it changes nothing. So one state may serve several requests (the
/// layers of a sequence's operation): each is claimed or skipped on its own,
/// as the cancellation finds it.
struct cancel_state : ref_counted<cancel_state> {
  std::atomic<bool> cancelled{false};
  static void destroy(cancel_state* s) noexcept { delete s; }

  // acquire/release: whatever the canceller did before is seen by the actor.
  bool claim() const noexcept { return !cancelled.load(std::memory_order_acquire); }
  void cancel() noexcept { cancelled.store(true, std::memory_order_release); }
};

/// What an operation's handler's cancellation slot holds: any cancellation
/// (terminal, partial or total: an unapplied request has done nothing)
/// cancels the operation unless the actor has claimed it.
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

/// What every operation has, untyped: how it completes, and what cancels it.
/// `complete()` and `discard()` each end the operation (and free it); one of
/// them is called exactly once.
class operation {
 public:
  operation(const operation&) = delete;
  operation& operator=(const operation&) = delete;

  /// False if the operation was cancelled before this call; the caller must
  /// then complete it with operation_aborted, unapplied.
  bool claim() const noexcept { return !cancel_ || cancel_->claim(); }
  /// What cancels this operation (null: nothing can).
  const ref_ptr<cancel_state>& cancellation() const noexcept { return cancel_; }
  /// Makes the operation cancellable through `state` (if not null).
  void watch(ref_ptr<cancel_state> state) noexcept { cancel_ = std::move(state); }

  /// Ends the operation with `ec` (and its typed result, if it has one).
  void complete(error_code ec, queueing how) { finish_(this, &ec, how); }
  /// Ends the operation with its handler (if any) destroyed unrun.
  void discard() noexcept { finish_(this, nullptr, queueing::post); }

 protected:
  /// Called once: `ec` null to discard.
  using finish_fn = void (*)(operation*, const error_code* ec, queueing);
  explicit operation(finish_fn finish) noexcept : finish_(finish) {}
  ~operation() = default;

 private:
  finish_fn finish_;
  ref_ptr<cancel_state> cancel_;  // null unless something can cancel the operation
};

/// Whether a `MakeResult` makes several arguments (a `std::tuple` of them).
template <class T>
struct is_tuple : std::false_type {};
template <class... T>
struct is_tuple<std::tuple<T...>> : std::true_type {};

/// An operation of shape `Base` (a request, a sequence operation) carrying
/// its completion handler and a hold on the handler's executor's work (so
/// that context does not run out of work while the operation waits).
/// `MakeResult`, if not void, turns the finished `Base` into the handler's
/// second argument (a fork's new cache), or into its arguments after the
/// first as a `std::tuple` (a load's sequence and token ids).
template <class Base, class Handler, class IoExecutor, class MakeResult = void>
class handler_op final : public Base {
 public:
  using handler_executor =
      decltype(completion_executor(std::declval<const Handler&>(), std::declval<const IoExecutor&>()));
  using work_type = decltype(track_work(std::declval<const handler_executor&>()));
  using allocator_type = typename std::allocator_traits<decltype(handler_allocator(
      std::declval<const Handler&>()))>::template rebind_alloc<handler_op>;

  /// Allocates the operation with the handler's associated allocator,
  /// cancellable through the handler's associated slot.
  template <class... Args>
  static handler_op* make(Handler&& handler, const IoExecutor& io_ex, Args&&... args) {
    allocator_type alloc(handler_allocator(handler));
    handler_op* p = std::allocator_traits<allocator_type>::allocate(alloc, 1);
    try {
      return ::new (static_cast<void*>(p)) handler_op(std::move(handler), io_ex, std::forward<Args>(args)...);
    } catch (...) {
      std::allocator_traits<allocator_type>::deallocate(alloc, p, 1);
      throw;
    }
  }

 private:
  template <class... Args>
  handler_op(Handler&& handler, const IoExecutor& io_ex, Args&&... args)
      : Base(&finish, std::forward<Args>(args)...),
        work_(track_work(completion_executor(handler, io_ex))),
        handler_(std::move(handler)) {
    this->watch(watch_slot(asio::get_associated_cancellation_slot(handler_)));
  }

  static void finish(operation* base, const error_code* ec, queueing how) {
    auto* self = static_cast<handler_op*>(base);
    allocator_type alloc(handler_allocator(self->handler_));
    Handler handler(std::move(self->handler_));
    work_type work(std::move(self->work_));
    if constexpr (std::is_void_v<MakeResult>) {
      self->~handler_op();
      std::allocator_traits<allocator_type>::deallocate(alloc, self, 1);
      if (ec) post_completion(how, std::move(handler), executor_of(work), *ec);
    } else {
      auto result = MakeResult{}(static_cast<Base&>(*self));
      self->~handler_op();
      std::allocator_traits<allocator_type>::deallocate(alloc, self, 1);
      if (!ec) return;
      if constexpr (is_tuple<decltype(result)>::value)  // several results: the handler's arguments after `ec`
        std::apply(
            [&](auto&... r) { post_completion(how, std::move(handler), executor_of(work), *ec, std::move(r)...); },
            result);
      else
        post_completion(how, std::move(handler), executor_of(work), *ec, std::move(result));
    }
  }

  work_type work_;
  Handler handler_;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
