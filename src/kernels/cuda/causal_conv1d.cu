// Causal depthwise conv1d over a ragged batch with per-sequence conv-state slots, on the GPU
// (semantics in kernels/causal_conv1d.h; the CPU twin is the reference). Two launches:
//
//  1. conv_kernel: each thread takes a group of channels (8 bf16 = 16 bytes when rows allow) for a
//     run of consecutive rows of the flattened batch (32 rows for prefill, 1 for decode-sized
//     batches so that the state loads of many sequences run in parallel). It slides a window of the
//     L = (K-1)*d previous inputs in registers (d the dilation, a template parameter so that the
//     window stays in registers); the window of a sequence's first rows comes from its slot (or
//     zeros when it has no cached tokens). The slots are only read here.
//  2. state_kernel: one thread per (sequence, channel group) reads the sequence's new last L
//     inputs (old slot rows when q_len < L) and then overwrites the slot, so no thread reads a slot
//     row that another thread of the same launch writes.
// Decode steps (params.max_q_len == 1) take one launch instead: decode_kernel, one thread per
// (sequence, channel group), computes the row and then shifts its own channels of the slot.
// Batch metadata is read on the device only (graph-capturable); grids come from tensor shapes.
#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/causal_conv1d.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/pdl.cuh"

namespace metrale::kernels::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kPrefillRows = 32;

struct ConvArgs {
  const void* x;  // [T, C] rows strided
  int64_t x_row;
  void* out;  // [T, C]
  int64_t out_row;
  const void* weight;  // [C, K] contiguous
  WeightType weight_type;
  void* conv_state;      // [slots, (K-1)*d, C] contiguous
  const void* residual;  // [T, C] rows strided, or null
  int64_t residual_row;
  const int32_t* cu_q;
  const int32_t* kv_lens;
  const int32_t* slots;
  int num_seqs;
  int64_t tokens;
  int channels;
  int rows_per_thread;
  bool write_state;
  bool silu;
  bool round_conv;  // round the fp32 sum to T before the activation
  bool decode;      // max_q_len == 1: one launch of decode_kernel
};

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

// Input `pos` (relative to the sequence's first row of this step; negative = history) of channels
// c..c+N-1 of sequence s. The slot holds the L = (K-1)*d inputs before the step.
template <typename T, int L, int N>
__device__ __forceinline__ void fetch_input(const ConvArgs& a, int seq_begin, bool fresh, int slot, int pos, int c,
                                            float (&dst)[N]) {
  if (pos >= 0) {
    load_vec<T, N>(static_cast<const T*>(a.x) + static_cast<int64_t>(seq_begin + pos) * a.x_row + c, dst);
  } else if (fresh) {
#pragma unroll
    for (int e = 0; e < N; ++e) dst[e] = 0.0f;
  } else {
    load_vec<T, N>(static_cast<const T*>(a.conv_state) + (static_cast<int64_t>(slot) * L + (L + pos)) * a.channels + c,
                   dst);
  }
}

template <typename T, int K, int N>
__device__ __forceinline__ void load_weights(const ConvArgs& a, int c, float (&w)[K][N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
#pragma unroll
    for (int j = 0; j < K; ++j) w[j][e] = load_weight(a.weight, a.weight_type, static_cast<int64_t>(c + e) * K + j);
  }
}

// Output row `row` of channels c..c+N-1 from the L inputs before it (window, oldest first) and its own.
template <typename T, int K, int kDil, int N>
__device__ __forceinline__ void conv_row(const ConvArgs& a, const float (&w)[K][N],
                                         const float (&window)[(K - 1) * kDil > 0 ? (K - 1) * kDil : 1][N],
                                         const float (&current)[N], int64_t row, int c) {
  float added[N];
  if (a.residual != nullptr) load_vec<T, N>(static_cast<const T*>(a.residual) + row * a.residual_row + c, added);
  float result[N];
#pragma unroll
  for (int e = 0; e < N; ++e) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < K - 1; ++j) sum = fmaf(w[j][e], window[j * kDil][e], sum);
    sum = fmaf(w[K - 1][e], current[e], sum);
    // Rounded to the activation dtype after the convolution (unless round_conv is false), then
    // again after the activation (and after the residual's add).
    if (a.silu) {
      const float y = a.round_conv ? to_f32(from_f32<T>(sum)) : sum;
      sum = y / (1.0f + expf(-y));
    }
    if (a.residual != nullptr) sum = to_f32(from_f32<T>(sum)) + added[e];
    result[e] = sum;
  }
  store_vec<T, N>(static_cast<T*>(a.out) + row * a.out_row + c, result);
}

