// Hyper-connection pieces on the GPU (semantics and rounding in kernels/hyper_connection.h; the CPU
// twin is the reference). All three are memory-bound elementwise passes over a decode-sized batch:
//  * hc_norm: one CTA per (token, stream) of H channels; the update is applied and stored, its sum
//    of squares reduced over the CTA, then the stream is normalised from the stored (rounded) values
//    (re-read by the thread that wrote them, so no barrier is needed for them).
//  * hc_gates: one thread per element of act and beta.
//  * hc_mix: one thread per vector of output channels, summing the N streams in fp32.
//  * hc_gates_up_mix: at decode-sized T one kernel for the gates, the W_up GEMM and the mix
//    (hc_up_mix_kernel); otherwise the three ops.
// 16-byte vectors where every row start and width allow, else element by element.
#include <cstdint>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemm_gemv.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/hyper_connection.h"
#include "kernels/linear.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kNormThreads = 256;
constexpr int kThreads = 256;

template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* p, float (&dst)[N]) {
  const Vec<T, N> raw = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int e = 0; e < N; ++e) dst[e] = to_f32(raw.v[e]);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const float (&src)[N]) {
  Vec<T, N> raw;
#pragma unroll
  for (int e = 0; e < N; ++e) raw.v[e] = from_f32<T>(src[e]);
  *reinterpret_cast<Vec<T, N>*>(p) = raw;
}

template <typename T>
__device__ __forceinline__ float round_to(float value) {
  return to_f32(from_f32<T>(value));
}

__device__ __forceinline__ float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

struct NormArgs {
  void* residual;  // [T, N*H], row stride residual_row
  int64_t residual_row;
  const void* a;  // update operand, row stride a_row
  int64_t a_row;
  const void* b;  // [T, N] injection weights, row stride b_row
  int64_t b_row;
  WeightType b_type;
  const void* weight;  // [N*H]
  WeightType weight_type;
  void* normed;  // [T, N*H] or null
  int64_t normed_row;
  int hidden;
  int streams;
  float eps;
  HcUpdate update;
};

template <typename T, int V>
__global__ void __launch_bounds__(kNormThreads) hc_norm_kernel(NormArgs a) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x;
  const int n = blockIdx.y;
  T* r = static_cast<T*>(a.residual) + t * a.residual_row + static_cast<int64_t>(n) * a.hidden;
  const T* src = static_cast<const T*>(a.a) + t * a.a_row;
  float beta = 0.0f;
  if (a.update == HcUpdate::kInject) beta = load_weight(a.b, a.b_type, t * a.b_row + n);
  float sum_squares = 0.0f;
  for (int c = threadIdx.x * V; c < a.hidden; c += kNormThreads * V) {
    float x[V];
    switch (a.update) {
      case HcUpdate::kNone:
        load_vec<T, V>(r + c, x);
        break;
      case HcUpdate::kAdd: {
        float add[V];
        load_vec<T, V>(r + c, x);
        load_vec<T, V>(src + static_cast<int64_t>(n) * a.hidden + c, add);
#pragma unroll
        for (int e = 0; e < V; ++e) x[e] = round_to<T>(x[e] + add[e]);
        break;
      }
      case HcUpdate::kInject: {
        float u[V];
        load_vec<T, V>(r + c, x);
        load_vec<T, V>(src + c, u);
#pragma unroll
        for (int e = 0; e < V; ++e) x[e] = round_to<T>(x[e] + round_to<T>(beta * u[e]));
        break;
      }
      case HcUpdate::kBroadcast:
        load_vec<T, V>(src + c, x);
        break;
    }
    if (a.update != HcUpdate::kNone) store_vec<T, V>(r + c, x);
#pragma unroll
    for (int e = 0; e < V; ++e) sum_squares += x[e] * x[e];
  }
  if (a.normed == nullptr) return;
  const float total = block_sum(sum_squares, scratch);
  const float inv = rsqrtf(total / static_cast<float>(a.hidden) + a.eps);
  T* out = static_cast<T*>(a.normed) + t * a.normed_row + static_cast<int64_t>(n) * a.hidden;
  const int64_t w0 = static_cast<int64_t>(n) * a.hidden;
  for (int c = threadIdx.x * V; c < a.hidden; c += kNormThreads * V) {
    float x[V];
    load_vec<T, V>(r + c, x);  // this thread's own stores (or the unchanged input)
#pragma unroll
    for (int e = 0; e < V; ++e) x[e] = x[e] * inv * (1.0f + load_weight(a.weight, a.weight_type, w0 + c + e));
    store_vec<T, V>(out + c, x);
  }
}

