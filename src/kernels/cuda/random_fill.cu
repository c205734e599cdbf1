#include <cuda_fp8.h>

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

// e4m3 codes, saturated to the largest finite value (as the CPU's f32_to_f8e4m3_bits).
__global__ void random_fill_e4m3_kernel(uint8_t* __restrict__ out, int64_t n, RandomFillParams params) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float value = random_normal_at(params.seed, static_cast<uint64_t>(i), params.mean, params.stddev);
    out[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3));
  }
}

}  // namespace

void random_fill(const Tensor& out, const RandomFillParams& params) {
  METRALE_EXPECT(out.is_contiguous(), "random_fill needs a contiguous tensor");
  const int64_t n = out.numel();
  if (n == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n, 256), 132 * 16));
  if (out.dtype() == DType::kF8E4M3) {
    random_fill_e4m3_kernel<<<blocks, 256, 0, stream_of(out)>>>(static_cast<uint8_t*>(out.data()), n, params);
    METRALE_CHECK_LAUNCH("random_fill_e4m3_kernel");
    return;
  }
  METRALE_DISPATCH_FLOAT(out.dtype(), "random_fill", [&] {
    random_fill_kernel<scalar_t><<<blocks, 256, 0, stream_of(out)>>>(out.data_as<scalar_t>(), n, params);
  });
  METRALE_CHECK_LAUNCH("random_fill_kernel");
}

}  // namespace metrale::kernels::cuda
