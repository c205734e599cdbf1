// Gated RMSNorm on the GPU, rounding like transformers in the activation dtype D:
//   kSilu (the GDN output norm, qwen.md §3.1): n = x * rsqrt(mean(x^2) + eps); t = D(w * D(n)); y = D(t * silu(z));
//   kSigmoid (the KDA output norm, glm_deepseek.md §2.5): y = D(w * n * sigmoid(z)), fp32 until the store.
//   kSigmoidRounded (qwen4_exp's GDN output norm): kSilu's roundings with the sigmoid gate.
// One warp per (token, head) row; each lane takes 4 consecutive elements per step (8-byte bf16 or
// 16-byte f32 loads) when rows allow, else one. The row is read twice (sum of squares, then the
// output); the second read hits L1. out may alias x: every element is read before it is written,
// by the same thread.
#include <cstdint>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/gated_rms_norm.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kRowsPerBlock = 4;

struct GatedNormArgs {
  const void* x;
  const void* z;
  void* out;
  int64_t x_row, x_head, z_row, z_head, out_row, out_head;  // strides in elements
  const void* weight;                                       // [D]
  WeightType weight_type;
  int64_t rows;
  int heads, width;
  float eps;
  bool sigmoid;  // GatedNormGate::kSigmoid: fp32 until the store
  bool sigmoid_rounded;  // GatedNormGate::kSigmoidRounded: kSilu's roundings, sigmoid gate
};

template <typename T, int N>
__global__ void __launch_bounds__(32 * kRowsPerBlock) gated_rms_norm_kernel(GatedNormArgs a) {
  using V = Vec<T, N>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= a.rows) return;  // whole warps leave together
  const int lane = threadIdx.x & 31;
  const int64_t t = row / a.heads, h = row % a.heads;
  const T* x = static_cast<const T*>(a.x) + t * a.x_row + h * a.x_head;
  const T* z = static_cast<const T*>(a.z) + t * a.z_row + h * a.z_head;
  T* out = static_cast<T*>(a.out) + t * a.out_row + h * a.out_head;

  float sum_squares = 0.0f;
  for (int i = lane * N; i < a.width; i += 32 * N) {
    const V xv = *reinterpret_cast<const V*>(x + i);
#pragma unroll
    for (int e = 0; e < N; ++e) sum_squares += to_f32(xv.v[e]) * to_f32(xv.v[e]);
  }
  const float inv_rms = rsqrtf(warp_sum(sum_squares) / static_cast<float>(a.width) + a.eps);
  for (int i = lane * N; i < a.width; i += 32 * N) {
    const V xv = *reinterpret_cast<const V*>(x + i);
    const V zv = *reinterpret_cast<const V*>(z + i);
    V o;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float gate = to_f32(zv.v[e]);
      if (a.sigmoid) {
        const float weighted = load_weight(a.weight, a.weight_type, i + e) * (to_f32(xv.v[e]) * inv_rms);
        o.v[e] = from_f32<T>(weighted * (1.0f / (1.0f + expf(-gate))));
      } else {
        const float normalized = to_f32(from_f32<T>(to_f32(xv.v[e]) * inv_rms));
        const float weighted = to_f32(from_f32<T>(load_weight(a.weight, a.weight_type, i + e) * normalized));
        const float act = a.sigmoid_rounded ? 1.0f / (1.0f + expf(-gate)) : gate / (1.0f + expf(-gate));
        o.v[e] = from_f32<T>(weighted * act);
      }
    }
    *reinterpret_cast<V*>(out + i) = o;
  }
}

bool rows_aligned(const Tensor& t, int64_t bytes) {
  const auto element = static_cast<int64_t>(t.element_size());
  return reinterpret_cast<uintptr_t>(t.data()) % bytes == 0 && (t.stride(0) * element) % bytes == 0 &&
         (t.stride(1) * element) % bytes == 0;
}

}  // namespace

void gated_rms_norm(const Tensor& x, const Tensor& z, const Tensor& weight, const Tensor& out, float eps,
                    GatedNormGate gate) {
  for (const Tensor* t : {&x, &z, &weight, &out}) {
    METRALE_EXPECT(t->device().is_cuda(), "gated_rms_norm: tensors must be on the GPU (" + t->describe() + ")");
  }
  METRALE_EXPECT(x.ndim() == 3 && z.ndim() == 3 && out.ndim() == 3,
                 "gated_rms_norm: x " + x.describe() + " z " + z.describe() + " out " + out.describe());
  const int64_t tokens = x.size(0), heads = x.size(1), width = x.size(2);
  for (const Tensor* t : {&x, &z, &out}) {
    METRALE_EXPECT(t->size(0) == tokens && t->size(1) == heads && t->size(2) == width && t->stride(2) == 1 &&
                       t->dtype() == x.dtype(),
                   "gated_rms_norm: " + t->describe() + " for x " + x.describe());
  }
  METRALE_EXPECT(weight.numel() == width && weight.is_contiguous(), "gated_rms_norm: weight " + weight.describe());
  METRALE_EXPECT(width <= INT32_MAX && heads <= INT32_MAX, "gated_rms_norm: rows too wide");
  GatedNormArgs a{};
  a.x = x.data();
  a.z = z.data();
  a.out = out.data();
  a.x_row = x.stride(0);
  a.x_head = x.stride(1);
  a.z_row = z.stride(0);
  a.z_head = z.stride(1);
  a.out_row = out.stride(0);
  a.out_head = out.stride(1);
  a.weight = weight.data();
  a.weight_type = weight_type_of(weight, "gated_rms_norm");
  a.rows = tokens * heads;
  a.heads = static_cast<int>(heads);
  a.width = static_cast<int>(width);
  a.eps = eps;
  a.sigmoid = gate == GatedNormGate::kSigmoid;
  a.sigmoid_rounded = gate == GatedNormGate::kSigmoidRounded;
  if (a.rows == 0 || width == 0) return;
  const auto grid = static_cast<unsigned>((a.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  const cudaStream_t stream = stream_of(out);
  const int64_t vector_bytes = 4 * static_cast<int64_t>(x.element_size());
  const bool vectorised =
      width % 4 == 0 && rows_aligned(x, vector_bytes) && rows_aligned(z, vector_bytes) && rows_aligned(out, vector_bytes);
  switch (x.dtype()) {
    case DType::kBF16:
      vectorised ? gated_rms_norm_kernel<__nv_bfloat16, 4><<<grid, 32 * kRowsPerBlock, 0, stream>>>(a)
                 : gated_rms_norm_kernel<__nv_bfloat16, 1><<<grid, 32 * kRowsPerBlock, 0, stream>>>(a);
      break;
    case DType::kF32:
      vectorised ? gated_rms_norm_kernel<float, 4><<<grid, 32 * kRowsPerBlock, 0, stream>>>(a)
                 : gated_rms_norm_kernel<float, 1><<<grid, 32 * kRowsPerBlock, 0, stream>>>(a);
      break;
    default:
      raise_message(ErrorCode::kUnsupported,
                    "gated_rms_norm: dtype " + std::string(dtype_name(x.dtype())) + " is not supported on CUDA");
  }
  METRALE_CHECK_LAUNCH("gated_rms_norm");
}

}  // namespace metrale::kernels::cuda
