#pragma once
/// @file
/// Saving a sequence to a file and loading it back: `async_save`,
/// `async_load` and `async_read_layer`. The file format (versioned, with an
/// XXH3 checksum per section and a per-layer offset table) is given byte by
/// byte in docs/FORMAT.md.
///
/// Where the I/O runs: file I/O (open, read, write, fsync, rename) runs on
/// the executor given as `io_executor` in the options, else on a small
/// private pool of two threads, created at the first save or load that
/// needs it and joined at exit. A save's or a layer read's handler without
/// an associated executor runs on that I/O executor, so on the private pool
/// when none is given: it must not block there (nor wait for another save
/// or load), or it stalls every save and load of the process. Never on a cache's strand: a load
/// reads into new pool blocks on the I/O executor and appends only the
/// tokens of a last partial block through the sequence's actors, like any
/// other append; a save reads its snapshot (lock-free) on the I/O executor.
///
/// Cost: a save writes every layer's stored elements as they are (`T`'s
/// bits), hashing them with XXH3 (several GB/s) on the way; a load reads
/// the file once through one open descriptor: the header, the token ids
/// and the layer table, then each layer's full blocks straight into new
/// pool blocks (`preadv`, no conversion: the file holds the blocks' stored
/// elements), its checksum computed over the very bytes read; the sequence
/// is then made on those blocks, as a prefix cache's attach is.
///
/// Cancellation: each operation honours its handler's associated
/// cancellation slot (any type) until it finishes: a save stops before its
/// rename (the temporary file is removed, any old file is intact), a load
/// between layers and before its last partial block's append (what it read
/// is released), a layer read before it starts. Each then completes with
/// `asio::error::operation_aborted`.

#include <concepts>
#include <cstddef>
#include <filesystem>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/block_pool.hpp"
#include "ghostlink/completion_token.hpp"
#include "ghostlink/config.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/error.hpp"
#include "ghostlink/layout.hpp"
#include "ghostlink/sequence_kv_cache.hpp"
#include "ghostlink/types.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// What `async_save` needs beyond the snapshot, which carries neither its
/// geometry's split into heads nor a model id.
struct kv_save_options {
  /// The sequence's config (`seq.config()`): its `num_heads`, `head_dim`
  /// and `block_tokens` are stored (the budget fields are not), and
  /// `token_width()` must be the snapshot's.
  kv_cache_config config;
  /// The model the keys and values are of, stored as given (at most
  /// 65536 bytes): a load refuses the file unless it expects the same.
  std::string model{};
  /// Where the file I/O runs; none: ghostlink's private I/O pool.
  std::optional<asio::any_io_executor> io_executor{};
  /// The permission bits of the file, exactly (whatever the umask).
  /// Default: the owner's only (0600): a saved sequence is the model's
  /// keys and values of someone's prompt. Last, so that
  /// `{config, model, executor}` still initializes the others.
  std::filesystem::perms file_mode = std::filesystem::perms::owner_read | std::filesystem::perms::owner_write;
};

/// Where a load's (or a layer read's) file I/O runs.
struct kv_load_options {
  /// None: ghostlink's private I/O pool.
  std::optional<asio::any_io_executor> io_executor{};
};

/// What a load expects of the file: it refuses any other.
struct kv_sequence_expectation {
  /// The model's layers (`geometry_mismatch` otherwise).
  std::size_t num_layers = 0;
  /// The config of the sequence to make: the file's `num_heads`, `head_dim`
  /// and `block_tokens` must be its own (`geometry_mismatch` otherwise),
  /// and it must fit the pool, as for any sequence made on it.
  kv_cache_config config;
  /// The model id the file was saved with (`model_mismatch` otherwise).
  std::string model{};
  /// The layout the sequence was saved with (`layout_mismatch` otherwise:
  /// each layer's window and sinks, and `rollback_tokens`). None:
  /// `kv_model_layout::full(num_layers)`, which files of format version 1
  /// always are. Given, its `num_layers()` must be `num_layers`
  /// (`invalid_config` otherwise).
  std::optional<kv_model_layout> layout{};
};

