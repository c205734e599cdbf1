// Rejection sampling of drafts on the GPU (kernels/rejection_sampling.h): one CTA per row. Every
// thread sums the fixed-point residual of a contiguous slice of the row; thread 0 then walks the
// slice sums in id order to the slice where the running mass reaches the draw's target, and that
// slice token by token. Integer masses make the result independent of the thread layout and equal
// to the CPU twin's.
#include <climits>

#include "kernels/cuda/common.cuh"
#include "kernels/rejection_sampling.h"

namespace metrale::kernels::cuda {
namespace {

using sampling_detail::Fixed128;

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    rejection_kernel(const float* __restrict__ target, int64_t target_stride, const float* __restrict__ draft_probs,
                     int64_t draft_stride, int vocab, const int32_t* __restrict__ drafts,
                     const float* __restrict__ accept_uniform, const float* __restrict__ residual_uniform,
                     int32_t* __restrict__ tokens, int32_t* __restrict__ accepted) {
  __shared__ Fixed128 slice_mass[kThreads];
  const int r = blockIdx.x;
  const float* p = target + r * target_stride;
  const float* q = draft_probs != nullptr ? draft_probs + r * draft_stride : nullptr;
  const int d = drafts[r];
  if (d < 0 || d >= vocab) {  // a bug upstream: the caller checks tokens when it reads them back
    if (threadIdx.x == 0) {
      tokens[r] = -1;
      accepted[r] = 0;
    }
    return;
  }
  // Every thread takes the same branch: the same values, the same rounding.
  if (rejection_detail::accepts(accept_uniform[r], q != nullptr ? q[d] : 1.0f, p[d])) {
    if (threadIdx.x == 0) {
      tokens[r] = d;
      accepted[r] = 1;
    }
    return;
  }
  const auto residual = [&](int i) {
    const float qi = q != nullptr ? q[i] : (i == d ? 1.0f : 0.0f);
    return rejection_detail::residual_fixed(p[i], qi);
  };
  const int per_thread = (vocab + kThreads - 1) / kThreads;
  const int begin = min(vocab, static_cast<int>(threadIdx.x) * per_thread);
  const int end = min(vocab, begin + per_thread);
  Fixed128 mine = 0;
  for (int i = begin; i < end; ++i) mine += residual(i);
  slice_mass[threadIdx.x] = mine;
  __syncthreads();
  if (threadIdx.x != 0) return;
  Fixed128 mass = 0;
  for (int t = 0; t < kThreads; ++t) mass += slice_mass[t];
  if (mass == 0) {  // p <= q everywhere: the draft stands
    tokens[r] = d;
    accepted[r] = 1;
    return;
  }
  const Fixed128 goal = sampling_detail::draw_target(residual_uniform[r], mass);
  Fixed128 running = 0;
  int slice = 0;
  while (slice < kThreads - 1 && running + slice_mass[slice] < goal) running += slice_mass[slice++];
  int token = -1;
  const int first = min(vocab, slice * per_thread), last = min(vocab, first + per_thread);
  for (int i = first; i < last; ++i) {
    running += residual(i);
    if (running >= goal) {
      token = i;
      break;
    }
  }
  tokens[r] = token;
  accepted[r] = 0;
}

void check_row_tensor(const Tensor& t, DType dtype, int64_t rows, const char* what) {
  METRALE_EXPECT(t.device().is_cuda() && t.ndim() == 1 && t.dtype() == dtype && t.numel() == rows &&
                     (rows <= 1 || t.stride(0) == 1),
                 std::string("rejection_sample_rows ") + what + ": " + t.describe());
}

void check_probs(const Tensor& t, const char* what) {
  METRALE_EXPECT(
      t.device().is_cuda() && t.ndim() == 2 && t.dtype() == DType::kF32 && t.stride(1) == 1 && t.stride(0) >= t.size(1),
      std::string("rejection_sample_rows ") + what + ": " + t.describe());
}

}  // namespace

void rejection_sample_rows(const RejectionRows& rows, const Tensor& tokens, const Tensor& accepted) {
  check_probs(rows.target, "target");
  const int64_t count = rows.target.size(0), vocab = rows.target.size(1);
  METRALE_EXPECT(vocab >= 1 && vocab < (int64_t{1} << 27), "rejection_sample_rows: vocabulary too large or empty");
  const bool one_hot = rows.draft_probs.empty();
  if (!one_hot) {
    check_probs(rows.draft_probs, "draft_probs");
    METRALE_EXPECT(
        rows.draft_probs.size(0) == count && rows.draft_probs.size(1) == vocab,
        "rejection_sample_rows: draft_probs " + rows.draft_probs.describe() + " for target " + rows.target.describe());
  }
  check_row_tensor(rows.drafts, DType::kI32, count, "drafts");
  check_row_tensor(rows.accept_uniform, DType::kF32, count, "accept_uniform");
  check_row_tensor(rows.residual_uniform, DType::kF32, count, "residual_uniform");
  check_row_tensor(tokens, DType::kI32, count, "tokens");
  check_row_tensor(accepted, DType::kI32, count, "accepted");
  if (count == 0) return;
  METRALE_EXPECT(count <= INT_MAX, "rejection_sample_rows: too many rows");
  rejection_kernel<<<static_cast<unsigned int>(count), kThreads, 0, stream_of(tokens)>>>(
      rows.target.data_as<const float>(), rows.target.stride(0),
      one_hot ? nullptr : rows.draft_probs.data_as<const float>(), one_hot ? 0 : rows.draft_probs.stride(0),
      static_cast<int>(vocab), rows.drafts.data_as<const int32_t>(), rows.accept_uniform.data_as<const float>(),
      rows.residual_uniform.data_as<const float>(), tokens.data_as<int32_t>(), accepted.data_as<int32_t>());
  METRALE_CHECK_LAUNCH("rejection_kernel");
}

}  // namespace metrale::kernels::cuda
