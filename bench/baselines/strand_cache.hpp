#pragma once
// The naive actor: the seed's contiguous buffers owned by a strand, and
// every operation, reads included, posted to that strand. What ghostlink
// would be without snapshots: reads queue behind writes and each other.

#include <asio/any_io_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/post.hpp>
#include <asio/strand.hpp>

#include <memory>

#include "locked_cache.hpp"

namespace ghostlink::bench {

/// Storage touched only on the strand, so its lock is never contended.
struct null_mutex {
  void lock() {}
  void unlock() {}
};

class strand_cache {
 public:
  strand_cache(const asio::any_io_executor& ex, const kv_cache_config& config)
      : strand_(asio::make_strand(ex)), storage_(std::make_shared<locked_cache<null_mutex>>(config)) {}

  template <class Token>
  auto async_initialize(std::size_t n, Token&& token) {
    return run(std::forward<Token>(token), [n](auto& s) { return s.initialize(n); });
  }
  template <class Token>
  auto async_write(std::size_t index, std::span<const float> k, std::span<const float> v, Token&& token) {
    return run(std::forward<Token>(token), [=](auto& s) { return s.write(index, k, v); });
  }
  template <class Token>
  auto async_write_batch(std::span<const kv_write> entries, Token&& token) {
    return run(std::forward<Token>(token), [=](auto& s) { return s.write_batch(entries); });
  }
  template <class Token>
  auto async_read_range(std::size_t begin, std::size_t end, kv_range& out, Token&& token) {
    return run(std::forward<Token>(token), [=, &out](auto& s) { return s.read_range(begin, end, out); });
  }

 private:
  /// Runs `op` on the strand, then completes on the handler's executor.
  template <class Token, class Op>
  auto run(Token&& token, Op op) {
    return asio::async_initiate<Token, void(std::error_code)>(
        [this, op](auto handler) {
          auto work = asio::get_associated_executor(handler, strand_.get_inner_executor());
          asio::post(strand_, [storage = storage_, op, h = std::move(handler), work]() mutable {
            const std::error_code ec = op(*storage);
            asio::post(work, [h = std::move(h), ec]() mutable { std::move(h)(ec); });
          });
        },
        token);
  }

  asio::strand<asio::any_io_executor> strand_;
  std::shared_ptr<locked_cache<null_mutex>> storage_;
};

}  // namespace ghostlink::bench
