// Communicator: a group of one, and ranks as threads of one process (InProcessGroup), the CPU
// stand-in for NCCL: sums in rank order (the same bits on every rank, whatever the arrival order),
// bf16 rounded once, gathers in rank order, repeated collectives, and errors that reach every rank
// instead of leaving the others waiting.
#include "runtime/communicator.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/dtype.h"

namespace metrale {
namespace {

// Runs body(rank) on `size` threads of one group; rethrows nothing (bodies record their own results).
void run_ranks(InProcessGroup& group, const std::function<void(Communicator&)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < group.size(); ++r) threads.emplace_back([&, r] { body(group.communicator(r)); });
  for (auto& thread : threads) thread.join();
}

float value_of(int rank, size_t i) {
  return 0.1f * static_cast<float>(rank + 1) + 0.37f * static_cast<float>(i % 11);
}

TEST(Communicator, SingleRankKeepsValuesAndCopiesTheGather) {
  SingleRank single;
  EXPECT_EQ(single.rank(), 0);
  EXPECT_EQ(single.size(), 1);
  std::vector<float> values = {1.5f, -2.0f, 3.25f};
  single.all_reduce_sum(Tensor(values.data(), DType::kF32, {3}));
  EXPECT_EQ(values, (std::vector<float>{1.5f, -2.0f, 3.25f}));
  std::vector<float> gathered(3, 0.0f);
  single.all_gather(Tensor(values.data(), DType::kF32, {3}), Tensor(gathered.data(), DType::kF32, {3}));
  EXPECT_EQ(gathered, values);
  std::vector<int32_t> ids = {1, 2};
  EXPECT_THROW(single.all_reduce_sum(Tensor(ids.data(), DType::kI32, {2})), Error);
}

TEST(Communicator, AllReduceSumsInRankOrderOnEveryRank) {
  for (const int size : {1, 2, 3, 4}) {
    SCOPED_TRACE(::testing::Message() << size << " ranks");
    InProcessGroup group(size);
    constexpr size_t kCount = 257;
    std::vector<std::vector<float>> data(static_cast<size_t>(size), std::vector<float>(kCount));
    std::vector<float> expected(kCount, 0.0f);
    for (int r = 0; r < size; ++r) {
      for (size_t i = 0; i < kCount; ++i) data[static_cast<size_t>(r)][i] = value_of(r, i);
    }
    for (size_t i = 0; i < kCount; ++i) {
      for (int r = 0; r < size; ++r) expected[i] += data[static_cast<size_t>(r)][i];
    }
    run_ranks(group, [&](Communicator& comm) {
      // Later ranks arrive first: the order of the sum must not follow arrival.
      std::this_thread::sleep_for(std::chrono::milliseconds(5 * (size - comm.rank())));
      comm.all_reduce_sum(Tensor(data[static_cast<size_t>(comm.rank())].data(), DType::kF32, {kCount}));
    });
    for (int r = 0; r < size; ++r) EXPECT_EQ(data[static_cast<size_t>(r)], expected) << "rank " << r;
  }
}

TEST(Communicator, EmptyTensorsPassThrough) {
  // A step with no logit rows all-reduces a [0, V] tensor without data.
  InProcessGroup group(2);
  int done = 0;
  std::mutex mutex;
  run_ranks(group, [&](Communicator& comm) {
    comm.all_reduce_sum(Tensor(nullptr, DType::kF32, {0, 8}));
    comm.all_gather(Tensor(nullptr, DType::kF32, {0, 8}), Tensor(nullptr, DType::kF32, {0, 8}));
    const std::lock_guard lock(mutex);
    ++done;
  });
  EXPECT_EQ(done, 2);
}

TEST(Communicator, Bf16SumsInFp32AndRoundOnce) {
  InProcessGroup group(3);
  // 1 + 2^-8 + 2^-8: bf16 accumulation would round each step back to 1; fp32 then one rounding gives 1 + 2^-7.
  const float parts[3] = {1.0f, 1.0f / 256.0f, 1.0f / 256.0f};
  std::vector<std::vector<uint16_t>> data(3);
  for (int r = 0; r < 3; ++r) data[static_cast<size_t>(r)] = {f32_to_bf16_bits(parts[r]), f32_to_bf16_bits(2.0f)};
  run_ranks(group, [&](Communicator& comm) {
    comm.all_reduce_sum(Tensor(data[static_cast<size_t>(comm.rank())].data(), DType::kBF16, {2}));
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(bf16_bits_to_f32(data[static_cast<size_t>(r)][0]), 1.0f + 1.0f / 128.0f) << "rank " << r;
    EXPECT_EQ(bf16_bits_to_f32(data[static_cast<size_t>(r)][1]), 6.0f);
  }
}

TEST(Communicator, GatherAndRepeatedCollectivesKeepTheirOrder) {
  constexpr int kRanks = 4;
  InProcessGroup group(kRanks);
  std::vector<std::vector<float>> gathered(kRanks, std::vector<float>(2 * 3 * kRanks, -1.0f));
  std::vector<std::vector<float>> totals(kRanks);
  run_ranks(group, [&](Communicator& comm) {
    const int r = comm.rank();
    std::vector<float> mine(6);
    for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<float>(100 * r) + static_cast<float>(i);
    comm.all_gather(Tensor(mine.data(), DType::kF32, {2, 3}),
                    Tensor(gathered[static_cast<size_t>(r)].data(), DType::kF32, {2 * kRanks, 3}));
    for (int step = 0; step < 50; ++step) {  // generations: no collective may mix with the next
      float value = static_cast<float>(step * (r + 1));
      comm.all_reduce_sum(Tensor(&value, DType::kF32, {1}));
      totals[static_cast<size_t>(r)].push_back(value);
      if (step % 7 == 0) comm.barrier();
    }
  });
  for (int r = 0; r < kRanks; ++r) {
    for (int source = 0; source < kRanks; ++source) {
      for (int i = 0; i < 6; ++i) {
        EXPECT_EQ(gathered[static_cast<size_t>(r)][static_cast<size_t>(source * 6 + i)],
                  static_cast<float>(100 * source + i));
      }
    }
    ASSERT_EQ(totals[static_cast<size_t>(r)].size(), 50u);
    for (int step = 0; step < 50; ++step)
      EXPECT_EQ(totals[static_cast<size_t>(r)][static_cast<size_t>(step)], 10.0f * step);
  }
}

TEST(Communicator, MismatchedShapesRaiseOnEveryRank) {
  InProcessGroup group(3);
  std::vector<int> raised(3, 0);
  run_ranks(group, [&](Communicator& comm) {
    std::vector<float> values(comm.rank() == 2 ? 5 : 4, 1.0f);
    try {
      comm.all_reduce_sum(Tensor(values.data(), DType::kF32, {static_cast<int64_t>(values.size())}));
    } catch (const Error&) {
      raised[static_cast<size_t>(comm.rank())] = 1;
    }
  });
  EXPECT_EQ(raised, (std::vector<int>{1, 1, 1}));
}

TEST(Communicator, AnAbortingRankReleasesTheOthers) {
  InProcessGroup group(3);
  std::vector<std::string> errors(3);
  run_ranks(group, [&](Communicator& comm) {
    float value = 1.0f;
    try {
      if (comm.rank() == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the others are waiting by now
        comm.abort("its forward raised");
        return;
      }
      comm.all_reduce_sum(Tensor(&value, DType::kF32, {1}));
    } catch (const Error& error) {
      errors[static_cast<size_t>(comm.rank())] = error.what();
    }
  });
  for (const int r : {0, 2})
    EXPECT_NE(errors[static_cast<size_t>(r)].find("rank 1"), std::string::npos) << errors[static_cast<size_t>(r)];
  // The group stays failed: a later collective raises at once.
  float value = 1.0f;
  EXPECT_THROW(group.communicator(0).all_reduce_sum(Tensor(&value, DType::kF32, {1})), Error);
}

TEST(Communicator, DifferentCollectivesAtOnceRaise) {
  InProcessGroup group(2);
  std::vector<int> raised(2, 0);
  run_ranks(group, [&](Communicator& comm) {
    float value = 1.0f;
    try {
      if (comm.rank() == 0) {
        comm.all_reduce_sum(Tensor(&value, DType::kF32, {1}));
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        comm.barrier();
      }
    } catch (const Error&) {
      raised[static_cast<size_t>(comm.rank())] = 1;
    }
  });
  EXPECT_EQ(raised, (std::vector<int>{1, 1}));
}

}  // namespace
}  // namespace metrale
