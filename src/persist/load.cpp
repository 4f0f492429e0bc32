// Loading a saved sequence (start_load) and reading one layer of it
// (start_read_layer).
//
// Threads: the file is read and checked on the I/O executor. A load reads
// each layer's full blocks straight into new pool blocks (the file holds
// the stored elements block after block) and makes the sequence on them as
// an attach does; the tokens of a last partial block are then appended
// through the new sequence's actors (on their strands, as any append), and
// that append's completion posts the end back to the I/O executor, so no
// thread ever waits for an actor. While the append is in flight the job
// holds work on the I/O executor; the load_append_op holds the job.

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/detail/sequence_interface.hpp"
#include "ghostlink/error.hpp"
#include "io/file.hpp"
#include "memory/block.hpp"
#include "persist/format.hpp"
#include "sequence/sequence.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {
namespace {

/// `file_corrupt` unless bytes [from, to) of `file` are zero, as padding is.
error_code check_padding(const file_descriptor& file, std::uint64_t from, std::uint64_t to) {
  std::array<std::byte, layer_alignment> bytes{};
  while (from < to) {
    const std::span<std::byte> part = std::span(bytes).first(std::min<std::uint64_t>(bytes.size(), to - from));
    if (error_code ec = read_at(file, from, part)) return ec;
    if (std::ranges::any_of(part, [](std::byte b) { return b != std::byte{0}; })) return kv_errc::file_corrupt;
    from += part.size();
  }
  return {};
}

/// The padding after layer `layer`'s payload, up to the next layer's.
error_code check_layer_padding(const file_descriptor& file, const file_header& header, std::size_t layer) {
  if (layer + 1 >= header.num_layers) return {};  // the file ends right after the last layer
  const std::uint64_t end = header.layout.layer_offset(layer) + header.layout.layer_bytes(layer);
  return check_padding(file, end, header.layout.layer_offset(layer + 1));
}

/// Reads and checks everything in the file up to the layers' payload: the
/// header (against `expected`, and its token count against the config's
/// limit before anything of that size is read), the layer table, the
/// padding between them, and the token ids if `ids` is not null.
error_code open_checked(const std::filesystem::path& path, const file_expectation& expected, file_descriptor& file,
                        file_header& header, std::vector<layer_record>& table, std::vector<token_id>* ids) {
  std::uint64_t file_bytes = 0;
  if (error_code ec = open_for_reading(path, file, file_bytes)) return ec;
  std::vector<std::byte> bytes(std::min<std::uint64_t>(file_bytes, fixed_header_bytes));
  std::size_t header_bytes = 0;
  if (error_code ec = read_at(file, 0, bytes)) return ec;
  if (error_code ec = header_length(bytes, file_bytes, header_bytes)) return ec;
  bytes.resize(header_bytes);
  if (error_code ec = read_at(file, 0, bytes)) return ec;
  if (error_code ec = decode_header(bytes, file_bytes, header)) return ec;
  const file_layout& layout = header.layout;
  if (header.version >= 2) {  // the layout section, which lays out the layers
    bytes.resize(layout_section_bytes(header));
    if (error_code ec = read_at(file, layout.layout_offset, bytes)) return ec;
    if (error_code ec = decode_layout(header, bytes, file_bytes)) return ec;
  }
  if (error_code ec = check_expected(header, expected)) return ec;
  if (header.tokens > expected.config.max_tokens_per_seq) return kv_errc::index_out_of_range;
  if (ids) {
    bytes.resize(token_section_bytes(header));
    if (error_code ec = read_at(file, layout.tokens_offset, bytes)) return ec;
    if (error_code ec = decode_tokens(header, bytes, *ids)) return ec;
  }
  bytes.resize(table_bytes(header));
  if (error_code ec = read_at(file, layout.table_offset, bytes)) return ec;
  if (error_code ec = decode_table(header, bytes, table)) return ec;
  if (error_code ec = check_padding(file, layout.header_bytes, layout.tokens_offset)) return ec;
  const std::uint64_t tokens_end = layout.tokens_offset + token_section_bytes(header);
  if (header.version >= 2) {
    if (error_code ec = check_padding(file, tokens_end, layout.layout_offset)) return ec;
    if (error_code ec = check_padding(file, layout.layout_offset + layout_section_bytes(header), layout.table_offset))
      return ec;
  } else if (error_code ec = check_padding(file, tokens_end, layout.table_offset)) {
    return ec;
  }
  return check_padding(file, layout.table_offset + table_bytes(header), layout.first_layer);
}

/// Makes `expected.layout` the layout expected (`full(num_layers)` if none
/// was given); `invalid_config` for one that is not a sequence's or not of
/// `num_layers` layers.
error_code resolve_layout(file_expectation& expected) {
  try {
    if (!expected.layout) expected.layout = kv_model_layout::full(expected.num_layers);
    validate(*expected.layout);
  } catch (const std::system_error&) {
    return kv_errc::invalid_config;
  }
  return expected.layout->num_layers() == expected.num_layers ? error_code() : error_code(kv_errc::invalid_config);
}

/// `invalid_config` unless a sequence of `expected` can be made on `pool`
/// (what make_sequence() would throw), checked before any I/O.
error_code check_fits(file_expectation& expected, const kv_block_pool& pool) {
  if (expected.num_layers == 0 || expected.config.max_blocks != kv_cache_config{}.max_blocks)
    return kv_errc::invalid_config;
  if (error_code ec = resolve_layout(expected)) return ec;
  try {
    validate(expected.config, expected.element);
  } catch (const std::system_error&) {
    return kv_errc::invalid_config;
  }
  const bool keys_only = expected.layout && expected.layout->keys_only;  // resolved above: never empty
  const block_layout blocks(expected.config, expected.element, keys_only);
  return blocks.fits(*pool_access::state(pool)) ? error_code() : error_code(kv_errc::invalid_config);
}

class load_job;

/// One chunk's append: its completion hands the result back to the job.
class load_append_op final : public sequence_op {
 public:
  explicit load_append_op(std::shared_ptr<load_job> job) noexcept : sequence_op(&finish), job_(std::move(job)) {}

