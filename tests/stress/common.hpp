#pragma once
// The stress test's shared pieces: the run's options and verdict, a seeded
// generator, the token encoding every float is checked against, and the
// model each writer keeps of its cache (a history of states, published
// lock-free for the readers) with the registry that maps epochs to content.

#include <ghostlink/kv_cache.hpp>

#include "common/reference.hpp"
#include "common/str.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace stress {

using namespace ghostlink;

using ghostlink::test::str;

struct options {
  double seconds = 5;
  std::uint64_t seed = 0;
  std::size_t writers = 4;    // layer-cache lineages, each also writing its region of the shared arena
  std::size_t readers = 2;    // std::threads
  std::size_t sequences = 2;  // sequence lineages
  std::size_t threads = 2;    // asio::thread_pool threads
};

/// The run's verdict: the first few failures, and the flag that stops
/// every writer and reader once one is found.
struct verdict {
  std::uint64_t seed = 0;
  std::atomic<bool> stop{false};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::condition_variable changed;
  std::size_t count = 0;
  std::string first;

  void fail(const std::string& what) {
    {
      std::lock_guard lock(mutex);
      if (++count <= 5) first += "  " + what + '\n';
      failed.store(true);
      stop.store(true);
    }
    changed.notify_all();
  }
};

inline verdict g_verdict;
inline void fail(const std::string& what) { g_verdict.fail(what); }
inline bool stopping() { return g_verdict.stop.load(std::memory_order_relaxed); }

/// Figures printed at the end (relaxed counters).
struct figures {
  std::atomic<std::uint64_t> requests{0}, writes{0}, batches{0}, initializes{0}, truncates{0}, forks{0}, rejected{0},
      arena_requests{0}, arena_rotations{0}, appends{0}, chunk_appends{0}, steps{0}, steps_abandoned{0},
      steps_two_threads{0}, append_capacity_failures{0}, seq_truncates{0}, seq_forks{0}, conflicts{0},
      conflicts_rejected{0}, generations{0}, epochs{0}, layer_snapshots{0}, arena_snapshots{0}, seq_snapshots{0},
      hot_pins{0}, writer_checks{0}, retained_checks{0}, async_reads{0}, tokens_checked{0}, delayed{0},
      prefix_inserts{0}, prefix_added{0}, prefix_attaches{0}, prefix_attached_tokens{0}, prefix_adopted{0},
      prefix_clears{0}, prefix_tracks{0}, windowed_sequences{0}, window_truncates_refused{0}, dropped_reads{0};
};
inline figures g_figures;
inline void bump(std::atomic<std::uint64_t>& c, std::uint64_t n = 1) { c.fetch_add(n, std::memory_order_relaxed); }

/// splitmix64: small, seedable, good enough to pick operations.
class rng {
 public:
  explicit rng(std::uint64_t seed) : s_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  std::size_t below(std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(next() % n); }
  std::size_t between(std::size_t lo, std::size_t hi) { return lo + below(hi - lo + 1); }
  bool percent(std::size_t p) { return below(100) < p; }

 private:
  std::uint64_t s_;
};

// ---- Tokens -----------------------------------------------------------------
//
// A tag names the request that wrote a token: (generation << 32) | version,
// the generation being a cache's (or an arena region's) unique id and the
// version the request's number in it; tag 0 is a token of zeros. Every float
// of a token is an integer below 2^24 (exact in a float): lane 0 the low 24
// bits of the generation, lane 1 the version, lane 2 the index, lane 3 the
// layer and the generation's high bits, the rest derived from all of them,
// so a torn, misplaced or stale float cannot pass.

constexpr std::uint32_t max_field = (1u << 24) - 1;

inline std::uint64_t make_tag(std::uint64_t gen, std::uint64_t version) { return gen << 32 | version; }

inline std::string tag_name(std::uint64_t tag) {
  if (tag == 0) return "zeros";
  return str("g", tag >> 32, "v", tag & 0xffffffffu);
}

