// Token bitmasks on the GPU (kernels/token_bitmask.h): one thread per 4 tokens of a listed row. A
// warp reads 4 mask words (one transaction) and only writes: the -inf of masked tokens, as one
// 16-byte store when all 4 are out and the row allows it, nothing where all 4 are allowed. Logits
// are never read, so a mostly-allowed mask costs little more than reading the mask.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/token_bitmask.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTokensPerThread = 4;
constexpr int kMaxGridY = 65535;

__global__ void __launch_bounds__(kThreads)
    apply_token_bitmask_kernel(float* __restrict__ logits, int64_t row_stride, int num_rows, int vocab,
                               const uint32_t* __restrict__ bitmask, int words, const int32_t* __restrict__ rows,
                               int num_masks, bool vectorised) {
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kTokensPerThread;
  if (first >= vocab) return;
  const float masked = -__builtin_huge_valf();
  for (int k = blockIdx.y; k < num_masks; k += gridDim.y) {
    const int row = rows[k];
    if (row < 0 || row >= num_rows) continue;
    const uint32_t word = bitmask[static_cast<int64_t>(k) * words + (first >> 5)];
    const uint32_t bits = (word >> (first & 31)) & 0xfu;  // first is a multiple of 4: one nibble
    if (bits == 0xfu) continue;
    float* out = logits + static_cast<int64_t>(row) * row_stride + first;
    if (bits == 0u && vectorised && first + kTokensPerThread <= vocab) {
      *reinterpret_cast<float4*>(out) = make_float4(masked, masked, masked, masked);
      continue;
    }
#pragma unroll
    for (int e = 0; e < kTokensPerThread; ++e) {
      if (((bits >> e) & 1u) == 0u && first + e < vocab) out[e] = masked;
    }
  }
}

}  // namespace

void apply_token_bitmask(const Tensor& logits, const Tensor& bitmask, const Tensor& rows) {
  METRALE_EXPECT(logits.device().is_cuda() && bitmask.device() == logits.device() && rows.device() == logits.device(),
                 "apply_token_bitmask: tensors must be on the logits' GPU");
  METRALE_EXPECT(logits.dtype() == DType::kF32 && logits.ndim() == 2 && logits.stride(1) == 1 &&
                     logits.stride(0) >= logits.size(1),
                 "apply_token_bitmask: logits must be [R, V] f32 with a contiguous last dim, got " + logits.describe());
  METRALE_EXPECT(bitmask.dtype() == DType::kI32 && bitmask.ndim() == 2 && bitmask.is_contiguous(),
                 "apply_token_bitmask: bitmask must be [K, W] i32 and contiguous, got " + bitmask.describe());
  METRALE_EXPECT(
      rows.dtype() == DType::kI32 && rows.ndim() == 1 && rows.size(0) == bitmask.size(0) && rows.is_contiguous(),
      "apply_token_bitmask: rows must be [K] i32 for bitmask " + bitmask.describe() + ", got " + rows.describe());
  const int64_t vocab = logits.size(1), words = bitmask.size(1), num_masks = rows.size(0);
  METRALE_EXPECT(words * 32 >= vocab, "apply_token_bitmask: too few mask words for the vocabulary");
  METRALE_EXPECT(vocab < (int64_t{1} << 30) && logits.size(0) < (int64_t{1} << 31) && num_masks < (int64_t{1} << 31),
                 "apply_token_bitmask: logits " + logits.describe() + " too large");
  if (vocab == 0 || num_masks == 0 || logits.size(0) == 0) return;
  // 16-byte stores need every row's start 16-byte aligned.
  const bool vectorised =
      reinterpret_cast<uintptr_t>(logits.data()) % 16 == 0 && logits.stride(0) % kTokensPerThread == 0;
  const dim3 grid(static_cast<unsigned int>(ceil_div(vocab, int64_t{kThreads} * kTokensPerThread)),
                  static_cast<unsigned int>(std::min<int64_t>(num_masks, kMaxGridY)));
  apply_token_bitmask_kernel<<<grid, kThreads, 0, stream_of(logits)>>>(
      logits.data_as<float>(), logits.stride(0), static_cast<int>(logits.size(0)), static_cast<int>(vocab),
      bitmask.data_as<const uint32_t>(), static_cast<int>(words), rows.data_as<const int32_t>(),
      static_cast<int>(num_masks), vectorised);
  METRALE_CHECK_LAUNCH("apply_token_bitmask_kernel");
}

}  // namespace metrale::kernels::cuda
