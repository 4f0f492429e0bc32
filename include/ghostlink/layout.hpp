#pragma once
/// @file
/// Model layouts: which layers of a sequence keep and attend every token,
/// and which slide over a window (with attention sinks).

#include <cstddef>
#include <iosfwd>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

GHOSTLINK_NAMESPACE_BEGIN

/// How one layer attends, and so what it keeps.
struct kv_layer_layout {
  /// 0: the layer keeps and attends every token. `W > 0`: a query at
  /// position `p` attends positions `p - W + 1` to `p` (and the sinks), and
  /// the layer keeps only what the next queries can attend.
  std::size_t window = 0;
  /// With a window: the first `sink_tokens` positions are kept and
  /// attended too (StreamingLLM's attention sinks). Must be 0 without a
  /// window.
  std::size_t sink_tokens = 0;
  /// Field-by-field equality.
  friend bool operator==(const kv_layer_layout&, const kv_layer_layout&) = default;
};

/// The layers of a model, as a `basic_sequence_kv_cache` holds them.
///
/// A windowed layer keeps the positions `p < sink_tokens` and
/// `p >= h + 1 - window - rollback_tokens`, where `h` is the sequence's
/// high-water mark (the most tokens it has held since it was made, forked
/// from such a sequence, loaded, or truncated below `h - rollback_tokens`):
/// at most `ceil(sink_tokens / B) + ceil((window + rollback_tokens) / B) + 1`
/// blocks of `B` tokens, however long the sequence.
struct kv_model_layout {
  /// One per model layer, layer 0 first.
  std::vector<kv_layer_layout> layers;
  /// Keys only (multi-head latent attention, DeepSeek V2/V3): every layer
  /// stores one vector per token as its keys (a latent and a RoPE key:
  /// `num_heads` 1, `head_dim` 576 in DeepSeek V3) and no values. Appends
  /// and step writes take empty values (others are `length_mismatch`),
  /// reads hand out none (`value_width()` 0), and `attend` reads each key's
  /// first `attention_shape::value_dim` elements as its value. Its blocks
  /// hold half the bytes, on a pool of `kv_block_kind::keys_only`
  /// (`kv_block_pool::for_caches(config, kv_block_kind::keys_only)`); a
  /// sequence and a pool of different kinds are `invalid_config`. Combines
  /// with windows.
  bool keys_only = false;
  /// Tokens a truncate may take back without the windows refusing it (a
  /// speculative decoder's draft length): windowed layers keep that many
  /// more positions. Set it when truncating: with 0, whether a rollback
  /// finds its window depends on where block boundaries fall (it may work
  /// for one prompt length and fail with `outside_window` for another).
  std::size_t rollback_tokens = 0;

  /// `num_layers` layers that keep and attend every token (what the
  /// constructors taking a number of layers make).
  static kv_model_layout full(std::size_t num_layers);
  /// Layer `i` is full when `(i + 1) % period == 0`, else windowed with
  /// `window` and `sink_tokens`: Gemma 3 is `interleaved(n, 6, 1024)`,
  /// gpt-oss `interleaved(n, 2, 128)`.
  static kv_model_layout interleaved(std::size_t num_layers, std::size_t period, std::size_t window,
                                     std::size_t sink_tokens = 0);
  /// Every layer windowed with `window` and `sink_tokens` (Mistral 7B's
  /// 4096-token window, or StreamingLLM's sinks beside a window).
  static kv_model_layout sliding(std::size_t num_layers, std::size_t window, std::size_t sink_tokens = 0);

  /// `layers.size()`.
  std::size_t num_layers() const noexcept { return layers.size(); }
  /// True when some layer has a window.
  bool windowed() const noexcept;
  /// Field-by-field equality.
  friend bool operator==(const kv_model_layout&, const kv_model_layout&) = default;
};

/// Prints `{window=W, sink_tokens=S}`.
std::ostream& operator<<(std::ostream& os, const kv_layer_layout& layer);
/// Prints the layers, e.g. `{layers=[{window=1024, sink_tokens=0}, ...], keys_only=0, rollback_tokens=0}`.
std::ostream& operator<<(std::ostream& os, const kv_model_layout& layout);

namespace detail {
/// Throws `std::system_error(kv_errc::invalid_config)` for a layout without
/// layers, sink tokens on a layer without a window, or a window whose
/// `window + rollback_tokens` overflows.
void validate(const kv_model_layout& layout);
}  // namespace detail

GHOSTLINK_NAMESPACE_END