/// Saves the tokens `snapshot` shows, with their token ids, to `path`: a
/// temporary file in the same directory is written, flushed to disk
/// (`fsync`) and renamed over `path`, and the directory is flushed, so
/// `path` holds either its old contents or the whole new file, even across
/// a crash. On failure the temporary file is removed and `path` is as
/// before. The snapshot may be taken while writers keep appending: the file
/// holds exactly its tokens.
///
/// The file records the sequence's layout (each layer's window and sinks,
/// and `rollback_tokens()`, docs/FORMAT.md version 2); a windowed layer
/// saves its sinks and what it holds from `kept_from()` on, nothing it
/// dropped.
///
/// Completion signature: `void(error_code)`. Errors: `layer_mismatch` (an
/// empty snapshot: no layers), `invalid_config` (a zero field in
/// `options.config`, scales other than the snapshot's (`key_scale()`,
/// `value_scale()`: what an fp8 file records), or a model id over 65536
/// bytes), `width_mismatch`
/// (`options.config.token_width()` not the snapshot's), all before any
/// I/O; the operating system's (`errno` in the generic category, e.g.
/// `ENOENT`, `ENOTDIR`, `EACCES`, `ENOSPC`; after the rename, only the
/// directory's `fsync` can fail: the new file is in place then, but may not
/// survive a crash); `capacity_exhausted` if memory is refused;
/// `asio::error::operation_aborted` if cancelled before the rename.
///
/// Handler: queued on its associated executor (without one, the I/O
/// executor: it must not block there), never run inside this call.
///
/// @param snapshot what to save (moved in: it stays pinned until completion).
/// @param path     the file to write or replace.
/// @param options  the geometry and model id to store, and the I/O executor.
/// @param token    the completion token; none is needed to `co_await`.
/// @return what `asio::async_initiate` makes of `token`: by default an
///         `asio::awaitable<void>`.
template <storage_element T, class CompletionToken = default_completion_token>
auto async_save(basic_sequence_snapshot<T> snapshot, std::filesystem::path path, kv_save_options options,
                CompletionToken&& token = default_completion_token());

/// Loads the sequence saved in `path` as a new `basic_sequence_kv_cache<T>`
/// on `ex` taking its blocks from `pool`, and its token ids. The header,
/// the token ids and the layer table are checked first (their checksums,
/// the sizes, `expected`); the blocks the tokens need are then reserved at
/// once (`kv_block_pool::reserve`), each layer is read into its blocks and
/// checked against its checksum, and the tokens of a last partial block are
/// appended through the sequence's actors: bit for bit as saved. A windowed
/// layer holds what it held when saved (the same `kept_from()`), and the
/// sequence's high-water mark is its size (or more, as after a truncate:
/// see `kv_model_layout`). A refused
/// file makes no sequence, and the blocks a load took are back in the pool
/// before its handler runs. The full blocks read are the sequence's to
/// read, never to write: a truncate into them and the appends after it
/// write new blocks (copy on write), as for an attached prefix.
///
/// Completion signature: `void(error_code, basic_sequence_kv_cache<T>,
/// std::vector<token_id>)`: the sequence (an empty handle on error) and
/// each token's id (`no_token_id` for a token stored without one). Errors:
/// `invalid_config` (a bad `expected.config`, one that does not fit `pool`,
/// zero layers, a bad `expected.layout` or one of another number of
/// layers), the operating system's (`errno` in the generic category:
/// `ENOENT` for a missing file, `EISDIR` for a directory, `EINVAL` for
/// anything else that is not a regular file, such as a FIFO, refused
/// without waiting for a writer), `file_corrupt` (also a nonzero padding
/// byte), `file_truncated`,
/// `file_version_unsupported`, `element_type_mismatch` (a file of another
/// `T`, or an fp8 file of other scales than `expected.config`'s),
/// `geometry_mismatch`, `model_mismatch`, `layout_mismatch` (a file
/// saved with another layout than `expected.layout`), `index_out_of_range` (more
/// tokens than `expected.config.max_tokens_per_seq`), `capacity_exhausted`
/// (the pool cannot give the blocks: none taken; or memory refused), and
/// `asio::error::operation_aborted` if cancelled first.
///
/// Handler: queued on its associated executor (without one, `ex`), never
/// run inside this call.
///
/// A file changed in place (not replaced by a rename) by another program
/// while it loads: each part the load uses (the header, the token ids, the
/// layer table, each layer) is checked against its checksum over the very
/// bytes it uses (a layer straight into its blocks, which nothing sees
/// before every layer has passed), so a change torn within a part is
/// `file_corrupt`, never data. The parts are read one after
/// another, though, and only the layers are bound to the table (by its
/// checksums): a file rewritten in place by another save of the same
/// layout between those reads may load the one's token ids with the
/// other's layers. Replace files by a rename, as `async_save` does.
///
/// @param ex       the executor of the new sequence (its layers' strands).
/// @param path     the file to read.
/// @param pool     the pool of the new sequence's blocks.
/// @param expected what the file must hold: layers, geometry, model.
/// @param token    the completion token; none is needed to `co_await`.
/// @return what `asio::async_initiate` makes of `token`: by default an
///         `asio::awaitable<std::tuple<basic_sequence_kv_cache<T>,
///         std::vector<token_id>>>`.
template <storage_element T, class CompletionToken = default_completion_token>
  requires(!std::same_as<std::decay_t<CompletionToken>, kv_load_options>)