template <typename T, int K, int kDil, int N>
__global__ void __launch_bounds__(kThreads) conv_kernel(ConvArgs a) {
  constexpr int L = (K - 1) * kDil;
  const int c = (blockIdx.y * kThreads + threadIdx.x) * N;
  if (c >= a.channels) return;
  const int64_t total = a.cu_q[a.num_seqs];
  const int64_t row_begin = static_cast<int64_t>(blockIdx.x) * a.rows_per_thread;
  const int64_t row_end = min(total, row_begin + a.rows_per_thread);
  if (row_begin >= row_end) return;

  float w[K][N];
  load_weights<T, K, N>(a, c, w);

  int s = sequence_of(a.cu_q, a.num_seqs, row_begin);
  int seq_begin = a.cu_q[s], seq_end = a.cu_q[s + 1];
  float window[L > 0 ? L : 1][N];  // inputs pos-L .. pos-1, oldest first
  bool window_valid = false;
  for (int64_t row = row_begin; row < row_end; ++row) {
    while (row >= seq_end) {  // next non-empty sequence
      ++s;
      seq_begin = seq_end;
      seq_end = a.cu_q[s + 1];
      window_valid = false;
    }
    const int pos = static_cast<int>(row - seq_begin);
    if (!window_valid) {
      const bool fresh = a.kv_lens[s] == seq_end - seq_begin || a.slots[s] < 0;
      const int slot = a.slots[s];
#pragma unroll
      for (int j = 0; j < L; ++j) fetch_input<T, L, N>(a, seq_begin, fresh, slot, pos - L + j, c, window[j]);
      window_valid = true;
    }
    float current[N];
    load_vec<T, N>(static_cast<const T*>(a.x) + row * a.x_row + c, current);
    conv_row<T, K, kDil, N>(a, w, window, current, row, c);
#pragma unroll
    for (int j = 0; j + 1 < L; ++j) {
#pragma unroll
      for (int e = 0; e < N; ++e) window[j][e] = window[j + 1][e];
    }
    if constexpr (L > 0) {
#pragma unroll
      for (int e = 0; e < N; ++e) window[L - 1][e] = current[e];
    }
  }
}

template <typename T, int L, int N>
__global__ void __launch_bounds__(kThreads) state_kernel(ConvArgs a) {
  const int c = (blockIdx.y * kThreads + threadIdx.x) * N;
  const int s = blockIdx.x;
  if (c >= a.channels) return;
  const int seq_begin = a.cu_q[s], q_len = a.cu_q[s + 1] - seq_begin;
  if (q_len == 0 || a.slots[s] < 0) return;  // nothing new, or no slot to keep it in
  const bool fresh = a.kv_lens[s] == q_len;
  const int slot = a.slots[s];
  float rows[L > 0 ? L : 1][N];
#pragma unroll
  for (int j = 0; j < L; ++j) fetch_input<T, L, N>(a, seq_begin, fresh, slot, q_len - L + j, c, rows[j]);
#pragma unroll
  for (int j = 0; j < L; ++j) {
    store_vec<T, N>(static_cast<T*>(a.conv_state) + (static_cast<int64_t>(slot) * L + j) * a.channels + c, rows[j]);
  }
}

// Decode steps (at most one row per sequence): one thread per (sequence, channel group) computes
// the sequence's row and then shifts the window of its slot. Only the thread that reads a slot's
// channels writes them, so the conv and the state update are one launch. Launched through
// pdl::launch (its launch overlaps the projection GEMV before it).
template <typename T, int K, int kDil, int N>
__global__ void __launch_bounds__(kThreads) decode_kernel(ConvArgs a) {
  constexpr int L = (K - 1) * kDil;
  pdl::wait_then_allow_dependents();
  const int c = (blockIdx.y * kThreads + threadIdx.x) * N;
  const int s = blockIdx.x;
  if (c >= a.channels) return;
  const int seq_begin = a.cu_q[s];
  if (a.cu_q[s + 1] == seq_begin) return;  // no row this step
  const int slot = a.slots[s];
  const bool fresh = a.kv_lens[s] == 1 || slot < 0;
  float w[K][N];
  load_weights<T, K, N>(a, c, w);
  float window[L > 0 ? L : 1][N];
#pragma unroll
  for (int j = 0; j < L; ++j) fetch_input<T, L, N>(a, seq_begin, fresh, slot, j - L, c, window[j]);
  float current[N];
  load_vec<T, N>(static_cast<const T*>(a.x) + static_cast<int64_t>(seq_begin) * a.x_row + c, current);
  conv_row<T, K, kDil, N>(a, w, window, current, seq_begin, c);
  if (!a.write_state || slot < 0) return;
  T* state = static_cast<T*>(a.conv_state) + static_cast<int64_t>(slot) * L * a.channels + c;
#pragma unroll
  for (int j = 0; j + 1 < L; ++j) store_vec<T, N>(state + static_cast<int64_t>(j) * a.channels, window[j + 1]);
  if constexpr (L > 0) store_vec<T, N>(state + static_cast<int64_t>(L - 1) * a.channels, current);
}