struct GateArgs {
  const void* down;
  int64_t down_row;
  const void* inject;
  int64_t inject_row;
  void* act;
  int64_t act_row;
  void* beta;
  int64_t beta_row;
  int64_t tokens;
  int rank;
  int streams;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) hc_gates_kernel(GateArgs a) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int per_token = a.rank + (a.beta != nullptr ? a.streams : 0);
  if (index >= a.tokens * per_token) return;
  const int64_t t = index / per_token;
  const int i = static_cast<int>(index % per_token);
  const float n = static_cast<float>(a.streams);
  if (i < a.rank) {
    const float scaled = round_to<T>(to_f32(static_cast<const T*>(a.down)[t * a.down_row + i]) / n);
    static_cast<T*>(a.act)[t * a.act_row + i] = from_f32<T>(scaled * sigmoid(scaled));
  } else {
    const int j = i - a.rank;
    const float scaled = round_to<T>(to_f32(static_cast<const T*>(a.inject)[t * a.inject_row + j]) / n);
    static_cast<T*>(a.beta)[t * a.beta_row + j] = from_f32<T>(2.0f * round_to<T>(sigmoid(scaled)));
  }
}

struct MixArgs {
  const void* up;
  int64_t up_row;
  const void* normed;
  int64_t normed_row;
  void* x;
  int64_t x_row;
  int64_t tokens;
  int hidden;
  int streams;
};

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) hc_mix_kernel(MixArgs a) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int vectors = a.hidden / V;
  if (index >= a.tokens * vectors) return;
  const int64_t t = index / vectors;
  const int c = static_cast<int>(index % vectors) * V;
  float sum[V];
#pragma unroll
  for (int e = 0; e < V; ++e) sum[e] = 0.0f;
  for (int n = 0; n < a.streams; ++n) {
    float m[V], r[V];
    load_vec<T, V>(static_cast<const T*>(a.up) + t * a.up_row + static_cast<int64_t>(n) * a.hidden + c, m);
    load_vec<T, V>(static_cast<const T*>(a.normed) + t * a.normed_row + static_cast<int64_t>(n) * a.hidden + c, r);
#pragma unroll
    for (int e = 0; e < V; ++e) sum[e] += round_to<T>(round_to<T>(sigmoid(m[e])) * r[e]);
  }
#pragma unroll
  for (int e = 0; e < V; ++e) sum[e] /= static_cast<float>(a.streams);
  store_vec<T, V>(static_cast<T*>(a.x) + t * a.x_row + c, sum);
}

// hc_gates_up_mix in one kernel (decode-sized T). grid (ceil(H / kUpMixWarps), T): every block stages
// its token's act = hc_gates(down) in shared memory (block 0 also writes beta), then warp w takes
// output channel c = blockIdx.x * kUpMixWarps + w, dots the N rows n*H + c of W_up with act and
// mixes them as hc_mix does. Launched through pdl::launch: it waits for the down GEMM first.
constexpr int kUpMixWarps = 8;
constexpr int kUpMixMaxRank = 512;
constexpr int kUpMixMaxStreams = 4;
constexpr int kUpMixMaxTokens = 4;

struct UpMixArgs {
  const __nv_bfloat16* down;  // [T, r] rows strided
  int64_t down_row;
  const __nv_bfloat16* inject;  // [T, N] or null
  int64_t inject_row;
  __nv_bfloat16* beta;  // [T, N] or null
  int64_t beta_row;
  const __nv_bfloat16* w_up;    // [N*H, r] contiguous
  const __nv_bfloat16* normed;  // [T, N*H]
  int64_t normed_row;
  __nv_bfloat16* x;  // [T, H]
  int64_t x_row;
  int rank, hidden, streams;
};

