#pragma once
// The cell that holds a layer's latest published epoch (or a group's latest
// group_epoch): readers pin it without a lock and without waiting for the
// actor; only the actor publishes.

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include "ghostlink/detail/flavour.hpp"

#include "core/epoch.hpp"
#include "ghostlink/detail/ref_ptr.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// Split reference counting (the idea behind folly's AtomicSharedPtr): one
/// atomic word holds the epoch pointer in its low bits and, in its top bits,
/// a count of readers that have loaded this pointer but not yet settled
/// their reference. A reader bumps that local count with the same fetch_add
/// that loads the pointer, so the epoch cannot be freed under it; it then
/// adds a reference of its own and gives the local one back by CAS.
///
/// When the actor swaps in a new epoch, readers caught between their load
/// and their give-back find the pointer changed and cannot give back: their
/// local count is in the word the actor took, and the actor turns it into
/// real references. Such a reader drops the reference it added itself, so it
/// must never be the one that takes the count to zero before the actor has
/// converted: the actor therefore adds a bias larger than any local count to
/// the old epoch *before* the swap, and afterwards releases the bias minus
/// the converted readers, plus the cell's own reference.
///
/// The reference a reader ends with belongs to it alone: it may cross
/// threads and coroutine resumptions.
///
/// Limits: pointers must fit in 48 bits (x86-64 and AArch64 user space
/// without pointer tags), and fewer than 65,536 readers may be between
/// their load and their give-back at one instant.
template <class E>
class basic_cell {
 public:
  explicit basic_cell(ref_ptr<E> initial) noexcept : word_(pack(initial.detach())) {}
  basic_cell(const basic_cell&) = delete;
  basic_cell& operator=(const basic_cell&) = delete;
  ~basic_cell() { unpack(word_.load(std::memory_order_acquire))->release(); }

  /// The latest published epoch, with a reference of the caller's own.
  /// Lock-free: a retry happens only when another reader or the actor
  /// changed the word between two of this reader's steps.
  ref_ptr<E> pin() const noexcept {
    // acquire: pairs with publish()'s release, so the epoch and every block
    // slot it covers are visible.
    std::uint64_t word = word_.fetch_add(one_reader, std::memory_order_acquire);
    E* e = unpack(word);
    e->add_ref();
    word += one_reader;
    while (unpack(word) == e) {
      // release: our add_ref above happens-before a publish() that no
      // longer counts us.
      if (word_.compare_exchange_weak(word, word - one_reader, std::memory_order_release, std::memory_order_relaxed))
        return ref_ptr<E>::adopt(e);
    }
    // Replaced meanwhile: publish() turns our local count into a real
    // reference, so the one we added is surplus. The bias publish() added
    // before the swap keeps this release from reaching zero.
    e->release();
    return ref_ptr<E>::adopt(e);
  }

  /// Makes `next` the latest epoch. Called by the actor only.
  void publish(ref_ptr<E> next) noexcept {
    E* const previous = unpack(word_.load(std::memory_order_relaxed));  // only we change the pointer
    previous->add_ref(bias);
    const std::uint64_t old = word_.exchange(pack(next.detach()), std::memory_order_acq_rel);
    const auto readers = static_cast<std::uint32_t>(old >> pointer_bits);
    previous->release(bias - readers + 1);  // + 1: the cell's own reference
  }

 private:
  static constexpr unsigned pointer_bits = sizeof(void*) == 8 ? 48 : 32;
  static constexpr std::uint64_t one_reader = std::uint64_t{1} << pointer_bits;
  static constexpr std::uint64_t pointer_mask = one_reader - 1;
  // More than the local count can hold (16 bits on 64-bit targets).
  static constexpr std::uint32_t bias = std::uint32_t{1} << 16;

  static std::uint64_t pack(E* e) noexcept {
    const auto bits = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(e));
    if (bits & ~pointer_mask) std::abort();  // the documented 48-bit limit
    return bits;
  }
  static E* unpack(std::uint64_t word) noexcept {
    return reinterpret_cast<E*>(static_cast<std::uintptr_t>(word & pointer_mask));
  }

  // Pointer in the low bits, readers mid-pin in the high bits (see above).
  mutable std::atomic<std::uint64_t> word_;
};

/// A layer's cell.
using epoch_cell = basic_cell<epoch>;
/// A group's cell (src/core/actor.hpp).
using group_cell = basic_cell<group_epoch>;

}  // namespace detail
GHOSTLINK_NAMESPACE_END