template <typename T, int K, int kDil, int N>
void launch(const ConvArgs& a, cudaStream_t stream) {
  constexpr int L = (K - 1) * kDil;
  const auto channel_blocks = static_cast<unsigned>((a.channels / N + kThreads - 1) / kThreads);
  if (a.decode) {
    pdl::launch(decode_kernel<T, K, kDil, N>, dim3(static_cast<unsigned>(a.num_seqs), channel_blocks), dim3(kThreads),
                0, stream, a);
    return;
  }
  const auto row_blocks = static_cast<unsigned>((a.tokens + a.rows_per_thread - 1) / a.rows_per_thread);
  if (row_blocks > 0) conv_kernel<T, K, kDil, N><<<dim3(row_blocks, channel_blocks), kThreads, 0, stream>>>(a);
  if constexpr (L > 0) {
    if (a.write_state)
      state_kernel<T, L, N><<<dim3(static_cast<unsigned>(a.num_seqs), channel_blocks), kThreads, 0, stream>>>(a);
  }
}

template <typename T, int K, int kDil>
void launch_vectorised(const ConvArgs& a, bool vectorised, cudaStream_t stream) {
  constexpr int kVector = 16 / static_cast<int>(sizeof(T));
  vectorised ? launch<T, K, kDil, kVector>(a, stream) : launch<T, K, kDil, 1>(a, stream);
}

template <typename T, int K>
void launch_dilation(const ConvArgs& a, int dilation, bool vectorised, cudaStream_t stream) {
  switch (dilation) {
    case 1:
      return launch_vectorised<T, K, 1>(a, vectorised, stream);
    case 2:
      return launch_vectorised<T, K, 2>(a, vectorised, stream);
    case 3:
      return launch_vectorised<T, K, 3>(a, vectorised, stream);
    case 4:
      return launch_vectorised<T, K, 4>(a, vectorised, stream);
    default:
      raise_message(ErrorCode::kUnsupported,
                    "causal_conv1d: CUDA supports dilations 1 to 4, got " + std::to_string(dilation));
  }
}

template <typename T>
void launch_kernel_size(const ConvArgs& a, int kernel_size, int dilation, bool vectorised, cudaStream_t stream) {
  switch (kernel_size) {
    case 2:
      return launch_dilation<T, 2>(a, dilation, vectorised, stream);
    case 3:
      return launch_dilation<T, 3>(a, dilation, vectorised, stream);
    case 4:
      return launch_dilation<T, 4>(a, dilation, vectorised, stream);
    default:
      raise_message(ErrorCode::kUnsupported,
                    "causal_conv1d: CUDA supports kernel sizes 2 to 4, got " + std::to_string(kernel_size));
  }
}

}  // namespace