__global__ void __launch_bounds__(kUpMixWarps * 32) hc_up_mix_kernel(UpMixArgs a) {
  using T = __nv_bfloat16;
  __shared__ __align__(16) float act_s[kUpMixMaxRank];
  const int64_t t = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float n = static_cast<float>(a.streams);
  pdl::wait_for_producer();
  for (int i = threadIdx.x; i < a.rank; i += blockDim.x) {
    const float scaled = round_to<T>(to_f32(a.down[t * a.down_row + i]) / n);
    act_s[i] = round_to<T>(scaled * sigmoid(scaled));  // hc_gates' act, as the GEMM would read it
  }
  if (a.beta != nullptr && blockIdx.x == 0 && threadIdx.x < a.streams) {
    const int j = threadIdx.x;
    const float scaled = round_to<T>(to_f32(a.inject[t * a.inject_row + j]) / n);
    a.beta[t * a.beta_row + j] = from_f32<T>(2.0f * round_to<T>(sigmoid(scaled)));
  }
  __syncthreads();
  pdl::allow_dependents();
  const int c = min(static_cast<int>(blockIdx.x) * kUpMixWarps + warp, a.hidden - 1);
  const T* rows[kUpMixMaxStreams];
#pragma unroll
  for (int r = 0; r < kUpMixMaxStreams; ++r) {
    rows[r] = a.w_up + (static_cast<int64_t>(min(r, a.streams - 1)) * a.hidden + c) * a.rank;
  }
  const float* inputs[1] = {act_s};
  float acc[kUpMixMaxStreams][1] = {};
  gemv::warp_dot_partial<kUpMixMaxStreams, 1, 2>(rows, inputs, 1, a.rank / gemv::kChunk, lane, acc);
  float mixed = 0.0f;
#pragma unroll
  for (int r = 0; r < kUpMixMaxStreams; ++r) {
    const float m = round_to<T>(warp_sum(acc[r][0]));  // up, stored in D by the GEMM
    if (r < a.streams) {
      mixed += round_to<T>(round_to<T>(sigmoid(m)) *
                           to_f32(a.normed[t * a.normed_row + static_cast<int64_t>(r) * a.hidden + c]));
    }
  }
  if (lane == 0 && static_cast<int>(blockIdx.x) * kUpMixWarps + warp < a.hidden) {
    a.x[t * a.x_row + c] = from_f32<T>(mixed / n);
  }
}

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Whether 16-byte vectors of `dtype` fit every row of a [rows, width] view with row stride `row`
// (elements), starting at `data`.
bool rows_vectorisable(const void* data, int64_t row, int64_t width, DType dtype) {
  const int64_t vector = 16 / static_cast<int64_t>(dtype_size(dtype));
  return data == nullptr || (aligned16(data) && width % vector == 0 && row % vector == 0);
}

void expect_rows(const Tensor& t, int64_t rows, int64_t width, DType dtype, const char* what) {
  METRALE_EXPECT(t.device().is_cuda() && t.ndim() == 2 && t.size(0) == rows && t.size(1) == width &&
                     (width <= 1 || t.stride(1) == 1) && t.dtype() == dtype,
                 std::string(what) + ": " + t.describe() + " must be [" + std::to_string(rows) + ", " +
                     std::to_string(width) + "] " + std::string(dtype_name(dtype)) + " on the GPU");
}

template <typename Body>
void dispatch_activation(DType dtype, const char* op, const Body& body) {
  switch (dtype) {
    case DType::kBF16:
      body(__nv_bfloat16{});
      break;
    case DType::kF32:
      body(float{});
      break;
    default:
      raise_message(ErrorCode::kUnsupported,
                    std::string(op) + " (cuda): activation dtype " + std::string(dtype_name(dtype)));
  }
}

}  // namespace

