// BlockPool: all-or-nothing allocation, reference counting, misuse reported as internal errors,
// and a randomized scenario of thousands of operations checked against a model of the pool.
#include "cache/block_pool.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "core/test_support.h"

namespace metrale {
namespace {

using testing::throws_error;

TEST(BlockPool, StartsFreeAndAllocatesLowestIdsFirst) {
  BlockPool pool(6);
  EXPECT_EQ(pool.num_blocks(), 6);
  EXPECT_EQ(pool.num_free(), 6);
  EXPECT_EQ(pool.num_used(), 0);
  std::vector<int32_t> blocks = {99};  // allocate appends; it never clears what the caller had
  ASSERT_TRUE(pool.allocate(3, blocks));
  EXPECT_EQ(blocks, (std::vector<int32_t>{99, 0, 1, 2}));
  for (const int32_t b : {0, 1, 2}) EXPECT_EQ(pool.ref_count(b), 1);
  EXPECT_EQ(pool.ref_count(3), 0);
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_EQ(pool.num_used(), 3);
}

TEST(BlockPool, AllocationIsAllOrNothing) {
  BlockPool pool(5);
  std::vector<int32_t> first;
  ASSERT_TRUE(pool.allocate(3, first));
  std::vector<int32_t> second = {7};
  EXPECT_FALSE(pool.allocate(3, second));  // only 2 free
  EXPECT_EQ(second, (std::vector<int32_t>{7}));
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_FALSE(pool.allocate(-1, second));
  EXPECT_TRUE(pool.allocate(0, second));
  EXPECT_EQ(second.size(), 1u);
  EXPECT_TRUE(pool.allocate(2, second));
  EXPECT_EQ(pool.num_free(), 0);
  EXPECT_FALSE(pool.allocate(1, second));
}

TEST(BlockPool, RetainAndReleaseCountReferences) {
  BlockPool pool(4);
  std::vector<int32_t> blocks;
  ASSERT_TRUE(pool.allocate(2, blocks));
  pool.retain(blocks[0]);  // shared by a second owner
  EXPECT_EQ(pool.ref_count(blocks[0]), 2);
  pool.release(blocks[0]);
  EXPECT_EQ(pool.ref_count(blocks[0]), 1);
  EXPECT_EQ(pool.num_free(), 2);
  pool.release(blocks[0]);
  EXPECT_EQ(pool.ref_count(blocks[0]), 0);
  EXPECT_EQ(pool.num_free(), 3);
  // The most recently freed block is reused first.
  std::vector<int32_t> again;
  ASSERT_TRUE(pool.allocate(1, again));
  EXPECT_EQ(again[0], blocks[0]);
}

TEST(BlockPool, MisuseIsAnInternalError) {
  BlockPool pool(3);
  std::vector<int32_t> blocks;
  ASSERT_TRUE(pool.allocate(1, blocks));
  pool.release(blocks[0]);
  EXPECT_TRUE(throws_error([&] { pool.release(blocks[0]); }, ErrorCode::kInternal, {"double release"}));
  EXPECT_TRUE(throws_error([&] { pool.release(2); }, ErrorCode::kInternal));  // never allocated
  EXPECT_TRUE(throws_error([&] { pool.retain(1); }, ErrorCode::kInternal, {"free block"}));
  EXPECT_TRUE(throws_error([&] { pool.ref_count(3); }, ErrorCode::kInternal, {"out of range"}));
  EXPECT_TRUE(throws_error([&] { pool.release(-1); }, ErrorCode::kInternal));
  // A failed release changes nothing.
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_TRUE(throws_error([] { BlockPool bad(-2); }, ErrorCode::kInvalidArgument));
  BlockPool empty(0);
  std::vector<int32_t> none;
  EXPECT_TRUE(empty.allocate(0, none));
  EXPECT_FALSE(empty.allocate(1, none));
}

TEST(BlockPool, RandomizedOperationsKeepTheInvariants) {
  const int32_t total = 64;
  BlockPool pool(total);
  std::mt19937_64 rng(1201);
  std::map<int32_t, int32_t> model;  // block -> references held by the test
  const auto check = [&](int step) {
    ASSERT_EQ(pool.num_free() + pool.num_used(), total) << "step " << step;
    ASSERT_EQ(pool.num_used(), static_cast<int32_t>(model.size())) << "step " << step;
    for (int32_t b = 0; b < total; ++b) {
      const auto it = model.find(b);
      ASSERT_EQ(pool.ref_count(b), it == model.end() ? 0 : it->second) << "block " << b << " step " << step;
    }
  };
  for (int step = 0; step < 4000; ++step) {
    const int action = static_cast<int>(rng() % 10);
    if (action < 4) {
      const auto count = static_cast<int32_t>(rng() % 9);
      std::vector<int32_t> got;
      const int32_t free_before = pool.num_free();
      const bool ok = pool.allocate(count, got);
      ASSERT_EQ(ok, count <= free_before) << "step " << step;
      ASSERT_EQ(got.size(), ok ? static_cast<size_t>(count) : 0u);
      std::set<int32_t> distinct(got.begin(), got.end());
      ASSERT_EQ(distinct.size(), got.size()) << "a block handed out twice in one call";
      for (const int32_t b : got) {
        ASSERT_EQ(model.count(b), 0u) << "block " << b << " was already in use";
        model[b] = 1;
      }
    } else if (action < 6 && !model.empty()) {
      auto it = model.begin();
      std::advance(it, static_cast<long>(rng() % model.size()));
      pool.retain(it->first);
      ++it->second;
    } else if (!model.empty()) {
      auto it = model.begin();
      std::advance(it, static_cast<long>(rng() % model.size()));
      pool.release(it->first);
      if (--it->second == 0) model.erase(it);
    }
    check(step);
    if (::testing::Test::HasFatalFailure()) return;
  }
  // Drain everything: the pool ends full.
  for (const auto& [block, refs] : model)
    for (int32_t r = 0; r < refs; ++r) pool.release(block);
  EXPECT_EQ(pool.num_free(), total);
}

}  // namespace
}  // namespace metrale