inline float lane_value(std::uint64_t tag, std::size_t index, std::size_t layer, std::size_t lane) {
  std::uint64_t z = tag * 0x9e3779b97f4a7c15ULL ^ (index << 20 | layer << 12 | lane);
  z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ULL;
  return static_cast<float>((z ^ (z >> 29)) & max_field);
}

/// The token `tag` writes at `index` of layer `layer` (width >= 4).
inline void encode(std::uint64_t tag, std::size_t index, std::size_t layer, std::span<float> keys,
                   std::span<float> values) {
  keys[0] = static_cast<float>(tag >> 32 & max_field);
  keys[1] = static_cast<float>(tag & 0xffffffffu);
  keys[2] = static_cast<float>(index & max_field);
  keys[3] = static_cast<float>(layer | (tag >> 56) << 4);
  for (std::size_t lane = 4; lane < keys.size(); ++lane) keys[lane] = lane_value(tag, index, layer, lane);
  for (std::size_t lane = 0; lane < values.size(); ++lane) values[lane] = lane_value(tag, index, layer, 64 + lane);
}

/// The tag of a token read at `index` of layer `layer`, or "" in `error`
/// replaced by what is wrong with it (torn, misplaced, garbage).
inline std::uint64_t decode(std::span<const float> keys, std::span<const float> values, std::size_t index,
                            std::size_t layer, std::string& error) {
  const bool zeros = std::all_of(keys.begin(), keys.end(), [](float f) { return f == 0.0f; }) &&
                     std::all_of(values.begin(), values.end(), [](float f) { return f == 0.0f; });
  if (zeros) return 0;
  const auto field = [](float f) {
    return f >= 0.0f && f <= static_cast<float>(max_field) && f == static_cast<float>(static_cast<std::uint32_t>(f));
  };
  if (!field(keys[0]) || !field(keys[1]) || !field(keys[3])) {
    error = str("token ", index, " (layer ", layer, ") is garbage: key lanes 0,1,3 = ", keys[0], ",", keys[1], ",",
                keys[3]);
    return 0;
  }
  const std::uint64_t gen = static_cast<std::uint64_t>(keys[0]) | (static_cast<std::uint64_t>(keys[3]) >> 4) << 24;
  const std::uint64_t tag = make_tag(gen, static_cast<std::uint64_t>(keys[1]));
  std::array<float, 64> kb{}, vb{};  // no allocation per token: readers decode millions
  if (keys.size() > kb.size() || values.size() != keys.size()) {
    error = str("token ", index, ": width ", keys.size(), "/", values.size(), " (the test handles up to 64)");
    return 0;
  }
  const auto k = std::span(kb).first(keys.size()), v = std::span(vb).first(values.size());
  encode(tag, index, layer, k, v);
  for (std::size_t lane = 0; lane < keys.size(); ++lane)
    if (keys[lane] != k[lane] || values[lane] != v[lane]) {
      error = str("token ", index, " (layer ", layer, ") is torn or misplaced: lanes 0,1 name ", tag_name(tag),
                  " but lane ", lane, " holds key ", keys[lane], " value ", values[lane], ", that write stored key ",
                  k[lane], " value ", v[lane]);
      return 0;
    }
  return tag;
}

/// One token's keys and values, encoded; `entry()` points into it, so it
/// must stay where it is until its request completes.
struct token_buffer {
  std::vector<float> keys, values;
  token_buffer(std::size_t width, std::uint64_t tag, std::size_t index, std::size_t layer)
      : keys(width), values(width) {
    encode(tag, index, layer, keys, values);
  }
};

// ---- The model --------------------------------------------------------------

/// The tag a reader records for a position a windowed layer no longer
/// holds: it matches any tag (no generation reaches 2^32 - 1).
constexpr std::uint64_t unheld = ~std::uint64_t{0};

