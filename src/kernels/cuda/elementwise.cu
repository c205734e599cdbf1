// Small elementwise ops on the GPU: dst = D(dst + src) and dtype conversion, over contiguous tensors,
// in 16-byte vectors of the wider dtype when both pointers allow it.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/elementwise.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 132 * 16;

// mode kAdd: dst[i] = D(dst[i] + src[i]); mode kConvert: dst[i] = D(src[i]).
enum class Mode { kAdd, kConvert };

template <Mode kMode, typename TDst, typename TSrc, int N>
__global__ void __launch_bounds__(kThreads) elementwise_kernel(TDst* __restrict__ dst, const TSrc* __restrict__ src,
                                                               int64_t vectors) {
  using VD = Vec<TDst, N>;
  using VS = Vec<TSrc, N>;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; j < vectors;
       j += static_cast<int64_t>(gridDim.x) * kThreads) {
    const VS s = reinterpret_cast<const VS*>(src)[j];
    VD d;
    if constexpr (kMode == Mode::kAdd) d = reinterpret_cast<const VD*>(dst)[j];
#pragma unroll
    for (int e = 0; e < N; ++e) {
      d.v[e] = kMode == Mode::kAdd ? from_f32<TDst>(to_f32(d.v[e]) + to_f32(s.v[e])) : from_f32<TDst>(to_f32(s.v[e]));
    }
    reinterpret_cast<VD*>(dst)[j] = d;
  }
}

template <Mode kMode>
void run(const Tensor& dst, const Tensor& src, const char* what) {
  METRALE_EXPECT(dst.device().is_cuda() && src.device().is_cuda(), std::string(what) + ": tensors must be on the GPU");
  METRALE_EXPECT(dst.numel() == src.numel() && dst.is_contiguous() && src.is_contiguous(),
                 std::string(what) + ": " + dst.describe() + " " + src.describe());
  const int64_t n = dst.numel();
  if (n == 0) return;
  // Vector width: 16 bytes of the wider dtype.
  const int64_t wider = static_cast<int64_t>(std::max(dst.element_size(), src.element_size()));
  const int64_t vector_elements = 16 / wider;
  const bool vectorised = n % vector_elements == 0 &&
                          reinterpret_cast<uintptr_t>(dst.data()) % (vector_elements * dst.element_size()) == 0 &&
                          reinterpret_cast<uintptr_t>(src.data()) % (vector_elements * src.element_size()) == 0;
  const cudaStream_t stream = stream_of(dst);
  METRALE_DISPATCH_FLOAT(dst.dtype(), what, [&] {
    using dst_t = scalar_t;
    METRALE_DISPATCH_FLOAT(src.dtype(), what, [&] {
      using src_t = scalar_t;
      constexpr int kVector = 16 / static_cast<int>(sizeof(dst_t) > sizeof(src_t) ? sizeof(dst_t) : sizeof(src_t));
      if (vectorised) {
        const int64_t vectors = n / kVector;
        const auto blocks = static_cast<unsigned int>(std::min<int64_t>(ceil_div(vectors, kThreads), kMaxBlocks));
        elementwise_kernel<kMode, dst_t, src_t, kVector>
            <<<blocks, kThreads, 0, stream>>>(dst.data_as<dst_t>(), src.data_as<const src_t>(), vectors);
      } else {
        const auto blocks = static_cast<unsigned int>(std::min<int64_t>(ceil_div(n, kThreads), kMaxBlocks));
        elementwise_kernel<kMode, dst_t, src_t, 1>
            <<<blocks, kThreads, 0, stream>>>(dst.data_as<dst_t>(), src.data_as<const src_t>(), n);
      }
    });
  });
  METRALE_CHECK_LAUNCH(what);
}

}  // namespace

void add_inplace(const Tensor& dst, const Tensor& src) { run<Mode::kAdd>(dst, src, "add_inplace"); }

void convert(const Tensor& src, const Tensor& dst) { run<Mode::kConvert>(dst, src, "convert"); }

}  // namespace metrale::kernels::cuda
