// SwiGLU activation on the GPU: out = D(D(silu(gate)) * up), silu(g) = g / (1 + exp(-g)) in fp32 and
// rounded to the activation dtype D before the product, as transformers computes
// `act_fn(gate_proj(x)) * up_proj(x)` in D (qwen.md §3.3). expf and the division are the accurate ones.
//
// Grid: x over 16-byte vectors of a row, y over rows (grid-stride beyond 65535 rows).
#include <algorithm>

#include "kernels/activation.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/pdl.cuh"

namespace metrale::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridRows = 65535;

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) silu_mul_kernel(const T* gate, int64_t gate_stride, const T* up,
                                                            int64_t up_stride, T* out, int64_t out_stride,
                                                            int64_t rows, int vectors, float limit) {
  pdl::wait_then_allow_dependents();  // launched through pdl::launch; the down GEMV stages meanwhile
  using V = Vec<T, N>;
  const int j = blockIdx.x * kThreads + threadIdx.x;
  if (j >= vectors) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const V g = *reinterpret_cast<const V*>(gate + r * gate_stride + static_cast<int64_t>(j) * N);
    const V u = *reinterpret_cast<const V*>(up + r * up_stride + static_cast<int64_t>(j) * N);
    V o;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      float gv = to_f32(g.v[e]), uv = to_f32(u.v[e]);
      if (limit > 0.0f) {  // clamped SwiGLU, as torch's clamp of a T tensor: bounds rounded to T
        const float bound = to_f32(from_f32<T>(limit));
        gv = fminf(gv, bound);
        uv = fminf(fmaxf(uv, -bound), bound);
      }
      const float silu = to_f32(from_f32<T>(__fdiv_rn(gv, __fadd_rn(1.0f, expf(-gv)))));
      o.v[e] = from_f32<T>(__fmul_rn(silu, uv));
    }
    *reinterpret_cast<V*>(out + r * out_stride + static_cast<int64_t>(j) * N) = o;
  }
}

template <typename T, int N>
void launch(const Tensor& gate, const Tensor& up, const Tensor& out, float limit) {
  const int64_t rows = out.size(0);
  const int vectors = static_cast<int>(out.size(1) / N);
  const dim3 grid(static_cast<unsigned int>(ceil_div(vectors, kThreads)),
                  static_cast<unsigned int>(std::min<int64_t>(rows, kMaxGridRows)));
  // Inputs without __restrict__: a kernel launched through pdl::launch must not read its producer's
  // output through the non-coherent path (pdl.cuh).
  pdl::launch(silu_mul_kernel<T, N>, grid, dim3(kThreads), 0, stream_of(out), gate.data_as<const T>(), gate.stride(0),
              up.data_as<const T>(), up.stride(0), out.data_as<T>(), out.stride(0), rows, vectors, limit);
  METRALE_CHECK_LAUNCH("silu_mul_kernel");
}

bool rows_aligned(const Tensor& t) {
  const int64_t element_size = static_cast<int64_t>(t.element_size());
  return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0 && (t.stride(0) * element_size) % 16 == 0;
}

}  // namespace

void silu_mul(const Tensor& gate, const Tensor& up, const Tensor& out, float limit) {
  METRALE_EXPECT(gate.device().is_cuda() && up.device().is_cuda() && out.device().is_cuda(),
                 "silu_mul: tensors must be on the GPU");
  METRALE_EXPECT(gate.ndim() == 2 && up.ndim() == 2 && out.ndim() == 2, "silu_mul: 2-D tensors expected");
  const int64_t rows = out.size(0), width = out.size(1);
  METRALE_EXPECT(gate.size(0) == rows && gate.size(1) == width && up.size(0) == rows && up.size(1) == width,
                 "silu_mul shapes " + gate.describe() + " " + up.describe() + " " + out.describe());
  METRALE_EXPECT(gate.dtype() == out.dtype() && up.dtype() == out.dtype(), "silu_mul: one dtype expected");
  METRALE_EXPECT((gate.stride(1) == 1 || width == 1) && (up.stride(1) == 1 || width == 1) &&
                     (out.stride(1) == 1 || width == 1),
                 "silu_mul: rows must be contiguous");
  if (rows == 0 || width == 0) return;
  METRALE_EXPECT(width <= INT32_MAX, "silu_mul: rows too wide");
  const int64_t vector_elements = 16 / static_cast<int64_t>(out.element_size());
  const bool vectorised = width % vector_elements == 0 && rows_aligned(gate) && rows_aligned(up) && rows_aligned(out);
  switch (out.dtype()) {
    case DType::kBF16:
      vectorised ? launch<__nv_bfloat16, 8>(gate, up, out, limit) : launch<__nv_bfloat16, 1>(gate, up, out, limit);
      break;
    case DType::kF32:
      vectorised ? launch<float, 4>(gate, up, out, limit) : launch<float, 1>(gate, up, out, limit);
      break;
    default:
      raise_message(ErrorCode::kUnsupported,
                    "silu_mul: dtype " + std::string(dtype_name(out.dtype())) + " is not supported on CUDA");
  }
}

}  // namespace metrale::kernels::cuda
