// copy_segments_async on a GPU (the host tier's block and slot copies): many segments of different
// sizes between device memory and pinned host memory, both directions, in one batch each, ordered
// on the device's stream after a kernel-free device write; the bytes must come back as written.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "cuda/cuda_test_helpers.h"
#include "runtime/buffer.h"
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

}  // namespace
}  // namespace metrale