void hc_norm(const Tensor& residual, const Tensor& update_a, const Tensor& update_b, const Tensor& weight,
             const Tensor& normed, const HcParams& params) {
  const int64_t streams = params.num_streams;
  METRALE_EXPECT(streams >= 1 && residual.ndim() == 2 && residual.size(1) % streams == 0,
                 "hc_norm: residual " + residual.describe());
  const int64_t tokens = residual.size(0), width = residual.size(1), hidden = width / streams;
  const DType act = residual.dtype();
  expect_rows(residual, tokens, width, act, "hc_norm residual");
  const bool norm = !normed.empty();
  if (norm) {
    expect_rows(normed, tokens, width, act, "hc_norm normed");
    METRALE_EXPECT(weight.numel() == width && weight.is_contiguous() && weight.device().is_cuda(),
                   "hc_norm: weight " + weight.describe());
  }
  NormArgs a{};
  switch (params.update) {
    case HcUpdate::kNone:
      break;
    case HcUpdate::kAdd:
      expect_rows(update_a, tokens, width, act, "hc_norm add");
      break;
    case HcUpdate::kInject:
      expect_rows(update_a, tokens, hidden, act, "hc_norm block output");
      METRALE_EXPECT(update_b.device().is_cuda() && update_b.ndim() == 2 && update_b.size(0) == tokens &&
                         update_b.size(1) == streams && (streams == 1 || update_b.stride(1) == 1),
                     "hc_norm: injection weights " + update_b.describe());
      a.b = update_b.data();
      a.b_row = update_b.stride(0);
      a.b_type = weight_type_of(update_b, "hc_norm");
      break;
    case HcUpdate::kBroadcast:
      expect_rows(update_a, tokens, hidden, act, "hc_norm embedding");
      break;
  }
  METRALE_EXPECT(hidden <= INT32_MAX && streams <= 65535, "hc_norm: too large");
  if (tokens == 0 || (!norm && params.update == HcUpdate::kNone)) return;
  a.residual = residual.data();
  a.residual_row = residual.stride(0);
  if (params.update != HcUpdate::kNone) {
    a.a = update_a.data();
    a.a_row = update_a.stride(0);
  }
  if (norm) {
    a.weight = weight.data();
    a.weight_type = weight_type_of(weight, "hc_norm");
    a.normed = normed.data();
    a.normed_row = normed.stride(0);
  }
  a.hidden = static_cast<int>(hidden);
  a.streams = static_cast<int>(streams);
  a.eps = params.eps;
  a.update = params.update;
  const bool vectorised = rows_vectorisable(a.residual, a.residual_row, hidden, act) &&
                          rows_vectorisable(a.a, a.a_row, hidden, act) &&
                          rows_vectorisable(a.normed, a.normed_row, hidden, act);
  const cudaStream_t stream = stream_of(residual);
  const dim3 grid(static_cast<unsigned>(tokens), static_cast<unsigned>(streams));
  dispatch_activation(act, "hc_norm", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVector = 16 / static_cast<int>(sizeof(T));
    if (vectorised) {
      hc_norm_kernel<T, kVector><<<grid, kNormThreads, 0, stream>>>(a);
    } else {
      hc_norm_kernel<T, 1><<<grid, kNormThreads, 0, stream>>>(a);
    }
  });
  METRALE_CHECK_LAUNCH("hc_norm");
}

void hc_gates(const Tensor& down, const Tensor& inject, const Tensor& act_out, const Tensor& beta,
              const HcParams& params) {
  const int64_t streams = params.num_streams;
  METRALE_EXPECT(streams >= 1 && down.ndim() == 2, "hc_gates: down " + down.describe());
  const int64_t tokens = down.size(0), rank = down.size(1);
  const DType act = act_out.dtype();
  expect_rows(down, tokens, rank, act, "hc_gates down");
  expect_rows(act_out, tokens, rank, act, "hc_gates act");
  const bool with_beta = !beta.empty();
  METRALE_EXPECT(with_beta == !inject.empty(), "hc_gates: inject and beta go together");
  GateArgs a{};
  if (with_beta) {
    expect_rows(inject, tokens, streams, act, "hc_gates inject");
    expect_rows(beta, tokens, streams, act, "hc_gates beta");
    a.inject = inject.data();
    a.inject_row = inject.stride(0);
    a.beta = beta.data();
    a.beta_row = beta.stride(0);
  }
  if (tokens == 0) return;
  a.down = down.data();
  a.down_row = down.stride(0);
  a.act = act_out.data();
  a.act_row = act_out.stride(0);
  a.tokens = tokens;
  a.rank = static_cast<int>(rank);
  a.streams = static_cast<int>(streams);
  const int64_t items = tokens * (rank + (with_beta ? streams : 0));
  const cudaStream_t stream = stream_of(act_out);
  dispatch_activation(act, "hc_gates", [&](auto tag) {
    using T = decltype(tag);
    hc_gates_kernel<T><<<ceil_div(items, kThreads), kThreads, 0, stream>>>(a);
  });
  METRALE_CHECK_LAUNCH("hc_gates");
}