 private:
  static void finish(operation* base, const error_code* ec, queueing how);
  std::shared_ptr<load_job> job_;
};

class load_job : public std::enable_shared_from_this<load_job> {
 public:
  load_job(asio::any_io_executor ex, std::filesystem::path path, kv_block_pool pool, file_expectation expected,
           const asio::any_io_executor& io, unstarted_op& op)
      : ex_(std::move(ex)),
        path_(std::move(path)),
        pool_(std::move(pool)),
        expected_(std::move(expected)),
        io_(track_work(io)),
        owner_(block_pool::new_owner_id()),
        op_(op.take()) {}  // last: `op` is taken only once nothing else can throw
  load_job(const load_job&) = delete;
  load_job& operator=(const load_job&) = delete;
  ~load_job() {
    if (op_) op_->discard();  // dropped unrun: the I/O executor or an actor was destroyed
  }

  /// On the I/O executor: reads and checks the file into blocks, makes the
  /// sequence on them, then appends the tokens of a last partial block.
  void start() {
    const error_code ec = run_claimed(*op_, [&] { return read_and_make(); });
    if (ec || tail() == 0) return finish(ec);
    append_tail();
  }

  /// Where the tail's append ended (on a layer's strand): back to the I/O
  /// executor. Null: the actor dropped the append unapplied.
  void appended(const error_code* ec) {
    if (!ec) {
      std::exchange(op_, nullptr)->discard();
      return;
    }
    asio::post(io_, [self = shared_from_this(), result = *ec] { self->finish(result); });
  }

