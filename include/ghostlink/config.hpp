#pragma once
/// @file
/// The shape of one layer's KV cache: how many tokens, how wide a token is,
/// how tokens are grouped into storage blocks, and the storage budget.

#include <cstddef>
#include <iosfwd>
#include <limits>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// Geometry and budget of a `layer_kv_cache`.
///
/// Every field must be non-zero; `layer_kv_cache` throws `std::system_error`
/// with `kv_errc::invalid_config` otherwise (and when the sizes overflow).
struct kv_cache_config {
  /// Tokens one sequence may hold; writes at or past it fail with
  /// `kv_errc::index_out_of_range` and `initialize(n)` clamps `n` to it.
  std::size_t max_tokens_per_seq = 8192;
  /// Key/value heads per token: the heads the cache stores, which under
  /// grouped-query attention (GQA) are fewer than the model's query heads
  /// and under multi-query attention (MQA) are one. A Llama-3-8B layer, 32
  /// query heads sharing 8 KV heads of 128 dims, is `num_heads = 8,
  /// head_dim = 128`: each query head attends over the stored KV head of
  /// its group (query head `q` reads KV head `q / (32 / 8)`).
  std::size_t num_heads = 4;
  /// Floats per head (the seed's `hidden_dim_per_head`).
  std::size_t head_dim = 64;
  /// Tokens per storage block: the unit of allocation and copy-on-write.
  std::size_t block_tokens = 16;
  /// Most blocks this cache may hold at once (live epochs included), for a
  /// cache with a private pool (shared with its forks); a write that needs
  /// one more fails with `kv_errc::capacity_exhausted`. A cache made on a
  /// `kv_block_pool` leaves the budget to the pool and must not set it.
  std::size_t max_blocks = std::numeric_limits<std::size_t>::max();
  /// Most requests (writes, initializes, truncates, forks) queued for the
  /// actor at once: backpressure. A request initiated while that many are
  /// queued waits for room, in FIFO order and without allocating, and is
  /// applied after them; its handler runs, as always, once it is applied.
  /// The mailbox's memory, which it keeps at its peak for the cache's life,
  /// then stays bounded by `max_pending` however many producers write at
  /// once. Unlimited by default.
  std::size_t max_pending = std::numeric_limits<std::size_t>::max();

  /// What an `fp8_e4m3` cache divides keys by before it rounds them, and
  /// multiplies them by when it reads them (vLLM's `k_scale`): part of what
  /// the stored data means, so recorded with it (the prefix cache's block
  /// hash, saved sequences, store entries). Must be 1 for the other element
  /// types; finite, positive and at most 1e30 for fp8.
  float key_scale = 1.0f;
  /// As `key_scale`, for values (vLLM's `v_scale`).
  float value_scale = 1.0f;

  /// Floats one token's keys (or values) occupy: `num_heads * head_dim`.
  constexpr std::size_t token_width() const noexcept { return num_heads * head_dim; }

  /// Field-by-field equality.
  friend bool operator==(const kv_cache_config&, const kv_cache_config&) = default;
};

/// Prints every field, e.g. `{max_tokens_per_seq=8192, num_heads=4, ...}`.
std::ostream& operator<<(std::ostream& os, const kv_cache_config& config);

namespace detail {
/// Throws `std::system_error(kv_errc::invalid_config)` unless every size is
/// non-zero, a block of elements stored `group_bytes` per `group` fits in
/// `std::size_t`, `head_dim` is a multiple of `group` (a group never spans
/// two heads), and the scales are 1, or (`scaled`: fp8) finite, positive
/// and at most 1e30.
void validate(const kv_cache_config& config, std::size_t group_bytes = sizeof(float), std::size_t group = 1,
              bool scaled = false);
/// Whether `s` may be a `key_scale` or `value_scale`: 1, or (`scaled`: fp8)
/// finite, positive and at most 1e30 (false for NaN).
constexpr bool valid_scale(float s, bool scaled) noexcept { return scaled ? s > 0.0f && s <= 1e30f : s == 1.0f; }
}  // namespace detail

GHOSTLINK_NAMESPACE_END
