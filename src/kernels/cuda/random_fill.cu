#include "kernels/cuda/common.cuh"
#include "kernels/random_fill.h"

namespace metrale::kernels::cuda {
namespace {

template <typename T>
__global__ void random_fill_kernel(T* __restrict__ out, int64_t n, RandomFillParams params) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = from_f32<T>(random_normal_at(params.seed, static_cast<uint64_t>(i), params.mean, params.stddev));
  }
}

}  // namespace

void random_fill(const Tensor& out, const RandomFillParams& params) {
  METRALE_EXPECT(out.is_contiguous(), "random_fill needs a contiguous tensor");
  const int64_t n = out.numel();
  if (n == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n, 256), 132 * 16));
  METRALE_DISPATCH_FLOAT(out.dtype(), "random_fill", [&] {
    random_fill_kernel<scalar_t><<<blocks, 256, 0, stream_of(out)>>>(out.data_as<scalar_t>(), n, params);
  });
  METRALE_CHECK_LAUNCH("random_fill_kernel");
}

}  // namespace metrale::kernels::cuda