 private:
  /// Reads every layer's full blocks straight into new pool blocks (one
  /// read, no conversion: the file holds the blocks' stored elements) and
  /// its last partial block's tokens into floats, checking each layer's
  /// checksum on the way; then makes the sequence on the full blocks. On
  /// any error the blocks read so far are released: nothing is created.
  error_code read_and_make() {
    std::vector<layer_record> table;
    if (error_code ec = open_checked(path_, expected_, file_, header_, table, &ids_)) return ec;
    // Every block the tokens fill, reserved at once: nothing taken if short.
    std::error_code short_of;
    kv_block_reservation reservation =
        pool_.reserve((full_blocks() + (tail() != 0 ? 1 : 0)) * header_.num_layers, short_of);
    if (short_of) return to_error_code(short_of);
    const ref_ptr<block_pool> pool = pool_access::state(pool_);
    const auto account = ref_ptr<block_account>::adopt(new block_account(pool));
    account->left.store(pool_access::release_reservation(reservation), std::memory_order_relaxed);
    std::vector<std::vector<ref_ptr<block>>> blocks(header_.num_layers);
    keys_.assign(header_.num_layers, std::vector<float>(tail() * header_.token_width()));
    values_.assign(header_.num_layers, std::vector<float>(tail() * header_.value_width()));
    for (std::size_t l = 0; l < header_.num_layers; ++l) {
      if (!op_->claim()) return asio::error::operation_aborted;
      if (error_code ec = read_layer(l, table[l], *pool, *account, blocks[l])) return ec;
      if (error_code ec = check_layer_padding(file_, header_, l)) return ec;
    }
    const std::span<const token_id> ids(ids_);
    std::vector<std::size_t> kept_from;
    kept_from.reserve(header_.layers.size());
    for (const saved_layer& l : header_.layers) kept_from.push_back(l.kept_from);
    // (Resolved by check_fits() before the job began: never the default.)
    const kv_model_layout layout = expected_.layout.value_or(kv_model_layout::full(expected_.num_layers));
    seq_ = make_attached_sequence(ex_, expected_.config, layout, expected_.element, pool, std::move(blocks),
                                  ids.first(header_.tokens - tail()), kept_from);
    // The tail's blocks are the sequence's to take.
    seq_->account->left.fetch_add(account->left.exchange(0, std::memory_order_relaxed), std::memory_order_relaxed);
    return {};
  }

  /// Layer `l`: its keys, then its values, each in file order (block after
  /// block, then the tail), hashed as they arrive.
  error_code read_layer(std::size_t l, const layer_record& record, block_pool& pool, block_account& account,
                        std::vector<ref_ptr<block>>& out) {
    if (header_.kept_begin(l) > header_.sinks_end(l)) return read_windowed_layer(l, record, pool, account, out);
    const std::size_t full = full_blocks();
    const std::size_t run = header_.block_tokens * header_.token_bytes();  // a block's keys
    const std::size_t value_run = header_.block_tokens * header_.value_token_bytes();
    out.reserve(full);
    block_cursor cursor(pool);
    for (std::size_t i = 0; i < full; ++i) {
      ref_ptr<block> b = block::make(pool, cursor, owner_, &account);
      if (!b) return kv_errc::capacity_exhausted;  // the memory, not the budget (reserved)
      out.push_back(std::move(b));
    }
    // Reads of up to half a MiB, hashed while still in the cache.
    const std::size_t per_read = std::max<std::size_t>(1, (std::size_t{512} << 10) / run);
    std::vector<std::span<std::byte>> parts;
    parts.reserve(std::min(per_read, full));
    xxh3_stream hash;
    for (const bool values : {false, true}) {
      const std::uint64_t base = record.offset + (values ? header_.key_bytes(l) : 0);
      const std::size_t part = values ? value_run : run;
      for (std::size_t first = 0; first < full && part != 0; first += per_read) {
        parts.clear();
        for (std::size_t i = first; i < std::min(full, first + per_read); ++i)
          parts.emplace_back(values ? out[i]->values() : out[i]->keys(), part);
        if (error_code ec = read_scattered(file_, base + first * part, parts)) return ec;
        for (const std::span<std::byte> part : parts) hash.update(part);
      }
      if (tail() == 0) continue;
      std::vector<float>& floats = values ? values_[l] : keys_[l];
      std::vector<std::byte> raw(floats.size() / header_.group() * header_.element_bytes);
      if (error_code ec = read_at(file_, base + full * part, raw)) return ec;
      hash.update(raw);
      header_.codec().load(raw.data(), floats.size(), floats.data(), values ? header_.value_scale : header_.key_scale);
    }
    if (hash.digest() != record.checksum) return kv_errc::file_corrupt;
    for (const ref_ptr<block>& b : out) b->set_filled(header_.block_tokens);
    return {};
  }

