// The untyped interface of ghostlink/prefix_cache.hpp: making the index,
// and attach and insert, which reach into sequences (src/sequence/sequence.hpp).

#include <algorithm>
#include <bit>
#include <cstring>
#include <new>
#include <system_error>
#include <utility>
#include "ghostlink/detail/flavour.hpp"

#include "base/throw_errc.hpp"
#include "core/actor.hpp"
#include "ghostlink/error.hpp"
#include "io/file.hpp"
#include "prefix/index.hpp"
#include "sequence/sequence.hpp"
#include "store/entry.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

std::shared_ptr<prefix_index> make_prefix_index(const kv_model_layout& layout, const kv_cache_config& config,
                                                element_codec codec, const kv_block_pool& pool,
                                                kv_prefix_options options) {
  validate(layout);
  validate(config, codec);
  if (config.max_blocks != kv_cache_config{}.max_blocks ||
      !block_layout(config, codec, layout.keys_only).fits(*pool_access::state(pool)))
    throw_errc(kv_errc::invalid_config);
  return std::make_shared<prefix_index>(layout, config, codec, pool_access::state(pool), std::move(options.model),
                                        std::move(options.store), options.store_policy);
}

std::size_t num_layers(const prefix_index& p) noexcept { return p.num_layers(); }
const kv_model_layout& layout_of(const prefix_index& p) noexcept { return p.layout(); }
const kv_cache_config& config_of(const prefix_index& p) noexcept { return p.config(); }
kv_block_pool pool_of(const prefix_index& p) noexcept { return pool_access::handle(p.pool()); }
const std::shared_ptr<kv_block_store>& store_of(const prefix_index& p) noexcept { return p.store(); }

std::vector<kv_block_hash> block_hashes(const prefix_index& p, std::span<const token_id> tokens,
                                        std::string_view salt) {
  return p.hashes(tokens, salt);
}

std::size_t prefix_match(const prefix_index& p, std::span<const token_id> tokens, std::string_view salt) {
  const std::vector<kv_block_hash> h = p.hashes(p.within_max(tokens), salt);
  return p.match(h) * p.config().block_tokens;
}

std::shared_ptr<sequence_state> prefix_attach(prefix_index& p, asio::any_io_executor ex,
                                              std::span<const token_id> tokens, std::string_view salt) {
  const std::vector<kv_block_hash> h = p.hashes(p.within_max(tokens), salt);
  std::vector<std::vector<ref_ptr<block>>> blocks;
  const std::size_t n = p.take(h, blocks);
  return attached_sequence(p, std::move(ex), std::move(blocks), tokens, n);
}

std::shared_ptr<sequence_state> attached_sequence(const prefix_index& p, asio::any_io_executor ex,
                                                  std::vector<std::vector<ref_ptr<block>>> blocks,
                                                  std::span<const token_id> tokens, std::size_t attached) {
  // A windowed layer starts with the blocks the rule needs at `attached`
  // alone, and holds from its window's start (its high-water mark is then
  // the match's length).
  const window_rule& rule = p.rule();
  std::vector<std::size_t> kept_from;
  if (rule.windowed()) kept_from.assign(p.num_layers(), 0);
  for (std::size_t l = 0; l < p.num_layers() && rule.windowed(); ++l) {
    blocks[l].resize(attached);
    if (!rule.layer_windowed(l)) continue;
    for (std::size_t j = 0; j < attached; ++j)
      if (!rule.needs(l, j, attached)) blocks[l][j] = {};
    kept_from[l] = rule.kept_from(l, attached);
  }
  return make_attached_sequence(std::move(ex), p.config(), p.layout(), p.codec(), p.pool(), std::move(blocks),
                                tokens.first(attached * p.config().block_tokens), kept_from);
}

namespace {

/// A sequence's layers and token ids pinned as its snapshot() pins them
/// (one state of its group), with their length.
struct pinned_sequence {
  std::vector<ref_ptr<epoch>> layers;
  ref_ptr<epoch> ids;
  std::size_t size = 0;
};

pinned_sequence pin_sequence(const sequence_state& seq) {
  pinned_sequence p;
  const ref_ptr<group_epoch> state = seq.group->pin_group();
  p.layers.assign(state->layers.begin(), state->layers.end() - 1);
  p.ids = state->layers.back();
  p.size = p.ids->size;
  return p;
}

/// Hands the store the entries `insert()` just added (indices `added` of
/// `blocks`, of `chain[first..]`; `tokens` those of `chain` from block 0),
/// each holding its blocks until written. The caller still pins
/// them, so they are in use: the references taken here are not an idle
/// block's (which only an attach may hand out). Memory refused loses the
/// write-through of the rest, which a flush then hands.
void write_through(prefix_index& p, std::span<const kv_block_hash> chain, std::span<const token_id> tokens,
                   std::size_t first, std::span<const std::vector<const block*>> blocks,
                   std::span<const std::size_t> added) noexcept {
  const std::span<const kv_block_hash> hashes = chain.subspan(first);
  std::size_t handed = 0;
  try {
    for (const std::size_t i : added) {
      std::vector<ref_ptr<block>> held;
      held.reserve(blocks[i].size());
      for (const block* b : blocks[i]) held.push_back(ref_ptr<block>::share(const_cast<block*>(b)));
      p.store()->put(
          std::make_shared<held_entry>(p.geometry(), hashes[i], std::move(held), p.receipt(chain, tokens, first + i)));
      ++handed;
    }
  } catch (const std::bad_alloc&) {
    std::vector<kv_block_hash> rest;
    try {
      for (const std::size_t i : added.subspan(handed)) rest.push_back(hashes[i]);
    } catch (const std::bad_alloc&) {
    }
    p.mark_unstored(rest);
  }
  p.count_store_puts(handed);
}

}  // namespace

