#pragma once
// An intrusive reference-counted pointer for the storage objects (blocks,
// page tables, epochs). Intrusive, not std::shared_ptr, because the epoch
// publication cell (epoch_cell.hpp) must manipulate the count directly.

#include <atomic>
#include <cstdint>
#include <utility>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// Base of a reference-counted object. `Derived::destroy(Derived*)` frees it
/// when the last reference goes; a new object starts with one reference.
template <class Derived>
class ref_counted {
 public:
  void add_ref(std::uint32_t n = 1) const noexcept { refs_.fetch_add(n, std::memory_order_relaxed); }
  void release(std::uint32_t n = 1) const noexcept {
    // acq_rel: every use by other owners happens-before the destruction.
    if (refs_.fetch_sub(n, std::memory_order_acq_rel) == n)
      Derived::destroy(static_cast<Derived*>(const_cast<ref_counted*>(this)));
  }
  /// True when no one else holds a reference. Only meaningful to an owner
  /// that knows no new reference can appear concurrently.
  bool unique() const noexcept { return refs_.load(std::memory_order_acquire) == 1; }

 protected:
  ref_counted() = default;
  ~ref_counted() = default;

 private:
  mutable std::atomic<std::uint32_t> refs_{1};
};

/// Owns one reference to a `ref_counted` object (or nothing).
template <class T>
class ref_ptr {
 public:
  ref_ptr() noexcept = default;
  /// Takes over a reference the caller already holds.
  static ref_ptr adopt(T* p) noexcept {
    ref_ptr r;
    r.p_ = p;
    return r;
  }
  /// Adds a reference of its own.
  static ref_ptr share(T* p) noexcept {
    if (p) p->add_ref();
    return adopt(p);
  }
  ref_ptr(const ref_ptr& o) noexcept : p_(o.p_) {
    if (p_) p_->add_ref();
  }
  ref_ptr(ref_ptr&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  ref_ptr& operator=(ref_ptr o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  ~ref_ptr() {
    if (p_) p_->release();
  }
  /// Gives up ownership without releasing.
  T* detach() noexcept { return std::exchange(p_, nullptr); }
  T* get() const noexcept { return p_; }
  T* operator->() const noexcept { return p_; }
  T& operator*() const noexcept { return *p_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }
  friend bool operator==(const ref_ptr& a, const ref_ptr& b) noexcept { return a.p_ == b.p_; }

 private:
  T* p_ = nullptr;
};

}  // namespace detail
GHOSTLINK_NAMESPACE_END
