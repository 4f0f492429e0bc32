// track(): a sequence's full blocks cached at the drain that fills them,
// before its windowed layers drop any (ghostlink/prefix_cache.hpp).
//
// A sequence_tracker is the fill_observer of one sequence's actor. Its
// state is touched only inside that actor's drains (one at a time), so it
// needs no lock: `hashes_` holds the hashes of blocks [0, done_), computed
// from the token ids the sequence stores; each drain that stores tokens
// hashes the blocks it filled and inserts them, and a truncate forgets the
// blocks it cut. It holds the index weakly: the cache's last handle going
// ends the tracking.
//
// A block goes into the index before the drain publishes it: its tokens
// are all stored, and nothing writes them in place again. The drain's
// publish raises the block's readable() over them before any later request
// of the sequence is applied (one operation at a time), and from then on
// a rewrite after a truncate finds the cache's hold among its references
// (working_state::rewritable_in_place) and copies. An attach on another
// thread meanwhile reads what the drain stored before the insert's lock.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>
#include "ghostlink/detail/flavour.hpp"

#include "base/throw_errc.hpp"
#include "core/actor.hpp"
#include "core/working_state.hpp"
#include "prefix/index.hpp"
#include "sequence/sequence.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

class sequence_tracker final : public fill_observer {
 public:
  sequence_tracker(std::weak_ptr<prefix_index> index, std::string salt, retention_rule retention,
                   std::size_t block_tokens)
      : index_(std::move(index)), salt_(std::move(salt)), retention_(std::move(retention)), bt_(block_tokens) {}

  void filled(const actor& group, std::size_t size) noexcept override {
    const std::size_t full = size / bt_;
    if (done_ >= full) return;
    const std::shared_ptr<prefix_index> p = index_.lock();
    if (!p) return;
    const std::size_t first = done_;
    try {
      const std::size_t n = p->num_layers();
      layers_.clear();
      for (std::size_t l = 0; l < n; ++l) layers_.push_back(group.working(l).blocks());
      const layer_blocks ids = group.working(n).blocks();
      std::vector<std::vector<const block*>> blocks;
      blocks.reserve(full - first);
      for (std::size_t b = first; b < full; ++b) {
        tokens_.resize((b + 1) * bt_);
        const std::span<token_id> block_ids = std::span(tokens_).subspan(b * bt_);
        for (std::size_t i = 0; i < bt_; ++i) block_ids[i] = ids.stored_id(b * bt_ + i);
        // A token stored without its id, or a full layer's zero block: no
        // entry for it, nor for what follows, until a truncate cuts it.
        if (std::ranges::find(block_ids, no_token_id) != block_ids.end()) break;
        std::vector<const block*> per_layer = entry_blocks(*p, layers_, b);
        if (per_layer.empty()) break;
        hashes_.push_back(
            prefix_index::next_hash(hashes_.empty() ? p->root(salt_) : hashes_.back(), block_ids, scratch_));
        blocks.push_back(std::move(per_layer));
      }
      tokens_.resize(hashes_.size() * bt_);
      if (blocks.empty()) {
        cut(first);
        return;
      }
      insert_blocks(*p, hashes_, tokens_, first, blocks, retention_);
      done_ = first + blocks.size();
    } catch (const std::bad_alloc&) {
      // Not cached: the next drain that fills a block tries from here again.
      cut(first);
    }
  }

  void truncated(std::size_t size) noexcept override {
    done_ = std::min(done_, size / bt_);
    cut(done_);
  }

 private:
  const std::weak_ptr<prefix_index> index_;
  const std::string salt_;
  const retention_rule retention_;  // by the blocks' positions in the sequence
  const std::size_t bt_;
  /// Keeps blocks [0, n) (none grows: no allocation).
  void cut(std::size_t n) noexcept {
    hashes_.resize(std::min(hashes_.size(), n));
    tokens_.resize(std::min(tokens_.size(), n * bt_));
  }

  std::vector<kv_block_hash> hashes_;  // blocks [0, done_)
  std::vector<token_id> tokens_;       // their ids, block_tokens a block
  std::size_t done_ = 0;
  // Scratch of filled(), kept so that a decode step's drain allocates none
  // of them again.
  std::vector<layer_blocks> layers_;
  std::vector<std::uint8_t> scratch_;
};

}  // namespace

void prefix_track(const std::shared_ptr<prefix_index>& p, const sequence_state* seq, std::string_view salt,
                  const kv_retention* retention) {
  check_insertable(*p, seq);
  const std::size_t bt = p->config().block_tokens;
  retention_rule rule = retention ? retention_rule(*retention, bt) : retention_rule();
  seq->group->observe(std::make_shared<sequence_tracker>(p, std::string(salt), std::move(rule), bt));
}

void prefix_untrack(const sequence_state* seq) noexcept {
  if (seq) seq->group->observe(nullptr);
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
