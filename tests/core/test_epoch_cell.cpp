// The lock-free publication cell on its own: readers pinning while the
// actor publishes, and every epoch freed exactly when its last pin goes.
#include "common/support.hpp"

#include "core/epoch_cell.hpp"

#include <latch>
#include <thread>

namespace epoch_cell_tests {

using namespace ghostlink::detail;

namespace {

/// An epoch whose one block carries its number in its first key, so a reader
/// that holds a freed or recycled epoch sees a wrong number (and ASan sees
/// the use after free).
float& first_key(block& b) { return *reinterpret_cast<float*>(b.keys()); }

ref_ptr<epoch> numbered_epoch(block_pool& pool, std::uint64_t number) {
  auto chunk = ref_ptr<table_chunk>::adopt(new table_chunk(number));
  block_cursor cursor(pool);
  chunk->blocks[0] = block::make(pool, cursor, number);
  REQUIRE(chunk->blocks[0]);
  first_key(*chunk->blocks[0]) = static_cast<float>(number);
  auto table = ref_ptr<block_table>::adopt(new block_table(number));
  table->chunks.push_back(std::move(chunk));
  table->blocks = 1;
  static const auto layout = ref_ptr<const block_layout>::adopt(
      new block_layout({.num_heads = 1, .head_dim = 1, .block_tokens = 1}, codec_of<float>));
  return ref_ptr<epoch>::adopt(new epoch(number, 1, 1, std::move(table), {}, *layout));
}

}  // namespace

TEST_CASE("a pinned epoch stays intact while newer ones are published and freed", "[epoch_cell]") {
  auto pool = ref_ptr<block_pool>::adopt(new block_pool(2 * sizeof(float), SIZE_MAX));
  constexpr std::uint64_t publications = 20000;
  constexpr int readers = 2;
  std::vector<std::uint64_t> torn(readers, 0), backwards(readers, 0), pins(readers, 0);
  {
    epoch_cell cell(numbered_epoch(*pool, 0));
    std::atomic<bool> done{false};
    std::latch start(readers + 1);
    std::vector<std::thread> threads;
    for (int r = 0; r < readers; ++r)
      threads.emplace_back([&, r] {
        start.arrive_and_wait();
        std::uint64_t last = 0;
        // Bounded: the publisher finishes after a fixed count, then so do we.
        while (!done.load(std::memory_order_acquire)) {
          ref_ptr<epoch> e = cell.pin();
          ++pins[r];
          if (first_key(*e->table->block_at(0)) != static_cast<float>(e->number)) ++torn[r];
          if (e->number < last) ++backwards[r];
          last = e->number;
        }
      });
    start.arrive_and_wait();
    for (std::uint64_t n = 1; n <= publications; ++n) cell.publish(numbered_epoch(*pool, n));
    done.store(true, std::memory_order_release);
    for (auto& t : threads) t.join();
    CHECK(cell.pin()->number == publications);
    CHECK(pool->blocks_in_use() == 1);  // only the latest epoch is alive
  }
  for (int r = 0; r < readers; ++r) {
    INFO("reader " << r << " pinned " << pins[r] << " times");
    CHECK(torn[r] == 0);
    CHECK(backwards[r] == 0);
  }
  CHECK(pool->blocks_in_use() == 0);  // the cell released the last one
}

TEST_CASE("a pin taken on one thread is released on another", "[epoch_cell]") {
  auto pool = ref_ptr<block_pool>::adopt(new block_pool(2 * sizeof(float), SIZE_MAX));
  epoch_cell cell(numbered_epoch(*pool, 7));
  ref_ptr<epoch> pinned = cell.pin();
  cell.publish(numbered_epoch(*pool, 8));
  CHECK(pool->blocks_in_use() == 2);  // epoch 7 lives on through the pin
  std::thread other([p = std::move(pinned)]() mutable {
    CHECK(p->number == 7);
    p = {};
  });
  other.join();
  CHECK(pool->blocks_in_use() == 1);
}

}  // namespace epoch_cell_tests
