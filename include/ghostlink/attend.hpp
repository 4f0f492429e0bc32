#pragma once
/// @file
/// `ghostlink::attend`: a reference attention kernel over a snapshot's
/// blocks and a step's pending tokens.

#include <cstddef>
#include <span>
#include <system_error>
#include "ghostlink/detail/flavour.hpp"

#include "ghostlink/element.hpp"
#include "ghostlink/error.hpp"
#include "ghostlink/snapshot.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// The heads of an attention over a cache's tokens: `query_heads` query
/// heads read `kv_heads` stored heads of `head_dim` elements, in groups
/// (grouped-query attention): query head `q` reads KV head
/// `q / (query_heads / kv_heads)`. Multi-head attention has
/// `query_heads == kv_heads`, multi-query attention `kv_heads == 1`.
struct attention_shape {
  /// Query heads per query row: a non-zero multiple of `kv_heads`.
  std::size_t query_heads = 0;
  /// Stored heads per token: the cache's `num_heads`.
  std::size_t kv_heads = 0;
  /// Elements per head: the cache's `head_dim`.
  std::size_t head_dim = 0;
  /// Elements of a head's value, and of its output: 0 stands for
  /// `head_dim`. Over a layer of a `keys_only` layout (latent attention:
  /// one stored head, a latent and a RoPE key), the first `value_dim`
  /// elements of each stored key serve as its value (DeepSeek V3: 512 of
  /// 576). Where values are stored it must be 0 or `head_dim`.
  std::size_t value_dim = 0;
  /// The logits' scale; 0 stands for `1 / sqrt(head_dim)`.
  float scale = 0.0f;
};

/// Tokens to attend after a snapshot's: a step's keys and values as the
/// forward pass computed them, before (or while) its write publishes them.
/// Token-major, `kv_heads * head_dim` floats per token, the same count in
/// both; they follow the snapshot's tokens, at positions `snapshot.size()`
/// on.
struct pending_tokens {
  /// The tokens' keys.
  std::span<const float> keys;
  /// The tokens' values.
  std::span<const float> values;
};

/// The attention of `queries` over every token of `snapshot` followed by
/// the `pending` tokens, into `out`: per query head, the softmax of its
/// scaled dot products with the keys of its group's KV head, weighting
/// that head's values.
///
/// A reference kernel: exact online softmax in one pass over the
/// snapshot's stored runs (no copy; 16-bit elements are widened as they are
/// loaded), vectorised with AVX2, FMA and F16C when the processor has them
/// (chosen at run time) and portable code otherwise, with float
/// accumulation. While it attends a block it prefetches the block three
/// ahead into L2: each block is elsewhere in memory, where the hardware's
/// prefetchers would start over at each. Engines with their own kernels
/// (paged attention on a GPU, say) read `for_each_block` themselves; this
/// one is what ghostlink's example and benchmarks use, and a baseline to
/// check a kernel against.
///
/// `queries` holds `R` rows of `query_heads * head_dim` floats, and `out`
/// receives `R` rows of `query_heads * value_dim` (`value_dim` 0:
/// `head_dim`, as many as `queries`). The rows are the last `R` positions of the tokens
/// attended, in order, each causal: row `r` attends the first
/// `snapshot.size() + pending - R + r + 1` tokens. One row is a decode
/// step's query over everything up to its own token; a prefill step's `n`
/// rows over its `n` pending tokens are the causal prefill.
///
/// A windowed layer's snapshot (`snapshot.window()` not 0, see
/// `kv_model_layout`) masks each row by its layer's layout: row `r` at
/// position `p` attends the positions `j <= p` with
/// `j < snapshot.sink_tokens()` or `j > p - snapshot.window()`, stored or
/// pending, and no other position is read.
///
/// A quantized snapshot (`q8_0`, `q4_0`, `fp8_e4m3`) is read in place, a
/// group or element at a time (no widened copy of a block where the
/// processor has AVX2, FMA and F16C), its fp8 scales applied once per
/// logit and output; the result equals `attend` over its dequantized floats
/// up to the order of the sums.
///
/// Pending tokens are rounded to `T` first (quantized, an fp8 divided by
/// its scale), as the step's write will store them, so the result is what attending after the write would give (up to
/// the order of the sums). A forward pass can thus start layer `l`'s write
/// and attend `step.snapshot_before(l)` with the layer's own tokens pending,
/// without waiting for the write, and await its writes once, by the commit.
///
/// Thread-safe: calls share nothing but the snapshot, which is immutable.
/// Does not allocate after a thread's first calls (its scratch is kept per
/// thread).
///
/// A keys-only layer's snapshot (`snapshot.value_width()` 0) has no
/// values: each key's first `value_dim` elements serve as its value, and
/// `pending.values` must be empty.
///
/// @return `invalid_shape` if a field of `shape` but `scale` and
///         `value_dim` is zero, `query_heads` is not a multiple of
///         `kv_heads`, or `value_dim` exceeds `head_dim` (or, where values
///         are stored, is not `head_dim`; or, for `q8_0` and `q4_0`, is not
///         a multiple of 32); `width_mismatch` if
///         `kv_heads * head_dim` is not the snapshot's token width, the
///         pending tokens are not whole tokens, or `queries` is not whole
///         rows (or empty); `length_mismatch` if the pending keys and values
///         differ in size (or, keys only, values are pending);
///         `index_out_of_range` if there are more rows than tokens;
///         `buffer_too_small` if `out` is shorter than the rows' outputs;
///         `outside_window` if a row of a windowed layer attends a
///         position the layer dropped (`[sink_tokens(), kept_from())`:
///         the next token's row, and a step's, never do). On error `out`
///         is unchanged.
template <storage_element T>
std::error_code attend(const basic_kv_snapshot<T>& snapshot, std::span<const float> queries, std::span<float> out,
                       const attention_shape& shape, pending_tokens pending = {}) noexcept;

