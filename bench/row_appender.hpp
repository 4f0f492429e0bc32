#pragma once
// The request replays' writes (prefix_workload, prefix_workload_hybrid,
// retention): token ids appended with `token_rows`' data at the
// sequence's positions, the same rows in every layer.

#include <ghostlink/kv_cache.hpp>

#include <asio/awaitable.hpp>
#include <asio/use_awaitable.hpp>

#include <algorithm>
#include <span>
#include <vector>

#include "workload.hpp"

namespace ghostlink::bench {

class row_appender {
 public:
  row_appender(const token_rows& data, std::size_t layers) : data_(data), keys_(layers), values_(layers) {}

  /// Appends `ids` from `seq.size()` on: one awaited append.
  asio::awaitable<void> operator()(const sequence_kv_cache& seq, std::span<const token_id> ids) {
    std::fill(keys_.begin(), keys_.end(), data_.keys_of(seq.size(), ids.size()));
    std::fill(values_.begin(), values_.end(), data_.values_of(seq.size(), ids.size()));
    co_await seq.async_append(ids, keys_, values_, asio::use_awaitable);
  }
  /// Appends `ids` one token at a time, as a decode.
  asio::awaitable<void> one_by_one(const sequence_kv_cache& seq, std::span<const token_id> ids) {
    for (std::size_t j = 0; j < ids.size(); ++j) co_await (*this)(seq, ids.subspan(j, 1));
  }

 private:
  const token_rows& data_;
  std::vector<std::span<const float>> keys_, values_;
};

}  // namespace ghostlink::bench