  /// A windowed layer that dropped positions: its saved tokens (its sinks,
  /// then from its first kept position on) read whole, checked, then copied
  /// into the blocks that hold any of them (zeros at the positions it
  /// dropped) and its tail; null for the blocks that hold none.
  error_code read_windowed_layer(std::size_t l, const layer_record& record, block_pool& pool, block_account& account,
                                 std::vector<ref_ptr<block>>& out) {
    std::vector<std::byte> bytes(record.bytes);
    if (error_code ec = read_at(file_, record.offset, bytes)) return ec;
    xxh3_stream hash;
    hash.update(bytes);
    if (hash.digest() != record.checksum) return kv_errc::file_corrupt;
    const std::size_t token_bytes = header_.token_bytes();
    const std::size_t bt = header_.block_tokens, sinks = header_.sinks_end(l), kept = header_.kept_begin(l);
    // The keys, then the values (none for keys alone), of the saved tokens.
    const std::size_t value_bytes = header_.value_token_bytes();  // of a token
    const std::byte* const saved_values = bytes.data() + header_.key_bytes(l);
    // Position p's place among the saved tokens, if the layer saved it.
    constexpr std::size_t dropped = static_cast<std::size_t>(-1);
    const auto saved_index = [&](std::size_t p) {
      if (p < sinks) return p;
      return p >= kept ? sinks + p - kept : dropped;
    };
    block_cursor cursor(pool);
    out.reserve(full_blocks());
    for (std::size_t b = 0; b < full_blocks(); ++b) {
      if (b * bt >= sinks && (b + 1) * bt <= kept) {  // holds none of them
        out.emplace_back();
        continue;
      }
      ref_ptr<block> blk = block::make(pool, cursor, owner_, &account);
      if (!blk) return kv_errc::capacity_exhausted;
      for (std::size_t t = 0; t < bt; ++t) {
        const std::size_t i = saved_index(b * bt + t);
        std::byte* keys = blk->keys() + t * token_bytes;
        std::byte* values = blk->values() + t * value_bytes;
        if (i != dropped) {
          std::memcpy(keys, bytes.data() + i * token_bytes, token_bytes);
          std::memcpy(values, saved_values + i * value_bytes, value_bytes);
        } else {
          std::memset(keys, 0, token_bytes);
          std::memset(values, 0, value_bytes);
        }
      }
      blk->set_filled(bt);
      out.push_back(std::move(blk));
    }
    const std::size_t width = header_.token_width();
    for (std::size_t t = 0; t < tail(); ++t) {
      const std::size_t i = saved_index(full_blocks() * bt + t);
      if (i == dropped) continue;  // zeros (the vectors start so)
      header_.codec().load(bytes.data() + i * token_bytes, width, keys_[l].data() + t * width, header_.key_scale);
      const std::size_t value_width = header_.value_width();
      header_.codec().load(saved_values + i * value_bytes, value_width, values_[l].data() + t * value_width,
                           header_.value_scale);
    }
    return {};
  }

  /// On the I/O executor: appends the last partial block's tokens.
  void append_tail() {
    if (!op_->claim()) return finish(asio::error::operation_aborted);
    for (std::size_t l = 0; l < header_.num_layers; ++l) {
      key_spans_.emplace_back(keys_[l]);
      value_spans_.emplace_back(values_[l]);
    }
    load_append_op* op = nullptr;
    try {
      op = new load_append_op(shared_from_this());
    } catch (const std::bad_alloc&) {
      return finish(kv_errc::capacity_exhausted);
    }
    start_append(seq_, op, key_spans_, value_spans_, std::span<const token_id>(ids_).subspan(header_.tokens - tail()));
  }

  /// The file's full blocks a layer, and the tokens of its last partial one.
  std::size_t full_blocks() const noexcept { return header_.tokens / header_.block_tokens; }
  std::size_t tail() const noexcept { return header_.tokens % header_.block_tokens; }

  void finish(error_code ec) {
    if (!ec) {
      op_->loaded = std::move(seq_);
      op_->ids = std::move(ids_);
    }
    // Everything that holds the pool or the sequence goes before the handler
    // runs (a failed load's sequence with it), as the caller may expect them
    // gone once it has.
    seq_.reset();
    { const kv_block_pool released(std::move(pool_)); }
    ex_ = asio::any_io_executor();
    (void)file_.close();
    std::exchange(op_, nullptr)->complete(ec, queueing::post);
  }