/// As `attend` over a snapshot, over `keys.size() / (kv_heads * head_dim)`
/// contiguous tokens instead (a copied range, say), token-major. With
/// `values` empty and `shape.value_dim` not 0, the keys are a keys-only
/// layer's: their first `value_dim` elements serve as values.
/// @return as above, and `width_mismatch` if `keys` is not whole tokens,
///         `length_mismatch` if `keys` and `values` differ in size (but
///         for keys alone).
std::error_code attend(std::span<const float> keys, std::span<const float> values, std::span<const float> queries,
                       std::span<float> out, const attention_shape& shape) noexcept;
/// As above, over `half` tokens.
std::error_code attend(std::span<const half> keys, std::span<const half> values, std::span<const float> queries,
                       std::span<float> out, const attention_shape& shape) noexcept;
/// As above, over `bfloat16` tokens.
std::error_code attend(std::span<const bfloat16> keys, std::span<const bfloat16> values, std::span<const float> queries,
                       std::span<float> out, const attention_shape& shape) noexcept;
/// As above, over `q8_0` tokens (`kv_heads * head_dim / 32` groups each);
/// `invalid_shape` also if `head_dim` or a keys-only `value_dim` is not a
/// multiple of 32.
std::error_code attend(std::span<const q8_0> keys, std::span<const q8_0> values, std::span<const float> queries,
                       std::span<float> out, const attention_shape& shape) noexcept;
/// As above, over `q4_0` tokens.
std::error_code attend(std::span<const q4_0> keys, std::span<const q4_0> values, std::span<const float> queries,
                       std::span<float> out, const attention_shape& shape) noexcept;
/// As above, over `fp8_e4m3` tokens that stand for `key_scale` times the
/// keys' and `value_scale` times the values' codes.
std::error_code attend(std::span<const fp8_e4m3> keys, std::span<const fp8_e4m3> values, std::span<const float> queries,
                       std::span<float> out, const attention_shape& shape, float key_scale = 1.0f,
                       float value_scale = 1.0f) noexcept;

GHOSTLINK_NAMESPACE_END

#include "ghostlink/impl/attend.hpp"
