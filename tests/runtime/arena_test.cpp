// Arena: aligned, non-overlapping allocations; reuse after reset; growth on demand folded into one
// chunk at the next reset; a fixed arena reports exhaustion.
#include "runtime/arena.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/test_support.h"

namespace metrale {
namespace {

using testing::throws_error;

uintptr_t address(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data());
}

// Checks that the byte ranges of the tensors are pairwise disjoint and that each can be fully
// written (under ASan an allocation smaller than its tensor would be caught here).
void expect_disjoint_and_writable(const std::vector<Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::memset(tensors[i].data(), static_cast<int>(i + 1), tensors[i].nbytes());
    for (size_t j = i + 1; j < tensors.size(); ++j) {
      const uintptr_t a = address(tensors[i]), b = address(tensors[j]);
      const bool disjoint = a + tensors[i].nbytes() <= b || b + tensors[j].nbytes() <= a;
      EXPECT_TRUE(disjoint) << "allocations " << i << " and " << j << " overlap";
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].nbytes() == 0) continue;
    const std::vector<unsigned char> expected(tensors[i].nbytes(), static_cast<unsigned char>(i + 1));
    EXPECT_EQ(std::memcmp(tensors[i].data(), expected.data(), expected.size()), 0)
        << "allocation " << i << " was overwritten";
  }
}

TEST(Arena, AllocationsAreAlignedDisjointAndShaped) {
  Arena arena(Device::cpu(), 4096);
  std::vector<Tensor> tensors;
  tensors.push_back(arena.alloc(DType::kF32, {3, 5}));
  tensors.push_back(arena.alloc(DType::kBF16, {7}));
  tensors.push_back(arena.alloc(DType::kI32, {2, 2, 2}));
  tensors.push_back(arena.alloc(DType::kU8, {1}));
  tensors.push_back(arena.alloc(DType::kF32, {0, 4}));
  tensors.push_back(arena.alloc(DType::kF32, {9, 3}));
  for (const auto& t : tensors) {
    EXPECT_EQ(address(t) % Buffer::kAlignment, 0u);
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_TRUE(t.device().is_cpu());
  }
  EXPECT_TRUE(tensors[0].shape() == (Shape{3, 5}));
  EXPECT_EQ(tensors[1].dtype(), DType::kBF16);
  expect_disjoint_and_writable(tensors);
  // 64 (60 rounded) + 64 + 64 + 64 + 0 + 128 (108 rounded)
  EXPECT_EQ(arena.high_water_bytes(), 384u);
}

TEST(Arena, ResetReusesTheSameMemory) {
  Arena arena(Device::cpu(), 4096);
  const Tensor first = arena.alloc(DType::kF32, {10});
  const Tensor second = arena.alloc(DType::kF32, {10});
  arena.reset();
  const Tensor again = arena.alloc(DType::kF32, {10});
  const Tensor again2 = arena.alloc(DType::kF32, {10});
  EXPECT_EQ(again.data(), first.data());
  EXPECT_EQ(again2.data(), second.data());
  EXPECT_EQ(arena.high_water_bytes(), 128u);
}

TEST(Arena, GrowsOnDemandAndFoldsIntoOneChunkAtReset) {
  Arena arena(Device::cpu(), 256);
  std::vector<Tensor> step;
  // 256 bytes fit in the first chunk; the rest forces new chunks (at least 1 MiB each).
  for (int i = 0; i < 4; ++i) step.push_back(arena.alloc(DType::kF32, {16}));  // 4 x 64 bytes
  step.push_back(arena.alloc(DType::kF32, {300000}));                          // 1.2 MB
  step.push_back(arena.alloc(DType::kF32, {100}));
  step.push_back(arena.alloc(DType::kF32, {200000}));  // another chunk
  expect_disjoint_and_writable(step);
  const size_t used = arena.high_water_bytes();
  EXPECT_EQ(used, 4 * 64u + 1200000u + 448u + 800000u);

  // After reset the same sequence of allocations comes from one contiguous chunk.
  arena.reset();
  std::vector<Tensor> again;
  for (const auto& t : step) again.push_back(arena.alloc(t.dtype(), t.shape()));
  for (size_t i = 0; i + 1 < again.size(); ++i) {
    const size_t rounded = (again[i].nbytes() + Buffer::kAlignment - 1) / Buffer::kAlignment * Buffer::kAlignment;
    EXPECT_EQ(address(again[i]) + rounded, address(again[i + 1])) << "allocation " << i;
  }
  expect_disjoint_and_writable(again);
  EXPECT_EQ(arena.high_water_bytes(), used);
}

TEST(Arena, FixedArenaReportsExhaustion) {
  Arena arena(Device::cpu(), 256, /*growable=*/false);
  arena.alloc(DType::kF32, {32});  // 128 bytes
  arena.alloc(DType::kF32, {32});  // 128 bytes: full
  EXPECT_TRUE(throws_error([&] { arena.alloc(DType::kF32, {1}); }, ErrorCode::kOutOfMemory, {"exhausted", "cpu"}));
  arena.reset();
  EXPECT_NO_THROW(arena.alloc(DType::kF32, {64}));
  EXPECT_TRUE(throws_error([&] { arena.alloc(DType::kF32, {1}); }, ErrorCode::kOutOfMemory));

  Arena empty(Device::cpu(), 0, /*growable=*/false);
  EXPECT_TRUE(throws_error([&] { empty.alloc(DType::kF32, {1}); }, ErrorCode::kOutOfMemory));
}

TEST(Arena, GrowableArenaWithoutInitialChunk) {
  Arena arena(Device::cpu(), 0);
  const Tensor t = arena.alloc(DType::kF32, {8, 8});
  std::memset(t.data(), 0x11, t.nbytes());
  EXPECT_EQ(arena.high_water_bytes(), 256u);
  arena.reset();
  EXPECT_EQ(arena.alloc(DType::kF32, {8, 8}).data(), t.data());
}

}  // namespace
}  // namespace metrale