/// Whether `seen` (with unheld positions) shows `want`: of one size, and
/// equal wherever it holds a token.
inline bool shows(std::span<const std::uint64_t> seen, std::span<const std::uint64_t> want) {
  return std::equal(seen.begin(), seen.end(), want.begin(), want.end(),
                    [](std::uint64_t a, std::uint64_t b) { return a == unheld || a == b; });
}

/// What a cache holds after some prefix of its requests: per token, the tag
/// of the request that wrote it last (0 for zeros). `tags.size()` is the size.
using state = ghostlink::test::reference_cache<std::uint64_t>;

inline std::uint64_t content_hash(std::span<const std::uint64_t> tags) {
  std::uint64_t h = 0xcbf29ce484222325ULL ^ tags.size();
  for (std::uint64_t t : tags) h = (h ^ t) * 0x100000001b3ULL, h ^= h >> 29;
  return h;
}

enum class outcome : std::uint8_t { pending, ok, failed };

/// The states of one cache (or arena region) in request order: state 0 is
/// where it started, state p what it holds after request p. Its one writer
/// publishes state p (release) before it starts request p, and records
/// `completed` (the highest p whose handler has run) after. States never
/// change once published, so readers use them without a lock. A state whose
/// request may fail is published `pending`; if it fails, the writer marks it
/// `failed` and publishes the state before it again.
class history {
 public:
  history(std::size_t capacity, state initial)
      : states_(std::make_unique<state[]>(capacity)),
        outcomes_(std::make_unique<std::atomic<outcome>[]>(capacity)),
        capacity_(capacity) {
    states_[0] = std::move(initial);
    outcomes_[0].store(outcome::ok, std::memory_order_relaxed);
    count_.store(1, std::memory_order_release);
  }

  std::size_t capacity() const { return capacity_; }
  /// Writer only: room for `n` more states.
  bool has_room(std::size_t n) const { return count_.load(std::memory_order_relaxed) + n <= capacity_; }
  /// Writer only: the latest state.
  const state& last() const { return states_[count_.load(std::memory_order_relaxed) - 1]; }

  std::size_t publish(state s, outcome o = outcome::ok) {
    const std::size_t p = count_.load(std::memory_order_relaxed);
    states_[p] = std::move(s);
    outcomes_[p].store(o, std::memory_order_relaxed);
    count_.store(p + 1, std::memory_order_release);
    return p;
  }
  void resolve(std::size_t p, outcome o) { outcomes_[p].store(o, std::memory_order_release); }
  outcome outcome_of(std::size_t p) const { return outcomes_[p].load(std::memory_order_acquire); }

  std::size_t count() const { return count_.load(std::memory_order_acquire); }
  const state& at(std::size_t p) const { return states_[p]; }

  void complete(std::size_t p) {
    std::size_t seen = completed_.load(std::memory_order_relaxed);
    while (seen < p && !completed_.compare_exchange_weak(seen, p, std::memory_order_release)) {
    }
  }
  std::size_t completed() const { return completed_.load(std::memory_order_acquire); }

 private:
  std::unique_ptr<state[]> states_;
  std::unique_ptr<std::atomic<outcome>[]> outcomes_;
  const std::size_t capacity_;
  std::atomic<std::size_t> count_{0};
  std::atomic<std::size_t> completed_{0};
};

/// First difference between what a snapshot showed and a state, for messages.
inline std::string describe_diff(std::span<const std::uint64_t> seen, const state& s) {
  if (seen.size() != s.tags.size()) return str("size ", seen.size(), " vs ", s.tags.size());
  for (std::size_t i = 0; i < seen.size(); ++i)
    if (seen[i] != unheld && seen[i] != s.tags[i])
      return str("token ", i, " shows ", tag_name(seen[i]), ", state has ", tag_name(s.tags[i]));
  return "equal";
}

