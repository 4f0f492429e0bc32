#pragma once
// The untyped interface between persist.hpp's templates and the save and
// load machinery in src/ (src/persist/save.cpp, src/persist/load.cpp): each
// operation is one io_op holding the user's handler, type-erased once,
// which the machinery completes exactly once, never inside the initiating
// call.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/block_pool.hpp"
#include "ghostlink/config.hpp"
#include "ghostlink/detail/cache_access.hpp"
#include "ghostlink/detail/completion.hpp"
#include "ghostlink/detail/io_op.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/sequence_kv_cache.hpp"
#include "ghostlink/types.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

/// Turns a finished load into the handler's arguments after the error code.
template <class Sequence>
struct take_loaded {
  std::tuple<Sequence, std::vector<token_id>> operator()(io_op& op) const noexcept {
    return {cache_access::adopt<Sequence>(std::move(op.loaded)), std::move(op.ids)};
  }
};

/// Turns a finished layer read into the handler's second argument.
struct take_layer {
  kv_range operator()(io_op& op) const noexcept { return std::move(op.layer); }
};

/// The snapshot a save writes, untyped. Read on the I/O executor: its
/// members are const and a snapshot is safe to read from any thread.
class saved_sequence {
 public:
  /// Receives one run of stored elements (as bytes).
  using sink = void (*)(void* context, std::span<const std::byte> run);

  saved_sequence() = default;
  saved_sequence(const saved_sequence&) = delete;
  saved_sequence& operator=(const saved_sequence&) = delete;
  virtual ~saved_sequence() = default;

  virtual std::size_t num_layers() const noexcept = 0;
  virtual std::size_t size() const noexcept = 0;
  /// Elements per token of every layer (0 with no layer).
  virtual std::size_t token_width() const noexcept = 0;
  virtual std::vector<token_id> token_ids() const = 0;
  /// Layer `layer`'s window, sinks and first kept position past them.
  virtual window_view window(std::size_t layer) const noexcept = 0;
  /// The sequence's `rollback_tokens`.
  virtual std::size_t rollback_tokens() const noexcept = 0;
  /// Its layout stores keys alone (`kv_model_layout::keys_only`).
  virtual bool keys_only() const noexcept = 0;
  /// What its stored keys and values are multiplied by when read (fp8).
  virtual element_scales scales() const noexcept = 0;
  /// Calls `to(context, run)` for every stored run of layer `layer`'s keys
  /// (or values) of tokens `[begin, end)`, in order.
  virtual void for_each_run(std::size_t layer, bool values, std::size_t begin, std::size_t end, sink to,
                            void* context) const = 0;
};

/// A `basic_sequence_snapshot<T>` as a saved_sequence.
template <storage_element T>
class typed_saved_sequence final : public saved_sequence {
 public:
  explicit typed_saved_sequence(basic_sequence_snapshot<T> s) noexcept : snapshot_(std::move(s)) {}

  std::size_t num_layers() const noexcept override { return snapshot_.num_layers(); }
  std::size_t size() const noexcept override { return snapshot_.size(); }
  std::size_t token_width() const noexcept override {
    return snapshot_.num_layers() == 0 ? 0 : snapshot_.layer(0).token_width();
  }
  std::vector<token_id> token_ids() const override { return snapshot_.token_ids(); }
  window_view window(std::size_t layer) const noexcept override {
    const basic_kv_snapshot<T>& l = snapshot_.layer(layer);
    return {l.window(), l.sink_tokens(), l.kept_from()};
  }
  std::size_t rollback_tokens() const noexcept override { return snapshot_.rollback_tokens(); }
  bool keys_only() const noexcept override {
    return snapshot_.num_layers() != 0 && snapshot_.layer(0).token_width() != 0 &&
           snapshot_.layer(0).value_width() == 0;
  }
  element_scales scales() const noexcept override {
    if (snapshot_.num_layers() == 0) return {};
    return {snapshot_.layer(0).key_scale(), snapshot_.layer(0).value_scale()};
  }
  void for_each_run(std::size_t layer, bool values, std::size_t begin, std::size_t end, sink to,
                    void* context) const override {
    (void)snapshot_.layer(layer).for_each_block(begin, end, [&](std::size_t, std::size_t, auto keys, auto vals) {
      to(context, std::as_bytes(values ? vals : keys));
    });
  }

 private:
  basic_sequence_snapshot<T> snapshot_;
};

/// What a load or a layer read requires of the file.
struct file_expectation {
  std::size_t num_layers;
  kv_cache_config config;
  std::string model;
  element_codec element;  // the element type (its code, size and conversions)
  /// None: full(num_layers). Resolved (and checked against num_layers) by
  /// the load before any I/O.
  std::optional<kv_model_layout> layout;
};

/// Each takes ownership of `op` and completes it exactly once, never inside
/// this call; the file I/O runs on `io`. They throw only if memory is
/// refused or queueing throws, and then discard `op` (its handler destroyed
/// unrun, its work released) first.
void start_save(std::unique_ptr<saved_sequence> snapshot, std::filesystem::path path, const kv_cache_config& config,
                std::string model, element_codec element, std::filesystem::perms mode, const asio::any_io_executor& io,
                io_op* op);
void start_load(asio::any_io_executor ex, std::filesystem::path path, const kv_block_pool& pool,
                file_expectation expected, const asio::any_io_executor& io, io_op* op);
void start_read_layer(std::filesystem::path path, std::size_t layer, file_expectation expected,
                      const asio::any_io_executor& io, io_op* op);

}  // namespace detail
GHOSTLINK_NAMESPACE_END
