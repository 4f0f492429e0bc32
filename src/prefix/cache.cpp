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

std::shared_ptr<prefix_index> make_prefix_index(std::size_t num_layers, const kv_cache_config& config,
                                                element_codec codec, const kv_block_pool& pool,
                                                kv_prefix_options options) {
  validate(config, codec);
  if (num_layers == 0 || config.max_blocks != kv_cache_config{}.max_blocks ||
      !block_layout(config, codec).fits(*pool_access::state(pool)))  // keys only: not reused yet
    throw_errc(kv_errc::invalid_config);
  return std::make_shared<prefix_index>(num_layers, config, codec, pool_access::state(pool), std::move(options.model),
                                        std::move(options.store), options.store_policy);
}

std::size_t num_layers(const prefix_index& p) noexcept { return p.num_layers(); }
const kv_cache_config& config_of(const prefix_index& p) noexcept { return p.config(); }
kv_block_pool pool_of(const prefix_index& p) noexcept { return pool_access::handle(p.pool()); }

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
  return make_attached_sequence(std::move(ex), p.config(), kv_model_layout::full(p.num_layers()), p.codec(), p.pool(),
                                std::move(blocks), tokens.first(attached * p.config().block_tokens));
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
/// `hashes`), each holding its blocks until written. The caller still pins
/// them, so they are in use: the references taken here are not an idle
/// block's (which only an attach may hand out). Memory refused loses the
/// write-through of the rest, which a flush then hands.
void write_through(prefix_index& p, std::span<const kv_block_hash> hashes,
                   std::span<const std::vector<const block*>> blocks, std::span<const std::size_t> added) noexcept {
  std::size_t handed = 0;
  try {
    for (const std::size_t i : added) {
      std::vector<ref_ptr<block>> held;
      held.reserve(blocks[i].size());
      for (const block* b : blocks[i]) held.push_back(ref_ptr<block>::share(const_cast<block*>(b)));
      p.store()->put(std::make_shared<held_entry>(p.geometry(), hashes[i], std::move(held)));
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

token_id stored_id(const epoch& ids, std::size_t i) {
  if (i >= ids.stored) return no_token_id;
  float bits = 0;
  std::memcpy(&bits, ids.layout->keys(ids.block_of(i), i % ids.layout->block_tokens), sizeof bits);
  return std::bit_cast<token_id>(bits);
}

}  // namespace

std::size_t prefix_insert(prefix_index& p, const sequence_state* seq, const std::span<const token_id>* tokens,
                          std::string_view salt) {
  if (!seq) throw_errc(kv_errc::invalid_config);
  // Not reused yet: never half a layer's blocks, nor keys without values.
  if (seq->layout.windowed() || seq->layout.keys_only) throw_errc(kv_errc::invalid_config);
  if (seq->model_layers() != p.num_layers()) throw_errc(kv_errc::layer_mismatch);
  const kv_cache_config& c = seq->config;
  if (&seq->group->pool() != p.pool().get() || c.num_heads != p.config().num_heads ||
      c.head_dim != p.config().head_dim || c.block_tokens != p.config().block_tokens)
    throw_errc(kv_errc::invalid_config);

  const pinned_sequence pinned = pin_sequence(*seq);  // held until the entries hold the blocks
  const std::size_t bt = c.block_tokens;
  std::size_t full = pinned.size;
  std::vector<token_id> stored;
  if (tokens) {
    full = std::min(full, tokens->size());
  } else {
    stored.reserve(full);
    for (std::size_t i = 0; i < full; ++i) {
      const token_id id = stored_id(*pinned.ids, i);
      if (id == no_token_id) break;
      stored.push_back(id);
    }
    full = stored.size();
  }
  // Whole blocks that every layer holds as blocks of its own data.
  std::vector<std::vector<const block*>> blocks;
  blocks.reserve(full / bt);
  for (std::size_t b = 0; b < full / bt; ++b) {
    std::vector<const block*> per_layer;
    per_layer.reserve(p.num_layers());
    for (const ref_ptr<epoch>& e : pinned.layers) {
      if (e->stored < (b + 1) * bt) break;
      const block& blk = *e->table->block_at(b);
      if (!blk.counted()) break;  // the zero block
      per_layer.push_back(&blk);
    }
    if (per_layer.size() != p.num_layers()) break;
    blocks.push_back(std::move(per_layer));
  }
  const std::span<const token_id> used =
      tokens ? tokens->first(blocks.size() * bt) : std::span<const token_id>(stored).first(blocks.size() * bt);
  const std::vector<kv_block_hash> h = p.hashes(used, salt);
  if (!p.store() || p.store_policy() != kv_store_policy::write_through) return p.insert(h, blocks);
  std::vector<std::size_t> added;
  added.reserve(h.size());
  const auto handoff = p.handing();  // from marking the entries in the store until they are put
  const std::size_t n = p.insert(h, blocks, &added, true);
  write_through(p, h, blocks, added);
  return n;
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

}  // namespace detail
GHOSTLINK_NAMESPACE_END
