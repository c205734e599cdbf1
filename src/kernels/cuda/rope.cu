// Rotary position embedding on the GPU, rounding like transformers in the activation dtype D
// (qwen.md §3.2): per token, f_i = p * inv_freq_i and cos, sin = D(cos(f_i) * s), D(sin(f_i) * s) in
// fp32; then for the first rotary_dim channels of every head (a = x[i], b = x[i + half]):
//   x'[i]        = D(D(a * cos_i) - D(b * sin_i))     (x * cos + rotate_half(x) * sin, rotate_half = [-b; a])
//   x'[i + half] = D(D(b * cos_i) + D(a * sin_i))
// Every product and sum is an explicitly rounded fp32 operation (no FMA), so with f32 activations the
// result is transformers' fp32 result too. sincosf is the accurate one: positions reach 100k+.
//
// One CTA per token: the CTA computes the token's cos/sin once into shared memory, then its threads
// rotate all heads, 16 bytes of each half at a time when aligned.
#include "kernels/cuda/common.cuh"
#include "kernels/rope.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kThreads = 128;

template <typename T>
__device__ __forceinline__ float round_to(float value) {
  return to_f32(from_f32<T>(value));
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) rope_kernel(T* __restrict__ x, int64_t token_stride, int64_t head_stride,
                                                        int heads, const int32_t* __restrict__ positions,
                                                        const float* __restrict__ inv_freq, int half,
                                                        float attention_scaling) {
  extern __shared__ float table[];  // cos [half], then sin [half], already rounded to D
  float* cos_table = table;
  float* sin_table = table + half;
  const int64_t t = blockIdx.x;
  const float position = static_cast<float>(positions[t]);
  for (int i = threadIdx.x; i < half; i += kThreads) {
    float sine, cosine;
    sincosf(__fmul_rn(position, inv_freq[i]), &sine, &cosine);
    cos_table[i] = round_to<T>(__fmul_rn(cosine, attention_scaling));
    sin_table[i] = round_to<T>(__fmul_rn(sine, attention_scaling));
  }
  __syncthreads();
  using V = Vec<T, N>;
  const int vectors_per_head = half / N;
  T* token = x + t * token_stride;
  for (int item = threadIdx.x; item < heads * vectors_per_head; item += kThreads) {
    const int head = item / vectors_per_head;
    const int i0 = (item - head * vectors_per_head) * N;
    T* first = token + head * head_stride + i0;
    T* second = first + half;
    V a = *reinterpret_cast<const V*>(first);
    V b = *reinterpret_cast<const V*>(second);
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float av = to_f32(a.v[e]), bv = to_f32(b.v[e]);
      const float c = cos_table[i0 + e], s = sin_table[i0 + e];
      a.v[e] = from_f32<T>(__fsub_rn(round_to<T>(__fmul_rn(av, c)), round_to<T>(__fmul_rn(bv, s))));
      b.v[e] = from_f32<T>(__fadd_rn(round_to<T>(__fmul_rn(bv, c)), round_to<T>(__fmul_rn(av, s))));
    }
    *reinterpret_cast<V*>(first) = a;
    *reinterpret_cast<V*>(second) = b;
  }
}

template <typename T, int N>
void launch(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, int half, float scaling) {
  const auto tokens = static_cast<unsigned int>(x.size(0));
  const size_t shared_bytes = 2 * static_cast<size_t>(half) * sizeof(float);
  rope_kernel<T, N><<<tokens, kThreads, shared_bytes, stream_of(x)>>>(
      x.data_as<T>(), x.stride(0), x.stride(1), static_cast<int>(x.size(1)), positions.data_as<const int32_t>(),
      inv_freq.data_as<const float>(), half, scaling);
  METRALE_CHECK_LAUNCH("rope_kernel");
}

}  // namespace

void rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, const RopeParams& params) {
  METRALE_EXPECT(x.device().is_cuda() && positions.device().is_cuda() && inv_freq.device().is_cuda(),
                 "rope: tensors must be on the GPU");
  METRALE_EXPECT(x.ndim() == 3 && (x.stride(2) == 1 || x.size(2) == 1), "rope x " + x.describe());
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  const int half = params.rotary_dim / 2;
  METRALE_EXPECT(params.rotary_dim % 2 == 0 && params.rotary_dim >= 0 && params.rotary_dim <= head_dim,
                 "rope: rotary_dim must be even and <= head_dim");
  METRALE_EXPECT(inv_freq.dtype() == DType::kF32 && inv_freq.numel() == half, "rope inv_freq " + inv_freq.describe());
  METRALE_EXPECT(positions.dtype() == DType::kI32 && positions.numel() == tokens &&
                     (tokens <= 1 || positions.stride(0) == 1),
                 "rope positions " + positions.describe());
  if (tokens == 0 || heads == 0 || half == 0) return;
  METRALE_EXPECT(tokens <= INT32_MAX && heads * half <= INT32_MAX && half <= 4096, "rope: too large");
  const int64_t element_size = static_cast<int64_t>(x.element_size());
  const int64_t vector_elements = 16 / element_size;
  const bool vectorised = half % vector_elements == 0 && reinterpret_cast<uintptr_t>(x.data()) % 16 == 0 &&
                          (x.stride(0) * element_size) % 16 == 0 && (x.stride(1) * element_size) % 16 == 0;
  switch (x.dtype()) {
    case DType::kBF16:
      vectorised ? launch<__nv_bfloat16, 8>(x, positions, inv_freq, half, params.attention_scaling)
                 : launch<__nv_bfloat16, 1>(x, positions, inv_freq, half, params.attention_scaling);
      break;
    case DType::kF32:
      vectorised ? launch<float, 4>(x, positions, inv_freq, half, params.attention_scaling)
                 : launch<float, 1>(x, positions, inv_freq, half, params.attention_scaling);
      break;
    default:
      raise_message(ErrorCode::kUnsupported,
                    "rope: dtype " + std::string(dtype_name(x.dtype())) + " is not supported on CUDA");
  }
}

}  // namespace metrale::kernels::cuda