void hc_mix(const Tensor& up, const Tensor& normed, const Tensor& x, const HcParams& params) {
  const int64_t streams = params.num_streams;
  METRALE_EXPECT(streams >= 1 && x.ndim() == 2, "hc_mix: x " + x.describe());
  const int64_t tokens = x.size(0), hidden = x.size(1), width = streams * hidden;
  const DType act = x.dtype();
  expect_rows(up, tokens, width, act, "hc_mix up");
  expect_rows(normed, tokens, width, act, "hc_mix normed");
  expect_rows(x, tokens, hidden, act, "hc_mix x");
  if (tokens == 0) return;
  MixArgs a{};
  a.up = up.data();
  a.up_row = up.stride(0);
  a.normed = normed.data();
  a.normed_row = normed.stride(0);
  a.x = x.data();
  a.x_row = x.stride(0);
  a.tokens = tokens;
  a.hidden = static_cast<int>(hidden);
  a.streams = static_cast<int>(streams);
  const bool vectorised = rows_vectorisable(a.up, a.up_row, hidden, act) &&
                          rows_vectorisable(a.normed, a.normed_row, hidden, act) &&
                          rows_vectorisable(a.x, a.x_row, hidden, act);
  const cudaStream_t stream = stream_of(x);
  dispatch_activation(act, "hc_mix", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVector = 16 / static_cast<int>(sizeof(T));
    if (vectorised) {
      hc_mix_kernel<T, kVector><<<ceil_div(tokens * (hidden / kVector), kThreads), kThreads, 0, stream>>>(a);
    } else {
      hc_mix_kernel<T, 1><<<ceil_div(tokens * hidden, kThreads), kThreads, 0, stream>>>(a);
    }
  });
  METRALE_CHECK_LAUNCH("hc_mix");
}

void hc_gates_up_mix(const Tensor& down, const Tensor& inject, const Tensor& w_up, const Tensor& normed,
                     const Tensor& act, const Tensor& beta, const Tensor& up, const Tensor& x, const HcParams& params) {
  const int64_t streams = params.num_streams;
  METRALE_EXPECT(streams >= 1 && x.ndim() == 2 && down.ndim() == 2, "hc_gates_up_mix: x " + x.describe());
  const int64_t tokens = x.size(0), hidden = x.size(1), rank = down.size(1), width = streams * hidden;
  const DType dtype = x.dtype();
  const bool one_kernel = dtype == DType::kBF16 && w_up.dtype() == DType::kBF16 && w_up.is_contiguous() &&
                          w_up.ndim() == 2 && w_up.size(0) == width && w_up.size(1) == rank && aligned16(w_up.data()) &&
                          tokens <= kUpMixMaxTokens && streams <= kUpMixMaxStreams && rank <= kUpMixMaxRank &&
                          rank % gemv::kChunk == 0 && hidden <= INT32_MAX / 4;
  if (!one_kernel || tokens == 0) {
    cuda::hc_gates(down, inject, act, beta, params);
    cuda::linear(act, w_up, up, false);
    cuda::hc_mix(up, normed, x, params);
    return;
  }
  expect_rows(down, tokens, rank, dtype, "hc_gates_up_mix down");
  expect_rows(normed, tokens, width, dtype, "hc_gates_up_mix normed");
  expect_rows(x, tokens, hidden, dtype, "hc_gates_up_mix x");
  METRALE_EXPECT(beta.empty() == inject.empty(), "hc_gates_up_mix: inject and beta go together");
  UpMixArgs a{};
  if (!beta.empty()) {
    expect_rows(inject, tokens, streams, dtype, "hc_gates_up_mix inject");
    expect_rows(beta, tokens, streams, dtype, "hc_gates_up_mix beta");
    a.inject = inject.data_as<const __nv_bfloat16>();
    a.inject_row = inject.stride(0);
    a.beta = beta.data_as<__nv_bfloat16>();
    a.beta_row = beta.stride(0);
  }
  a.down = down.data_as<const __nv_bfloat16>();
  a.down_row = down.stride(0);
  a.w_up = w_up.data_as<const __nv_bfloat16>();
  a.normed = normed.data_as<const __nv_bfloat16>();
  a.normed_row = normed.stride(0);
  a.x = x.data_as<__nv_bfloat16>();
  a.x_row = x.stride(0);
  a.rank = static_cast<int>(rank);
  a.hidden = static_cast<int>(hidden);
  a.streams = static_cast<int>(streams);
  const dim3 grid(static_cast<unsigned>(ceil_div(hidden, kUpMixWarps)), static_cast<unsigned>(tokens));
  pdl::launch(hc_up_mix_kernel, grid, dim3(kUpMixWarps * 32), 0, stream_of(x), a);
}

}  // namespace metrale::kernels::cuda