auto async_load(asio::any_io_executor ex, std::filesystem::path path, kv_block_pool pool,
                kv_sequence_expectation expected, CompletionToken&& token = default_completion_token());

/// As above, with the file I/O on `options.io_executor`.
template <storage_element T, class CompletionToken = default_completion_token>
auto async_load(asio::any_io_executor ex, std::filesystem::path path, kv_block_pool pool,
                kv_sequence_expectation expected, kv_load_options options,
                CompletionToken&& token = default_completion_token());

/// Reads layer `layer` of the sequence saved in `path` alone, through the
/// file's offset table: the header, the table and that layer's checksum are
/// checked, no other layer is read. No sequence is made and no block taken.
///
/// Completion signature: `void(error_code, kv_range)`: every token of the
/// layer (`begin` 0, `end` the tokens saved), widened exactly to floats.
/// A windowed layer that dropped positions has no whole layer to give:
/// `outside_window` (load the sequence and read its snapshot instead).
/// Errors: as `async_load` (`capacity_exhausted` only if memory is refused;
/// `index_out_of_range`, more tokens than
/// `expected.config.max_tokens_per_seq`, is checked before the layer is
/// read), and `layer_mismatch` if `layer >= expected.num_layers`. Of the
/// padding, what precedes the layer table and the layer's own tail are
/// checked.
///
/// Handler: queued on its associated executor (without one, the I/O
/// executor: it must not block there), never run inside this call.
///
/// @param path     the file to read.
/// @param layer    the layer to read.
/// @param expected what the file must hold: layers, geometry, model.
/// @param token    the completion token; none is needed to `co_await`.
/// @return what `asio::async_initiate` makes of `token`: by default an
///         `asio::awaitable<kv_range>`.
template <storage_element T, class CompletionToken = default_completion_token>
  requires(!std::same_as<std::decay_t<CompletionToken>, kv_load_options>)
auto async_read_layer(std::filesystem::path path, std::size_t layer, kv_sequence_expectation expected,
                      CompletionToken&& token = default_completion_token());

/// As above, with the file I/O on `options.io_executor`.
template <storage_element T, class CompletionToken = default_completion_token>
auto async_read_layer(std::filesystem::path path, std::size_t layer, kv_sequence_expectation expected,
                      kv_load_options options, CompletionToken&& token = default_completion_token());

GHOSTLINK_NAMESPACE_END

#include "ghostlink/impl/persist.hpp"