void causal_conv1d(const Tensor& x, const Tensor& weight, const Tensor& conv_state, const Tensor& cu_q,
                   const Tensor& kv_lens, const Tensor& state_slots, const Tensor& out,
                   const CausalConv1dParams& params) {
  for (const Tensor* t : {&x, &weight, &conv_state, &cu_q, &kv_lens, &state_slots, &out}) {
    METRALE_EXPECT(t->device().is_cuda(), "causal_conv1d: tensors must be on the GPU (" + t->describe() + ")");
  }
  METRALE_EXPECT(
      x.ndim() == 2 && out.ndim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
          out.size(1) == x.size(1) && x.dtype() == out.dtype() && conv_state.dtype() == x.dtype(),
      "causal_conv1d: x " + x.describe() + " out " + out.describe() + " conv_state " + conv_state.describe());
  const int64_t tokens = x.size(0), channels = x.size(1);
  METRALE_EXPECT(weight.is_contiguous() && weight.size(0) == channels && channels > 0 && weight.numel() % channels == 0,
                 "causal_conv1d: weight " + weight.describe());
  const int64_t kernel_size = weight.numel() / channels;
  METRALE_EXPECT(params.dilation >= 1, "causal_conv1d: dilation " + std::to_string(params.dilation));
  METRALE_EXPECT(conv_state.ndim() == 3 && conv_state.is_contiguous() &&
                     conv_state.size(1) == (kernel_size - 1) * params.dilation && conv_state.size(2) == channels,
                 "causal_conv1d: conv_state " + conv_state.describe());
  const Tensor& residual = params.residual;
  if (!residual.empty()) {
    METRALE_EXPECT(residual.device().is_cuda() && residual.ndim() == 2 && residual.size(0) == tokens &&
                       residual.size(1) == channels && residual.stride(1) == 1 && residual.dtype() == x.dtype(),
                   "causal_conv1d: residual " + residual.describe() + " for x " + x.describe());
  }
  const int64_t num_seqs = kv_lens.numel();
  METRALE_EXPECT(cu_q.numel() == num_seqs + 1 && state_slots.numel() == num_seqs && cu_q.dtype() == DType::kI32 &&
                     kv_lens.dtype() == DType::kI32 && state_slots.dtype() == DType::kI32,
                 "causal_conv1d: cu_q " + cu_q.describe() + " state_slots " + state_slots.describe());
  METRALE_EXPECT(channels <= INT32_MAX / 2 && num_seqs <= INT32_MAX, "causal_conv1d: too large");
  if (num_seqs == 0) return;
  ConvArgs a{};
  a.x = x.data();
  a.x_row = x.stride(0);
  a.out = out.data();
  a.out_row = out.stride(0);
  a.weight = weight.data();
  a.weight_type = weight_type_of(weight, "causal_conv1d");
  a.conv_state = conv_state.data();
  a.residual = residual.empty() ? nullptr : residual.data();
  a.residual_row = residual.empty() ? 0 : residual.stride(0);
  a.cu_q = cu_q.data_as<const int32_t>();
  a.kv_lens = kv_lens.data_as<const int32_t>();
  a.slots = state_slots.data_as<const int32_t>();
  a.num_seqs = static_cast<int>(num_seqs);
  a.tokens = tokens;
  a.channels = static_cast<int>(channels);
  a.silu = params.silu;
  a.round_conv = params.round_conv;
  // Decode-sized batches (about one row per sequence): one row per thread, so that the slot reads of
  // all sequences are in flight together; prefill: a run of rows shares the sliding window.
  const int64_t q_bound = params.max_q_len > 0 ? params.max_q_len : tokens;
  a.rows_per_thread = (q_bound <= 4 || tokens <= 4 * num_seqs) ? 1 : kPrefillRows;
  a.write_state = params.write_state;
  a.decode = params.max_q_len == 1;
  const auto element = static_cast<int64_t>(x.element_size());
  const int64_t vector = 16 / element;
  const bool vectorised =
      channels % vector == 0 && reinterpret_cast<uintptr_t>(x.data()) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(out.data()) % 16 == 0 && reinterpret_cast<uintptr_t>(conv_state.data()) % 16 == 0 &&
      (x.stride(0) * element) % 16 == 0 && (out.stride(0) * element) % 16 == 0 &&
      (residual.empty() ||
       (reinterpret_cast<uintptr_t>(residual.data()) % 16 == 0 && (residual.stride(0) * element) % 16 == 0));
  const cudaStream_t stream = stream_of(out);
  const int k = static_cast<int>(kernel_size);
  switch (x.dtype()) {
    case DType::kBF16:
      launch_kernel_size<__nv_bfloat16>(a, k, params.dilation, vectorised, stream);
      break;
    case DType::kF32:
      launch_kernel_size<float>(a, k, params.dilation, vectorised, stream);
      break;
    default:
      raise_message(ErrorCode::kUnsupported,
                    "causal_conv1d: dtype " + std::string(dtype_name(x.dtype())) + " is not supported on CUDA");
  }
  METRALE_CHECK_LAUNCH("causal_conv1d");
}

}  // namespace metrale::kernels::cuda
