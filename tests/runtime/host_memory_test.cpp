// Host-side behaviour of the device runtime in builds or processes without a GPU: PinnedBuffer's
// plain-memory fallback, host copies, device queries, streams, and the planned (fixed) Arena.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "core/test_support.h"
#include "runtime/arena.h"
#include "runtime/buffer.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

using testing::throws_error;

TEST(PinnedBuffer, FallsBackToUsableHostMemory) {
  PinnedBuffer buffer(1000);
  ASSERT_NE(buffer.data(), nullptr);
  EXPECT_EQ(buffer.size(), 1000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % Buffer::kAlignment, 0u);
  std::memset(buffer.data(), 0x7e, buffer.size());
  PinnedBuffer moved(std::move(buffer));
  EXPECT_EQ(buffer.data(), nullptr);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(static_cast<unsigned char*>(moved.data())[999], 0x7e);
  PinnedBuffer assigned;
  assigned = std::move(moved);
  EXPECT_EQ(assigned.size(), 1000u);
  PinnedBuffer empty(0);
  EXPECT_EQ(empty.data(), nullptr);
}

TEST(HostCopies, CopyAndAsyncCopyBetweenHostBuffers) {
  std::vector<int> src(100), dst(100, -1);
  std::iota(src.begin(), src.end(), 7);
  copy_bytes(dst.data(), Device::cpu(), src.data(), Device::cpu(), 40 * sizeof(int));
  EXPECT_TRUE(std::equal(src.begin(), src.begin() + 40, dst.begin()));
  EXPECT_EQ(dst[40], -1);
  copy_bytes_async(dst.data(), Device::cpu(), src.data(), Device::cpu(), src.size() * sizeof(int));
  synchronize(Device::cpu());
  EXPECT_EQ(dst, src);
  // Overlapping ranges behave like memmove.
  copy_bytes(src.data() + 1, Device::cpu(), src.data(), Device::cpu(), 10 * sizeof(int));
  EXPECT_EQ(src[1], 7);
  EXPECT_EQ(src[10], 16);
  copy_bytes(nullptr, Device::cpu(), nullptr, Device::cpu(), 0);  // nothing to copy
}

TEST(HostCopies, DeviceCopiesWithoutABackendAreUnsupported) {
  if (cuda_available()) GTEST_SKIP() << "this process has a CUDA backend";
  int value = 3;
  EXPECT_TRUE(
      throws_error([&] { copy_bytes(&value, Device::cuda(0), &value, Device::cpu(), 4); }, ErrorCode::kUnsupported));
  EXPECT_TRUE(throws_error([&] { copy_bytes_async(&value, Device::cpu(), &value, Device::cuda(0), 4); },
                           ErrorCode::kUnsupported));
}

TEST(DeviceQueries, CpuIsUntracked) {
  size_t free_bytes = 123, total_bytes = 456;
  device_memory_info(Device::cpu(), free_bytes, total_bytes);
  EXPECT_EQ(free_bytes, 0u);
  EXPECT_EQ(total_bytes, 0u);
  EXPECT_EQ(current_stream(Device::cpu()), nullptr);
  synchronize(Device::cpu());
}

TEST(Arena, ReservedFixedArenaHandsOutStableAddresses) {
  Arena arena(Device::cpu(), 64);
  arena.reserve(1024, /*growable=*/false);
  EXPECT_EQ(arena.capacity_bytes(), 1024u);
  EXPECT_EQ(arena.high_water_bytes(), 0u);
  const Tensor a = arena.alloc(DType::kF32, {10});
  const Tensor b = arena.alloc(DType::kBF16, {100});
  arena.reset();
  EXPECT_EQ(arena.alloc(DType::kF32, {10}).data(), a.data());  // the same sequence replays at the same addresses
  EXPECT_EQ(arena.alloc(DType::kBF16, {100}).data(), b.data());
  EXPECT_TRUE(throws_error([&] { arena.alloc(DType::kF32, {256}); }, ErrorCode::kOutOfMemory));
  arena.reserve(4096, /*growable=*/true);
  EXPECT_EQ(arena.capacity_bytes(), 4096u);
  arena.alloc(DType::kF32, {2048});  // grows past the reservation
  EXPECT_GT(arena.capacity_bytes(), 4096u);
}

}  // namespace
}  // namespace metrale