  asio::any_io_executor ex_;
  std::filesystem::path path_;
  kv_block_pool pool_;  // moved from (released) once the load ends
  file_expectation expected_;
  decltype(track_work(std::declval<const asio::any_io_executor&>())) io_;  // work held until the job ends
  const std::uint64_t owner_;  // of the blocks read here, which no one writes
  io_op* op_;             // null once completed or discarded

  file_descriptor file_;
  file_header header_;
  std::vector<token_id> ids_;
  std::shared_ptr<sequence_state> seq_;
  // The last partial block's tokens a layer (none: empty), widened for its append.
  std::vector<std::vector<float>> keys_, values_;
  std::vector<std::span<const float>> key_spans_, value_spans_;
};

void load_append_op::finish(operation* base, const error_code* ec, queueing) {
  auto* self = static_cast<load_append_op*>(base);
  const std::shared_ptr<load_job> job = std::move(self->job_);
  delete self;  // NOLINT(cppcoreguidelines-owning-memory): made by load_job::append_next
  job->appended(ec);
}

/// Reads one layer: all of it on the I/O executor, in one go.
class read_layer_job {
 public:
  read_layer_job(std::filesystem::path path, std::size_t layer, file_expectation expected, unstarted_op& op) noexcept
      : path_(std::move(path)), layer_(layer), expected_(std::move(expected)), op_(op.take()) {}
  read_layer_job(const read_layer_job&) = delete;
  read_layer_job& operator=(const read_layer_job&) = delete;
  ~read_layer_job() {
    if (op_) op_->discard();
  }

  void run() {
    const error_code ec = run_claimed(*op_, [&] { return read(); });
    if (ec) op_->layer = {};
    std::exchange(op_, nullptr)->complete(ec, queueing::post);
  }

 private:
  error_code read() {
    file_descriptor file;
    file_header header;
    std::vector<layer_record> table;
    if (error_code ec = open_checked(path_, expected_, file, header, table, nullptr)) return ec;
    const layer_record& record = table[layer_];
    // A window's dropped positions are not in the file: no whole layer.
    if (header.kept_begin(layer_) > header.sinks_end(layer_)) return kv_errc::outside_window;
    std::vector<std::byte> bytes(record.bytes);
    if (error_code ec = read_at(file, record.offset, bytes)) return ec;
    xxh3_stream hash;
    hash.update(bytes);
    if (hash.digest() != record.checksum) return kv_errc::file_corrupt;
    if (error_code ec = check_layer_padding(file, header, layer_)) return ec;
    const std::size_t elements = header.tokens * header.token_width();
    kv_range& out = op_->layer;
    out.begin = 0;
    out.end = header.tokens;
    const std::size_t value_elements = header.tokens * header.value_width();
    out.keys.resize(elements);
    out.values.resize(value_elements);
    header.codec().load(bytes.data(), elements, out.keys.data(), header.key_scale);
    header.codec().load(bytes.data() + header.key_bytes(layer_), value_elements, out.values.data(), header.value_scale);
    return {};
  }

  std::filesystem::path path_;
  std::size_t layer_;
  file_expectation expected_;
  io_op* op_;  // null once completed
};

}  // namespace

void start_load(asio::any_io_executor ex, std::filesystem::path path, const kv_block_pool& pool,
                file_expectation expected, const asio::any_io_executor& io, io_op* op) {
  unstarted_op pending(op);
  if (error_code ec = check_fits(expected, pool)) return pending.complete(ec);
  auto job = std::make_shared<load_job>(std::move(ex), std::move(path), pool, std::move(expected), io, pending);
  // From here the job owns the operation (a throwing post discards it).
  asio::post(io, [job = std::move(job)] { job->start(); });
}

void start_read_layer(std::filesystem::path path, std::size_t layer, file_expectation expected,
                      const asio::any_io_executor& io, io_op* op) {
  unstarted_op pending(op);
  if (layer >= expected.num_layers) return pending.complete(kv_errc::layer_mismatch);
  if (error_code ec = resolve_layout(expected)) return pending.complete(ec);
  auto job = std::make_shared<read_layer_job>(std::move(path), layer, std::move(expected), pending);
  asio::post(io, [job = std::move(job)] { job->run(); });
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