/// The states in [lo, hi] that `seen` shows (lo: completed before the
/// snapshot was pinned; hi: published after). "" or why none does.
inline std::string match(const history& h, std::size_t lo, std::size_t hi, std::span<const std::uint64_t> seen,
                         std::vector<std::size_t>& found) {
  found.clear();
  for (std::size_t p = lo; p <= hi; ++p)
    if (shows(seen, h.at(p).tags)) found.push_back(p);
  if (!found.empty()) return {};
  std::string why =
      str("shows ", seen.size(), " tokens, equal to no state in [", lo, ", ", hi, "] (", lo,
          " = last completed request when pinned): against state ", lo, ": ", describe_diff(seen, h.at(lo)));
  if (hi != lo) why += str("; against state ", hi, ": ", describe_diff(seen, h.at(hi)));
  return why;
}

/// Epoch number -> content (and the states it matched) for one cache: one
/// epoch must always show one content, and later epochs later states.
class epoch_registry {
 public:
  /// "" or what is inconsistent. `pmin`/`pmax`: the states it matched.
  std::string record(std::uint64_t epoch, std::uint64_t hash, std::size_t pmin, std::size_t pmax) {
    std::lock_guard lock(mutex_);
    auto [it, fresh] = map_.try_emplace(epoch, entry{hash, pmin, pmax});
    if (fresh) bump(g_figures.epochs);
    entry& e = it->second;
    if (e.hash != hash) return str("epoch ", epoch, " showed two different contents");
    // An epoch stands for a run of states (requests that change nothing
    // publish no epoch): keep every state it matched.
    e.pmin = std::min(e.pmin, pmin);
    e.pmax = std::max(e.pmax, pmax);
    if (it != map_.begin() && std::prev(it)->second.pmin > e.pmax)
      return str("epoch ", std::prev(it)->first, " is state >= ", std::prev(it)->second.pmin, " but later epoch ",
                 epoch, " is state <= ", e.pmax, ": epochs out of request order");
    if (std::next(it) != map_.end() && std::next(it)->second.pmax < e.pmin)
      return str("epoch ", epoch, " is state >= ", e.pmin, " but later epoch ", std::next(it)->first,
                 " is state <= ", std::next(it)->second.pmax, ": epochs out of request order");
    return {};
  }

 private:
  struct entry {
    std::uint64_t hash;
    std::size_t pmin, pmax;
  };
  std::mutex mutex_;
  std::map<std::uint64_t, entry> map_;
};

/// Unique generation ids (never 0, below 2^32).
inline std::uint64_t new_generation() {
  static std::atomic<std::uint64_t> next{1};
  bump(g_figures.generations);
  return next.fetch_add(1, std::memory_order_relaxed);
}

/// The positions a layer's snapshot holds: its sinks and `[kept_from(),
/// size())`, every position but those a window dropped (all of them for a
/// full layer, whose kept_from() is 0).
template <class Snapshot>
std::array<std::pair<std::size_t, std::size_t>, 2> held_ranges(const Snapshot& snap) {
  const std::size_t n = snap.size(), kept = std::min(snap.kept_from(), n);
  return {{{0, std::min(snap.sink_tokens(), kept)}, {kept, n}}};
}

/// Decodes the held tokens of layer `layer` (held_ranges) through
/// for_each_block into `tags`, the others `unheld`; "" or the first bad
/// token.
template <class Snapshot>
std::string decode_all(const Snapshot& snap, std::size_t layer, std::vector<std::uint64_t>& tags) {
  tags.assign(snap.size(), unheld);
  std::string error;
  const std::size_t w = snap.token_width();
  for (const auto& [b, e] : held_ranges(snap)) {
    if (b == e) continue;
    const ghostlink::error_code ec =
        snap.for_each_block(b, e, [&](std::size_t first, std::size_t count, auto keys, auto values) {
          for (std::size_t t = 0; t < count && error.empty(); ++t)
            tags[first + t] = decode(keys.subspan(t * w, w), values.subspan(t * w, w), first + t, layer, error);
        });
    if (ec) return str("for_each_block(", b, ", ", e, ") failed: ", ec.message());
    bump(g_figures.tokens_checked, e - b);
  }
  return error;
}

