#pragma once
// What a layer cache's actor is asked to do: one request shape for every
// operation, built by the initiating templates and applied in src/actor.cpp.

#include <cstddef>
#include <memory>
#include <span>

#include "ghostlink/detail/completion.hpp"
#include "ghostlink/types.hpp"

namespace ghostlink::detail {

class actor;
class mailbox;

/// The operations a layer's actor applies.
enum class request_kind : unsigned char { initialize, write_batch, truncate, fork };

/// The argument of an initialize request: the size asked for.
struct initialize_args {
  std::size_t size;
};
/// The argument of a truncate request: the size to keep.
struct truncate_args {
  std::size_t size;
};
/// The argument of a fork request.
struct fork_args {};

/// One request to a layer's actor. A single write is a batch of one (held in
/// the request), so the actor has one write path.
class request : public operation {
 public:
  request_kind kind() const noexcept { return kind_; }
  /// `initialize` and `truncate`: the size asked for.
  std::size_t size() const noexcept { return size_; }
  /// `write_batch`: the entries, in order.
  std::span<const kv_write> entries() const noexcept { return entries_; }

  /// `fork`: the new cache's actor, set by the actor when the fork succeeds.
  std::shared_ptr<actor> forked;

 protected:
  request(finish_fn finish, initialize_args a) noexcept
      : operation(finish), kind_(request_kind::initialize), size_(a.size) {}
  request(finish_fn finish, truncate_args a) noexcept
      : operation(finish), kind_(request_kind::truncate), size_(a.size) {}
  request(finish_fn finish, fork_args) noexcept : operation(finish), kind_(request_kind::fork) {}
  request(finish_fn finish, std::span<const kv_write> entries) noexcept
      : operation(finish), kind_(request_kind::write_batch), entries_(entries) {}
  request(finish_fn finish, const kv_write& single) noexcept
      : operation(finish), kind_(request_kind::write_batch), single_(single), entries_(&single_, 1) {}
  ~request() = default;

 private:
  request_kind kind_;
  std::size_t size_ = 0;
  kv_write single_{};
  std::span<const kv_write> entries_;
  friend class mailbox;
  request* next_waiting_ = nullptr;  // the mailbox's list of requests waiting for room
};

}  // namespace ghostlink::detail
