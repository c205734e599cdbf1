// copy_segments_async on a GPU (the host tier's block and slot copies): many segments of different
// sizes between device memory and pinned host memory, both directions, in one batch each, ordered
// on the device's stream after a kernel-free device write; the bytes must come back as written.
// The CopyLane's tickets against the current stream, and the host tier's staged copies out: a
// block overwritten on the current stream right after its store still reaches the host as it was.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "cache/host_tier.h"
#include "cuda/cuda_test_helpers.h"
#include "runtime/buffer.h"
#include "runtime/copy_lane.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

TEST(CudaCopySegments, BatchesRoundTripBetweenDeviceAndPinnedHost) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const Device gpu = Device::cuda(0);
  // 72 segments (a Qwen3-8B block: 36 layers x keys and values) of uneven sizes, one odd-sized.
  std::vector<size_t> sizes(72);
  for (size_t i = 0; i < sizes.size(); ++i) sizes[i] = 4096 + 256 * (i % 7) + (i == 5 ? 3 : 0);
  const size_t total = std::accumulate(sizes.begin(), sizes.end(), size_t{0});
  Buffer device_a(gpu, total), device_b(gpu, total);
  PinnedBuffer host_in(total), host_out(total);
  auto* in = static_cast<uint8_t*>(host_in.data());
  for (size_t i = 0; i < total; ++i) in[i] = static_cast<uint8_t>((i * 131 + 7) % 251);
  std::memset(host_out.data(), 0, total);
  // Host -> device A in one batch, device A -> device B (stream order), device B -> host in one batch.
  std::vector<CopySegment> up, down;
  size_t offset = 0;
  for (const size_t bytes : sizes) {
    up.push_back({static_cast<uint8_t*>(device_a.data()) + offset, in + offset, bytes});
    down.push_back({static_cast<uint8_t*>(host_out.data()) + offset,
                    static_cast<const uint8_t*>(device_b.data()) + offset, bytes});
    offset += bytes;
  }
  copy_segments_async(gpu, up);
  copy_bytes_async(device_b.data(), gpu, device_a.data(), gpu, total);
  copy_segments_async(gpu, down);
  synchronize(gpu);
  EXPECT_EQ(std::memcmp(host_out.data(), host_in.data(), total), 0);
  // An empty batch and empty segments are no-ops.
  copy_segments_async(gpu, {});
  const CopySegment empty{host_out.data(), device_a.data(), 0};
  copy_segments_async(gpu, std::span<const CopySegment>(&empty, 1));
  synchronize(gpu);
}

TEST(CudaCopySegments, LaneTicketsOrderTheCurrentStream) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const Device gpu = Device::cuda(0);
  constexpr size_t kBytes = 64 << 20;  // long enough on PCIe that a missing wait would show
  PinnedBuffer host_in(kBytes), host_out(kBytes);
  auto* in = static_cast<uint8_t*>(host_in.data());
  for (size_t i = 0; i < kBytes; ++i) in[i] = static_cast<uint8_t>((i * 29 + 3) % 253);
  Buffer staged(gpu, kBytes), copied(gpu, kBytes);
  staged.zero();
  synchronize(gpu);
  CopyLane lane(gpu);
  const CopySegment up{staged.data(), in, kBytes};
  const CopyLane::Ticket first = lane.copy_after_current(std::span<const CopySegment>(&up, 1));
  EXPECT_EQ(first, 1u);
  lane.hold_current_until(first);  // the device-to-device copy below waits for the upload
  copy_bytes_async(copied.data(), gpu, staged.data(), gpu, kBytes);
  const CopySegment down{host_out.data(), copied.data(), kBytes};
  copy_segments_async(gpu, std::span<const CopySegment>(&down, 1));
  synchronize(gpu);
  EXPECT_TRUE(lane.done(first));
  EXPECT_EQ(std::memcmp(host_out.data(), host_in.data(), kBytes), 0);
  const CopyLane::Ticket second = lane.copy_after_current({});
  EXPECT_EQ(second, 2u);
  lane.wait_all();
  EXPECT_TRUE(lane.done(second));
}

TEST(CudaCopySegments, StagedHostTierStoresSurviveTheNextWriter) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const Device gpu = Device::cuda(0);
  constexpr int64_t kBlocks = 6;
  const std::vector<int64_t> unit_floats = {1 << 16, 3000, 1 << 15};  // 256 KiB, an uneven unit, 128 KiB
  std::vector<OwnedTensor> paged;
  std::vector<size_t> unit_bytes;
  for (const int64_t floats : unit_floats) {
    paged.emplace_back(DType::kF32, Shape{kBlocks, floats}, gpu);
    unit_bytes.push_back(static_cast<size_t>(floats) * sizeof(float));
  }
  const auto pattern = [](size_t tensor, int64_t block, int64_t i, int version) {
    return static_cast<float>(version * 1000003 + static_cast<int64_t>(tensor) * 7919 + block * 104729 + i);
  };
  const auto fill = [&](int64_t block, int version) {  // one block of every tensor, on the current stream
    for (size_t t = 0; t < paged.size(); ++t) {
      std::vector<float> values(static_cast<size_t>(unit_floats[t]));
      for (int64_t i = 0; i < unit_floats[t]; ++i) values[static_cast<size_t>(i)] = pattern(t, block, i, version);
      copy_bytes(paged[t].tensor.data_as<float>() + block * unit_floats[t], gpu, values.data(), Device::cpu(),
                 unit_bytes[t]);
    }
  };
  for (int64_t block = 0; block < kBlocks; ++block) fill(block, 1);
  HostTier host(gpu, unit_bytes, {}, kBlocks, 0);
  host.enable_staging(paged, 2);  // 5 stores wrap the ring twice
  ASSERT_EQ(host.num_staging_blocks(), 2);
  std::vector<int32_t> taken;
  ASSERT_TRUE(host.block_pool().allocate(5, taken, nullptr));
  for (int64_t block = 0; block < 5; ++block) {
    host.store_block(paged, static_cast<int32_t>(block), taken[static_cast<size_t>(block)]);
    fill(block, 2);  // the next writer, queued right behind the store on the current stream
  }
  // Back into device blocks: entries still on the lane are waited for on the device.
  for (int64_t block = 0; block < 5; ++block)
    host.load_block(paged, taken[static_cast<size_t>(block)], static_cast<int32_t>(block));
  synchronize(gpu);
  for (int64_t block = 0; block < 5; ++block) {
    SCOPED_TRACE(block);
    for (size_t t = 0; t < paged.size(); ++t) {
      std::vector<float> values(static_cast<size_t>(unit_floats[t]));
      copy_bytes(values.data(), Device::cpu(), paged[t].tensor.data_as<float>() + block * unit_floats[t], gpu,
                 unit_bytes[t]);
      int64_t wrong = 0;
      for (int64_t i = 0; i < unit_floats[t]; ++i) wrong += values[static_cast<size_t>(i)] != pattern(t, block, i, 1);
      EXPECT_EQ(wrong, 0) << "tensor " << t;
    }
    // Packing waits for the entry's lane copy and seals it; the seal then holds.
    const std::vector<std::byte> packed = host.pack_block(taken[static_cast<size_t>(block)]);
    EXPECT_EQ(packed.size(), host.packed_block_bytes());
    EXPECT_TRUE(host.verify_block(taken[static_cast<size_t>(block)]));
  }
}

}  // namespace
}  // namespace metrale