/// Copying reads of a random held range and a random held token, and reads
/// past the end, against `tags` (what for_each_block showed); a windowed
/// layer's reads of a dropped position fail with outside_window, writing
/// nothing. "" or what differed.
template <class Snapshot>
std::string spot_reads(const Snapshot& snap, std::size_t layer, std::span<const std::uint64_t> tags, rng& r) {
  const std::size_t n = snap.size(), w = snap.token_width();
  if (tags.size() != n) return str("size changed from ", tags.size(), " to ", n);
  std::string error;
  const auto held = held_ranges(snap);
  const auto [hb, he] = held[held[0].first == held[0].second || (held[1].first != held[1].second && r.percent(70))];
  if (hb < he) {
    const std::size_t b = r.between(hb, he - 1), e = r.between(b + 1, he);
    kv_range range;
    if (ghostlink::error_code ec = snap.read_range(b, e, range))
      return str("read_range(", b, ", ", e, "): ", ec.message());
    for (std::size_t i = b; i < e && error.empty(); ++i) {
      const auto k = std::span<const float>(range.keys).subspan((i - b) * w, w);
      const auto v = std::span<const float>(range.values).subspan((i - b) * w, w);
      const std::uint64_t t = decode(k, v, i, layer, error);
      if (error.empty() && t != tags[i])
        error = str("read_range token ", i, ": ", tag_name(t), ", for_each_block showed ", tag_name(tags[i]));
    }
    const std::size_t i = r.between(hb, he - 1);
    kv_entry entry;
    if (ghostlink::error_code ec = snap.read_kv(i, entry)) return str("read_kv(", i, "): ", ec.message());
    const std::uint64_t t = decode(entry.keys, entry.values, i, layer, error);
    if (error.empty() && t != tags[i])
      error = str("read_kv token ", i, ": ", tag_name(t), ", for_each_block showed ", tag_name(tags[i]));
  }
  if (const std::size_t gap_end = held[1].first, gap = held[0].second; gap < gap_end) {
    // A dropped position, alone and inside a range reaching the end: the
    // spans untouched, the kv_entry and kv_range left empty.
    const std::size_t i = r.between(gap, gap_end - 1);
    std::vector<float> keys(w, -1.0f), values(w, -2.0f);
    kv_entry entry{{1.0f}, {2.0f}};
    kv_range range{.begin = 7, .end = 8, .keys = {3.0f}, .values = {4.0f}};
    if (snap.read_kv(i, keys, values) != kv_errc::outside_window ||
        std::any_of(keys.begin(), keys.end(), [](float f) { return f != -1.0f; }) ||
        std::any_of(values.begin(), values.end(), [](float f) { return f != -2.0f; }))
      error += str(" read_kv(", i, ") of a dropped position did not fail with outside_window, writing nothing");
    if (snap.read_kv(i, entry) != kv_errc::outside_window || !entry.keys.empty() || !entry.values.empty())
      error += str(" read_kv(", i, ", kv_entry) of a dropped position did not fail, leaving it empty");
    if (snap.read_range(i, n, range) != kv_errc::outside_window || range.begin != i || range.end != n ||
        !range.keys.empty() || !range.values.empty())
      error += str(" read_range(", i, ", ", n, ") over a dropped position did not fail, leaving it empty");
    bump(g_figures.dropped_reads);
  }
  kv_entry past;
  if (snap.read_kv(n, past) != kv_errc::index_out_of_range) error += str(" read_kv(size ", n, ") did not fail");
  kv_range over;
  if (snap.read_range(0, n + 1, over) != kv_errc::range_out_of_bounds) error += " read_range past the end did not fail";
  return error;
}

}  // namespace stress
