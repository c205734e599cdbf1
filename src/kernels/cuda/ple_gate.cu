// Fused PLE gating on the GPU (semantics and rounding in kernels/ple_gate.h; the CPU twin is the
// reference). One CTA per (token, stream) of H channels, four passes over the stream's channels
// (the re-reads hit L1/L2: a stream is a few KB):
//   1. sums of squares of key_n and R_n           -> the two norms' scales
//   2. sum of D(k_n * q_n)                         -> s_n, s^_n, sigmoid (every thread computes the scalar)
//   3. G_n = D(sigmoid * value), stored, and its sum of squares
//   4. G^_n = D(zc(G_n)) from the stored G_n (each thread re-reads only what it wrote)
// Per token it reads key and R (N*H each) twice, value N times (H each) and writes G and G^: about
// 85 KB for H 2560, N 4; at decode batch sizes it is a few microseconds of latency.
#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/ple_gate.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kThreads = 256;

struct GateArgs {
  const void* key;
  int64_t key_row;
  const void* value;
  int64_t value_row;
  const void* residual;
  int64_t residual_row;
  const void* w_key;
  const void* w_query;
  const void* w_conv;
  WeightType w_key_type, w_query_type, w_conv_type;
  void* gated;
  int64_t gated_row;
  void* gated_normed;
  int64_t gated_normed_row;
  int hidden;
  float eps;
  float sqrt_hidden;
};

template <typename T>
__device__ __forceinline__ float round_to(float value) {
  return to_f32(from_f32<T>(value));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) ple_gate_kernel(GateArgs a) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x;
  const int n = blockIdx.y;
  const int64_t c0 = static_cast<int64_t>(n) * a.hidden;
  const T* key = static_cast<const T*>(a.key) + t * a.key_row + c0;
  const T* r = static_cast<const T*>(a.residual) + t * a.residual_row + c0;
  const T* value = static_cast<const T*>(a.value) + t * a.value_row;
  T* gated = static_cast<T*>(a.gated) + t * a.gated_row + c0;
  T* gated_normed = static_cast<T*>(a.gated_normed) + t * a.gated_normed_row + c0;

  float key_squares = 0.0f, r_squares = 0.0f;
  for (int c = threadIdx.x; c < a.hidden; c += kThreads) {
    const float k = to_f32(key[c]), q = to_f32(r[c]);
    key_squares += k * k;
    r_squares += q * q;
  }
  const float inv_h = 1.0f / static_cast<float>(a.hidden);
  const float inv_k = rsqrtf(block_sum(key_squares, scratch) * inv_h + a.eps);
  const float inv_q = rsqrtf(block_sum(r_squares, scratch) * inv_h + a.eps);

  float dot = 0.0f;
  for (int c = threadIdx.x; c < a.hidden; c += kThreads) {
    const float k = round_to<T>(to_f32(key[c]) * inv_k * (1.0f + load_weight(a.w_key, a.w_key_type, c0 + c)));
    const float q = round_to<T>(to_f32(r[c]) * inv_q * (1.0f + load_weight(a.w_query, a.w_query_type, c0 + c)));
    dot += round_to<T>(k * q);
  }
  const float s = round_to<T>(round_to<T>(block_sum(dot, scratch)) / a.sqrt_hidden);
  const float magnitude = round_to<T>(sqrtf(round_to<T>(fmaxf(fabsf(s), 1e-6f))));
  const float s_hat = s > 0.0f ? magnitude : (s < 0.0f ? -magnitude : 0.0f);
  const float sigma = round_to<T>(1.0f / (1.0f + expf(-s_hat)));

  float g_squares = 0.0f;
  for (int c = threadIdx.x; c < a.hidden; c += kThreads) {
    const T g = from_f32<T>(sigma * to_f32(value[c]));
    gated[c] = g;
    const float gf = to_f32(g);
    g_squares += gf * gf;
  }
  const float inv_g = rsqrtf(block_sum(g_squares, scratch) * inv_h + a.eps);
  for (int c = threadIdx.x; c < a.hidden; c += kThreads) {
    gated_normed[c] =
        from_f32<T>(to_f32(gated[c]) * inv_g * (1.0f + load_weight(a.w_conv, a.w_conv_type, c0 + c)));
  }
}

void expect_rows(const Tensor& t, int64_t rows, int64_t width, DType dtype, const char* what) {
  METRALE_EXPECT(t.device().is_cuda() && t.ndim() == 2 && t.size(0) == rows && t.size(1) == width &&
                     t.stride(1) == 1 && t.dtype() == dtype,
                 std::string("ple_gate ") + what + ": " + t.describe() + " must be [" + std::to_string(rows) + ", " +
                     std::to_string(width) + "] " + std::string(dtype_name(dtype)) + " on the GPU");
}

}  // namespace

void ple_gate(const Tensor& key, const Tensor& value, const Tensor& residual, const Tensor& key_norm_weight,
              const Tensor& query_norm_weight, const Tensor& conv_norm_weight, const Tensor& gated,
              const Tensor& gated_normed, const PleGateParams& params) {
  const int64_t streams = params.num_streams;
  METRALE_EXPECT(streams >= 1 && value.ndim() == 2, "ple_gate: value " + value.describe());
  const int64_t tokens = value.size(0), hidden = value.size(1), width = streams * hidden;
  const DType act = gated.dtype();
  expect_rows(key, tokens, width, act, "key");
  expect_rows(value, tokens, hidden, act, "value");
  expect_rows(residual, tokens, width, act, "residual");
  expect_rows(gated, tokens, width, act, "gated");
  expect_rows(gated_normed, tokens, width, act, "gated_normed");
  for (const Tensor* w : {&key_norm_weight, &query_norm_weight, &conv_norm_weight}) {
    METRALE_EXPECT(w->device().is_cuda() && w->numel() == width && w->is_contiguous(),
                   "ple_gate: norm weight " + w->describe());
  }
  METRALE_EXPECT(hidden <= INT32_MAX && streams <= 65535, "ple_gate: too large");
  if (tokens == 0) return;
  GateArgs a{};
  a.key = key.data();
  a.key_row = key.stride(0);
  a.value = value.data();
  a.value_row = value.stride(0);
  a.residual = residual.data();
  a.residual_row = residual.stride(0);
  a.w_key = key_norm_weight.data();
  a.w_query = query_norm_weight.data();
  a.w_conv = conv_norm_weight.data();
  a.w_key_type = weight_type_of(key_norm_weight, "ple_gate");
  a.w_query_type = weight_type_of(query_norm_weight, "ple_gate");
  a.w_conv_type = weight_type_of(conv_norm_weight, "ple_gate");
  a.gated = gated.data();
  a.gated_row = gated.stride(0);
  a.gated_normed = gated_normed.data();
  a.gated_normed_row = gated_normed.stride(0);
  a.hidden = static_cast<int>(hidden);
  a.eps = params.eps;
  a.sqrt_hidden = static_cast<float>(std::sqrt(static_cast<double>(hidden)));
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(streams));
  const cudaStream_t stream = stream_of(gated);
  switch (act) {
    case DType::kBF16: ple_gate_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a); break;
    case DType::kF32: ple_gate_kernel<float><<<grid, kThreads, 0, stream>>>(a); break;
    default:
      raise_message(ErrorCode::kUnsupported, "ple_gate (cuda): activation dtype " + std::string(dtype_name(act)));
  }
  METRALE_CHECK_LAUNCH("ple_gate");
}

}  // namespace metrale::kernels::cuda