std::vector<const block*> entry_blocks(const prefix_index& p, std::span<const layer_blocks> layers, std::size_t b) {
  std::vector<const block*> out;
  out.reserve(layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const block* blk = layers[l].whole_block(b);
    if (!blk && !p.rule().layer_windowed(l)) return {};  // a full layer's block is never missing
    out.push_back(blk);
  }
  return out;
}

std::size_t insert_blocks(prefix_index& p, std::span<const kv_block_hash> chain, std::span<const token_id> tokens,
                          std::size_t first, std::span<const std::vector<const block*>> blocks,
                          const retention_rule& retention) {
  // An entry holding nothing at the end would match nothing (nor lead to
  // anything that does): the windows dropped it.
  while (!blocks.empty() && std::ranges::all_of(blocks.back(), [](const block* b) { return b == nullptr; }))
    blocks = blocks.first(blocks.size() - 1);
  if (blocks.empty()) return 0;
  if (!p.store() || p.store_policy() != kv_store_policy::write_through)
    return p.insert(chain, tokens, first, blocks, &retention);
  std::vector<std::size_t> added;
  added.reserve(blocks.size());
  const auto handoff = p.handing();  // from marking the entries in the store until they are put
  const std::size_t n = p.insert(chain, tokens, first, blocks, &retention, &added, true);
  write_through(p, chain, tokens, first, blocks, added);
  return n;
}

std::size_t prefix_insert(prefix_index& p, const sequence_state* seq, const std::span<const token_id>* tokens,
                          std::string_view salt, const kv_retention* retention) {
  check_insertable(p, seq);
  const kv_cache_config& c = seq->config;
  const retention_rule rule = retention ? retention_rule(*retention, c.block_tokens) : retention_rule();

  const pinned_sequence pinned = pin_sequence(*seq);  // held until the entries hold the blocks
  const std::size_t bt = c.block_tokens;
  std::size_t full = pinned.size;
  std::vector<token_id> stored;
  const layer_blocks ids = pinned.ids->blocks();
  if (tokens) {
    full = std::min(full, tokens->size());
  } else {
    stored.reserve(full);
    for (std::size_t i = 0; i < full; ++i) {
      const token_id id = ids.stored_id(i);
      if (id == no_token_id) break;
      stored.push_back(id);
    }
    full = stored.size();
  }
  // Whole blocks that every full layer holds as blocks of its own data; a
  // windowed layer's where it still holds them.
  std::vector<layer_blocks> layers;
  layers.reserve(pinned.layers.size());
  for (const ref_ptr<epoch>& e : pinned.layers) layers.push_back(e->blocks());
  std::vector<std::vector<const block*>> blocks;
  blocks.reserve(full / bt);
  for (std::size_t b = 0; b < full / bt; ++b) {
    std::vector<const block*> per_layer = entry_blocks(p, layers, b);
    if (per_layer.empty()) break;
    blocks.push_back(std::move(per_layer));
  }
  const std::span<const token_id> used =
      tokens ? tokens->first(blocks.size() * bt) : std::span<const token_id>(stored).first(blocks.size() * bt);
  const std::vector<kv_block_hash> h = p.hashes(used, salt);
  return insert_blocks(p, h, used, 0, blocks, rule);
}

void check_insertable(const prefix_index& p, const sequence_state* seq) {
  if (!seq) throw_errc(kv_errc::invalid_config);
  if (seq->model_layers() != p.num_layers()) throw_errc(kv_errc::layer_mismatch);
  const kv_cache_config& c = seq->config;
  // Another layout keeps other blocks (and hashes them apart); its
  // rollback_tokens changes nothing stored.
  if (&seq->group->pool() != p.pool().get() || c.num_heads != p.config().num_heads ||
      c.head_dim != p.config().head_dim || c.block_tokens != p.config().block_tokens ||
      c.key_scale != p.config().key_scale || c.value_scale != p.config().value_scale ||
      seq->layout.layers != p.layout().layers || seq->layout.keys_only != p.layout().keys_only)
    throw_errc(kv_errc::invalid_config);
}

void prefix_clear(prefix_index& p) noexcept { p.clear(); }

void start_flush(const std::shared_ptr<prefix_index>& p, io_op* op) {
  unstarted_op started(op);
  const error_code ec = p->flush() ? error_code() : error_code(kv_errc::capacity_exhausted);
  io_op* taken = started.take();
  // Completed (posted, never run here) once the store has settled the puts.
  auto done = [taken, ec]() noexcept {
    try {
      taken->complete(ec, queueing::post);
    } catch (...) {  // memory refused for the queueing: the handler is lost, its work released
    }
  };
  if (!p->store()) {
    done();
    return;
  }
  try {
    p->store()->when_flushed(done);
  } catch (...) {
    taken->discard();
    throw;
  }
}
kv_prefix_stats prefix_stats(const prefix_index& p) noexcept { return p.stats(); }
void prefix_set_event_handler(prefix_index& p, kv_prefix_event_handler handler) {
  p.set_event_handler(std::move(handler));
}
kv_prefix_dump prefix_dump(const prefix_index& p) { return p.dump(); }

}  // namespace detail
GHOSTLINK_NAMESPACE_END
