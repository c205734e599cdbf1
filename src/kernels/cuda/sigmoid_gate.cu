// The gated-attention output gate on the GPU: out = D(x * D(sigmoid(gate))), sigmoid in fp32 with the
// accurate expf and division, as transformers' `attn_output * torch.sigmoid(gate)` in D.
//
// One thread per element; rows of [A, B, D] are addressed through both leading strides, so the gate can
// be the strided gate half of a fused q_proj output.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/sigmoid_gate.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    sigmoid_gate_kernel(const T* __restrict__ x, int64_t x_s0, int64_t x_s1, const T* __restrict__ gate,
                        int64_t g_s0, int64_t g_s1, T* out, int64_t o_s0, int64_t o_s1, int64_t inner,
                        int64_t width, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = i / width, col = i % width;
    const int64_t a = row / inner, b = row % inner;
    const float g = to_f32(gate[a * g_s0 + b * g_s1 + col]);
    const float s = to_f32(from_f32<T>(__fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)))));
    out[a * o_s0 + b * o_s1 + col] = from_f32<T>(__fmul_rn(to_f32(x[a * x_s0 + b * x_s1 + col]), s));
  }
}

template <typename T>
void launch(const Tensor& x, const Tensor& gate, const Tensor& out) {
  const int64_t inner = out.size(1), width = out.size(2), total = out.numel();
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(total, kThreads), 65535));
  sigmoid_gate_kernel<T><<<blocks, kThreads, 0, stream_of(out)>>>(
      x.data_as<const T>(), x.stride(0), x.stride(1), gate.data_as<const T>(), gate.stride(0), gate.stride(1),
      out.data_as<T>(), out.stride(0), out.stride(1), inner, width, total);
  METRALE_CHECK_LAUNCH("sigmoid_gate_kernel");
}

}  // namespace

void sigmoid_gate(const Tensor& x, const Tensor& gate, const Tensor& out) {
  METRALE_EXPECT(x.device().is_cuda() && gate.device().is_cuda() && out.device().is_cuda(),
                 "sigmoid_gate: tensors must be on the GPU");
  METRALE_EXPECT(x.ndim() == 3 && gate.ndim() == 3 && out.ndim() == 3, "sigmoid_gate: 3-D tensors expected");
  for (const Tensor* t : {&x, &gate}) {
    METRALE_EXPECT(t->size(0) == out.size(0) && t->size(1) == out.size(1) && t->size(2) == out.size(2),
                   "sigmoid_gate shapes " + x.describe() + " " + gate.describe() + " " + out.describe());
  }
  METRALE_EXPECT(x.dtype() == out.dtype() && gate.dtype() == out.dtype(), "sigmoid_gate: one dtype expected");
  METRALE_EXPECT(x.stride(2) == 1 && gate.stride(2) == 1 && out.stride(2) == 1,
                 "sigmoid_gate: the last dim must be contiguous");
  if (out.numel() == 0) return;
  switch (out.dtype()) {
    case DType::kBF16:
      launch<__nv_bfloat16>(x, gate, out);
      break;
    case DType::kF32:
      launch<float>(x, gate, out);
      break;
    default:
      raise_message(ErrorCode::kUnsupported,
                    "sigmoid_gate: dtype " + std::string(dtype_name(out.dtype())) + " is not supported on CUDA");
  }
}

}  // namespace metrale::kernels::cuda
