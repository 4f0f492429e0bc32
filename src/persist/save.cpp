// Saving a sequence's snapshot (detail/persist_interface.hpp's start_save).
//
// Threads: start_save checks its arguments on the initiating thread and
// posts the whole save to the I/O executor, where it runs to the end in one
// go: it reads the snapshot (pinned, lock-free, safe from any thread) and
// writes the file, never touching a cache's strand.

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "ghostlink/detail/asio_config.hpp"

#include "ghostlink/error.hpp"
#include "io/file.hpp"
#include "persist/format.hpp"

GHOSTLINK_NAMESPACE_BEGIN
namespace detail {

namespace {

/// Writes one layer's keys or values at consecutive offsets, hashing them,
/// through a buffer so that small runs (small blocks) cost few writes.
class layer_writer {
 public:
  layer_writer(const file_descriptor& file, std::uint64_t offset) : file_(file), offset_(offset) {
    buffer_.reserve(buffer_bytes);
  }

  static void sink(void* self, std::span<const std::byte> run) { static_cast<layer_writer*>(self)->add(run); }

  /// Writes what is buffered; the first error met, if any.
  error_code flush() {
    if (!error_ && !buffer_.empty()) error_ = write_at(file_, offset_, buffer_);
    offset_ += buffer_.size();
    buffer_.clear();
    return error_;
  }
  std::uint64_t digest() const noexcept { return hash_.digest(); }
  std::uint64_t end() const noexcept { return offset_ + buffer_.size(); }

 private:
  static constexpr std::size_t buffer_bytes = std::size_t{1} << 20;

  void add(std::span<const std::byte> run) {
    hash_.update(run);
    if (buffer_.size() + run.size() > buffer_bytes) (void)flush();
    if (run.size() >= buffer_bytes) {  // a big run goes straight to the file
      if (!error_) error_ = write_at(file_, offset_, run);
      offset_ += run.size();
      return;
    }
    buffer_.insert(buffer_.end(), run.begin(), run.end());
  }

  const file_descriptor& file_;
  std::uint64_t offset_;
  std::vector<std::byte> buffer_;
  xxh3_stream hash_;
  error_code error_;
};

class save_job {
 public:
  /// Takes `op` once nothing can throw.
  save_job(std::unique_ptr<saved_sequence> snapshot, std::filesystem::path path, file_header header,
           std::filesystem::perms mode, unstarted_op& op) noexcept
      : snapshot_(std::move(snapshot)),
        path_(std::move(path)),
        header_(std::move(header)),
        mode_(mode),
        op_(op.take()) {}
  save_job(const save_job&) = delete;
  save_job& operator=(const save_job&) = delete;
  ~save_job() {
    if (op_) op_->discard();  // the I/O executor dropped the job unrun
  }

  void run() {
    const error_code ec = run_claimed(*op_, [&] { return write(); });
    // The snapshot goes before the handler runs: once it has, the caller may
    // expect every block (and the pool) it pinned to be gone.
    snapshot_.reset();
    std::exchange(op_, nullptr)->complete(ec, queueing::post);
  }

 private:
  error_code write() {
    const std::vector<token_id> ids = snapshot_->token_ids();
    replacement_file file;
    if (error_code ec = file.create(path_, header_.layout.file_bytes, mode_)) return ec;
    std::vector<layer_record> table;
    table.reserve(header_.num_layers);
    for (std::size_t l = 0; l < header_.num_layers; ++l) {
      layer_writer out(file.file(), header_.layout.layer_offset(l));
      // What the layer holds: its sinks, then from its first kept position
      // on (every token of a full layer).
      for (const bool values : {false, true}) {
        snapshot_->for_each_run(l, values, 0, header_.sinks_end(l), &layer_writer::sink, &out);
        snapshot_->for_each_run(l, values, header_.kept_begin(l), header_.tokens, &layer_writer::sink, &out);
      }
      if (error_code ec = out.flush()) return ec;
      if (out.end() != header_.layout.layer_offset(l) + header_.layout.layer_bytes(l)) return kv_errc::file_corrupt;
      table.push_back({header_.layout.layer_offset(l), header_.layout.layer_bytes(l), out.digest()});
      if (!op_->claim()) return asio::error::operation_aborted;
    }
    if (error_code ec = write_at(file.file(), 0, encode_front(header_, ids, table))) return ec;
    if (!op_->claim()) return asio::error::operation_aborted;
    return file.commit();
  }

  std::unique_ptr<saved_sequence> snapshot_;
  std::filesystem::path path_;
  file_header header_;
  std::filesystem::perms mode_;
  io_op* op_;  // null once completed
};

}  // namespace

void start_save(std::unique_ptr<saved_sequence> snapshot, std::filesystem::path path, const kv_cache_config& config,
                std::string model, element_codec element, std::filesystem::perms mode, const asio::any_io_executor& io,
                io_op* op) {
  unstarted_op pending(op);
  if (snapshot->num_layers() == 0) return pending.complete(kv_errc::layer_mismatch);
  try {
    validate(config, element);
  } catch (const std::system_error&) {
    return pending.complete(kv_errc::invalid_config);
  }
  if (model.size() > max_model_bytes) return pending.complete(kv_errc::invalid_config);
  if (snapshot->token_width() != config.token_width()) return pending.complete(kv_errc::width_mismatch);
  // The file records config's fp8 scales: they must be what the data means.
  if (const element_scales s = snapshot->scales(); s.key != config.key_scale || s.value != config.value_scale)
    return pending.complete(kv_errc::invalid_config);
  std::vector<saved_layer> layers(snapshot->num_layers());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const window_view w = snapshot->window(l);
    // (A snapshot narrowed by hand may show fewer tokens than it kept.)
    if (w.window != 0) layers[l] = {w.window, w.sinks, std::min(w.kept_from, std::max(w.sinks, snapshot->size()))};
  }
  file_header header;
  if (error_code ec = make_header(std::move(layers), snapshot->rollback_tokens(), snapshot->keys_only(), config,
                                  snapshot->size(), element, std::move(model), header))
    return pending.complete(ec);
  auto job = std::make_shared<save_job>(std::move(snapshot), std::move(path), std::move(header), mode, pending);
  // From here the job owns the operation: a throwing post destroys it, and
  // it discards the operation.
  asio::post(io, [job = std::move(job)] { job->run(); });
}

}  // namespace detail
GHOSTLINK_NAMESPACE_END
