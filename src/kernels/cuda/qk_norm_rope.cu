// The fused attention prologue on the GPU (kernels/qk_norm_rope.h): per-head RMSNorm of q and k,
// RoPE on both, q written in place, k and v written into the paged cache. Rounds like transformers in
// the activation dtype D at every step (the rules of rms_norm.cu and rope.cu):
//   norm  plain: D(w * D(x * r)); zero-centred: D(x * r * (1 + w)); r = rsqrt(mean(x^2) + eps) in fp32
//   rope  cos, sin = D(cos(p * inv_freq) * s), D(sin(...) * s); x' = D(D(x * cos) +- D(partner * sin))
//
// One CTA per token, one warp per head (the token's q heads, then k heads, then v heads). A warp loads
// its head once (16-byte vectors when aligned) into a shared-memory row, normalises it there, then
// rotates channel i against channel i +- rotary_dim/2 from that row and stores. The token's cos/sin
// table is computed once per CTA. FP8 caches (kFp8Cache) receive the D-rounded k and v quantised
// with their head's scale (kernels/cuda/fp8_kv.cuh), as the CPU's kv_cache_write does.
#include <algorithm>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_kv.cuh"
#include "kernels/qk_norm_rope.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kMaxWarps = 16;
constexpr size_t kMaxSharedBytes = 48 * 1024;

template <typename T>
__device__ __forceinline__ float round_to(float value) {
  return to_f32(from_f32<T>(value));
}

template <typename T>
struct QkArgs {
  T* q;  // [T, n_heads, D], rotated in place
  int64_t q_token_stride, q_head_stride;
  const T* k;  // [T, n_kv, D]
  int64_t k_token_stride, k_head_stride;
  const T* v;  // [T, n_kv, D]
  int64_t v_token_stride, v_head_stride;
  const void* q_weight;  // [D], or null: no q norm
  const void* k_weight;  // [D], or null: no k norm
  WeightType q_weight_type, k_weight_type;
  const int32_t* positions;     // [T]
  const float* inv_freq;        // [half]
  const int32_t* slot_mapping;  // [T]
  void* k_cache;                // [num_slots, n_kv, D] T, or e4m3 codes (kFp8Cache)
  void* v_cache;
  const float* k_scale;         // [n_kv] f32 (kFp8Cache), or null: 1
  const float* v_scale;
  int64_t num_slots;
  int n_heads, n_kv, head_dim, half;
  float eps, attention_scaling;
  bool zero_centered;
};

// Stores N values (already rounded to T) into a cache row: as T, or quantised to e4m3 codes.
template <typename T, int N, bool kFp8Cache>
__device__ __forceinline__ void store_cache_chunk(void* cache_row, int c, const float (&values)[N], float scale) {
  if constexpr (kFp8Cache) {
    Vec<uint8_t, N> codes;
#pragma unroll
    for (int e = 0; e < N; ++e) codes.v[e] = e4m3_quantize(values[e], scale);
    *reinterpret_cast<Vec<uint8_t, N>*>(static_cast<uint8_t*>(cache_row) + c) = codes;
  } else {
    Vec<T, N> out;
#pragma unroll
    for (int e = 0; e < N; ++e) out.v[e] = from_f32<T>(values[e]);
    *reinterpret_cast<Vec<T, N>*>(static_cast<T*>(cache_row) + c) = out;
  }
}

template <typename T, int N, bool kFp8Cache>
__global__ void __launch_bounds__(32 * kMaxWarps) qk_norm_rope_kv_write_kernel(QkArgs<T> a) {
  using V = Vec<T, N>;
  using C = std::conditional_t<kFp8Cache, uint8_t, T>;
  extern __shared__ float shared[];
  float* cos_table = shared;             // [half], rounded to D
  float* sin_table = shared + a.half;    // [half]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  float* row = shared + 2 * a.half + warp * a.head_dim;  // this warp's head, fp32 [D]
  const int64_t t = blockIdx.x;
  const float position = static_cast<float>(a.positions[t]);
  for (int i = threadIdx.x; i < a.half; i += blockDim.x) {
    float sine, cosine;
    sincosf(__fmul_rn(position, a.inv_freq[i]), &sine, &cosine);
    cos_table[i] = round_to<T>(__fmul_rn(cosine, a.attention_scaling));
    sin_table[i] = round_to<T>(__fmul_rn(sine, a.attention_scaling));
  }
  __syncthreads();
  const int32_t slot = a.slot_mapping[t];
  const bool cached = slot >= 0 && slot < a.num_slots;  // -1: nothing to cache (out of range: never written)
  const int rotary_dim = 2 * a.half;
  const int head_dim = a.head_dim;

  // Heads are spread over blockIdx.y groups of `warps` (several CTAs per token when tokens are
  // few, so that a decode step is one round of loads instead of one per head).
  for (int h = blockIdx.y * warps + warp; h < a.n_heads + 2 * a.n_kv; h += warps * gridDim.y) {
    if (h >= a.n_heads + a.n_kv) {  // v: a copy into the cache
      if (!cached) continue;
      const int kv_head = h - a.n_heads - a.n_kv;
      const T* src = a.v + t * a.v_token_stride + kv_head * a.v_head_stride;
      C* dst = static_cast<C*>(a.v_cache) + (static_cast<int64_t>(slot) * a.n_kv + kv_head) * head_dim;
      const float scale = a.v_scale != nullptr ? a.v_scale[kv_head] : 1.0f;
      for (int c = lane * N; c < head_dim; c += 32 * N) {
        if constexpr (kFp8Cache) {
          const V x = *reinterpret_cast<const V*>(src + c);
          float values[N];
#pragma unroll
          for (int e = 0; e < N; ++e) values[e] = to_f32(x.v[e]);
          store_cache_chunk<T, N, true>(dst, c, values, scale);
        } else {
          *reinterpret_cast<V*>(dst + c) = *reinterpret_cast<const V*>(src + c);
        }
      }
      continue;
    }
    const bool is_q = h < a.n_heads;
    if (!is_q && !cached) continue;  // k only goes to the cache
    const int kv_head = h - a.n_heads;
    const T* src = is_q ? a.q + t * a.q_token_stride + h * a.q_head_stride
                        : a.k + t * a.k_token_stride + kv_head * a.k_head_stride;
    void* dst = is_q ? static_cast<void*>(a.q + t * a.q_token_stride + h * a.q_head_stride)
                     : static_cast<void*>(static_cast<C*>(a.k_cache) +
                                          (static_cast<int64_t>(slot) * a.n_kv + kv_head) * head_dim);
    const float k_scale = !is_q && a.k_scale != nullptr ? a.k_scale[kv_head] : 1.0f;
    const void* weight = is_q ? a.q_weight : a.k_weight;
    const WeightType weight_type = is_q ? a.q_weight_type : a.k_weight_type;

    // Load the head into the row, with its sum of squares.
    float sum_squares = 0.0f;
    for (int c = lane * N; c < head_dim; c += 32 * N) {
      const V x = *reinterpret_cast<const V*>(src + c);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float value = to_f32(x.v[e]);
        row[c + e] = value;
        sum_squares += value * value;
      }
    }
    if (weight != nullptr) {  // uniform over the warp
      const float inv_rms = rsqrtf(warp_sum(sum_squares) / static_cast<float>(head_dim) + a.eps);
      for (int c = lane * N; c < head_dim; c += 32 * N) {
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const float w = load_weight(weight, weight_type, c + e);
          const float normalized = row[c + e] * inv_rms;
          row[c + e] = a.zero_centered ? round_to<T>(normalized * (1.0f + w)) : round_to<T>(w * round_to<T>(normalized));
        }
      }
    }
    __syncwarp();
    // Rotate channel i < half against i + half (values are D-rounded), pass the rest through.
    for (int c = lane * N; c < head_dim; c += 32 * N) {
      float out[N];
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const int i = c + e;
        float value = row[i];
        if (i < a.half) {
          const float partner = row[i + a.half];
          value = __fsub_rn(round_to<T>(__fmul_rn(value, cos_table[i])), round_to<T>(__fmul_rn(partner, sin_table[i])));
        } else if (i < rotary_dim) {
          const int j = i - a.half;
          const float partner = row[j];
          value = __fadd_rn(round_to<T>(__fmul_rn(value, cos_table[j])), round_to<T>(__fmul_rn(partner, sin_table[j])));
        }
        out[e] = round_to<T>(value);
      }
      if (is_q) {
        store_cache_chunk<T, N, false>(dst, c, out, 1.0f);  // q in place, as T
      } else {
        store_cache_chunk<T, N, kFp8Cache>(dst, c, out, k_scale);
      }
    }
    __syncwarp();  // the row is reused by the warp's next head
  }
}

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

template <typename T, int N, bool kFp8Cache>
void launch(const QkArgs<T>& a, int64_t tokens, int warps, cudaStream_t stream) {
  const int total_heads = a.n_heads + 2 * a.n_kv;
  int head_groups = 1;
  if (tokens < 264) {  // fewer tokens than two waves of CTAs: one warp per head, 4 heads per CTA
    warps = std::min(warps, 4);
    head_groups = (total_heads + warps - 1) / warps;
  }
  const size_t shared_bytes = (2 * static_cast<size_t>(a.half) + static_cast<size_t>(warps) * a.head_dim) * sizeof(float);
  const dim3 grid(static_cast<unsigned int>(tokens), static_cast<unsigned int>(head_groups));
  qk_norm_rope_kv_write_kernel<T, N, kFp8Cache><<<grid, 32 * warps, shared_bytes, stream>>>(a);
}

template <typename T>
void run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_norm_weight, const Tensor& k_norm_weight,
         const Tensor& positions, const Tensor& inv_freq, const Tensor& slot_mapping, const Tensor& k_cache,
         const Tensor& v_cache, const QkNormRopeParams& params) {
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  QkArgs<T> a{};
  a.q = q.data_as<T>();
  a.q_token_stride = q.stride(0);
  a.q_head_stride = q.stride(1);
  a.k = k.data_as<const T>();
  a.k_token_stride = k.stride(0);
  a.k_head_stride = k.stride(1);
  a.v = v.data_as<const T>();
  a.v_token_stride = v.stride(0);
  a.v_head_stride = v.stride(1);
  if (params.q_norm) {
    METRALE_EXPECT(q_norm_weight.device().is_cuda() && q_norm_weight.numel() == head_dim &&
                       (q_norm_weight.ndim() != 1 || q_norm_weight.stride(0) == 1),
                   "qk_norm_rope_kv_write q_norm_weight " + q_norm_weight.describe());
    a.q_weight = q_norm_weight.data();
    a.q_weight_type = weight_type_of(q_norm_weight, "qk_norm_rope_kv_write");
  }
  if (params.k_norm) {
    METRALE_EXPECT(k_norm_weight.device().is_cuda() && k_norm_weight.numel() == head_dim &&
                       (k_norm_weight.ndim() != 1 || k_norm_weight.stride(0) == 1),
                   "qk_norm_rope_kv_write k_norm_weight " + k_norm_weight.describe());
    a.k_weight = k_norm_weight.data();
    a.k_weight_type = weight_type_of(k_norm_weight, "qk_norm_rope_kv_write");
  }
  a.positions = positions.data_as<const int32_t>();
  a.inv_freq = inv_freq.data_as<const float>();
  a.slot_mapping = slot_mapping.data_as<const int32_t>();
  const bool fp8_cache = k_cache.dtype() == DType::kF8E4M3;
  a.k_cache = k_cache.data();
  a.v_cache = v_cache.data();
  if (fp8_cache) {
    for (const Tensor* scales : {&params.kv_scales.k, &params.kv_scales.v}) {
      METRALE_EXPECT(scales->empty() || (scales->dtype() == DType::kF32 && scales->numel() == k.size(1) &&
                                         scales->is_contiguous() && scales->device() == k_cache.device()),
                     "qk_norm_rope_kv_write: FP8 KV scales " + scales->describe() + " must be [n_kv_heads] f32 on " +
                         k_cache.device().to_string());
    }
    a.k_scale = params.kv_scales.k.empty() ? nullptr : params.kv_scales.k.data_as<const float>();
    a.v_scale = params.kv_scales.v.empty() ? nullptr : params.kv_scales.v.data_as<const float>();
  }
  a.num_slots = k_cache.size(0) * k_cache.size(1);
  a.n_heads = static_cast<int>(q.size(1));
  a.n_kv = static_cast<int>(k.size(1));
  a.head_dim = static_cast<int>(head_dim);
  a.half = params.rope.rotary_dim / 2;
  a.eps = params.norm.eps;
  a.attention_scaling = params.rope.attention_scaling;
  a.zero_centered = params.norm.kind == RmsNormKind::kZeroCentered;

  const int total_heads = a.n_heads + 2 * a.n_kv;
  const size_t table_bytes = 2 * static_cast<size_t>(a.half) * sizeof(float);
  const size_t row_bytes = static_cast<size_t>(head_dim) * sizeof(float);
  const int warps = static_cast<int>(std::min<size_t>({static_cast<size_t>(kMaxWarps), static_cast<size_t>(total_heads),
                                                       (kMaxSharedBytes - table_bytes) / row_bytes}));
  METRALE_EXPECT(warps >= 1, "qk_norm_rope_kv_write: head_dim too large");

  constexpr int kVector = 16 / static_cast<int>(sizeof(T));
  const int64_t element_size = sizeof(T);
  auto strides_aligned = [&](const Tensor& t) {
    return aligned16(t.data()) && (t.stride(0) * element_size) % 16 == 0 && (t.stride(1) * element_size) % 16 == 0;
  };
  const bool vectorised = head_dim % kVector == 0 && strides_aligned(q) && strides_aligned(k) && strides_aligned(v) &&
                          aligned16(k_cache.data()) && aligned16(v_cache.data());
  const cudaStream_t stream = stream_of(q);
  if (vectorised) {
    fp8_cache ? launch<T, kVector, true>(a, tokens, warps, stream) : launch<T, kVector, false>(a, tokens, warps, stream);
  } else {
    fp8_cache ? launch<T, 1, true>(a, tokens, warps, stream) : launch<T, 1, false>(a, tokens, warps, stream);
  }
  METRALE_CHECK_LAUNCH("qk_norm_rope_kv_write_kernel");
}

}  // namespace

void qk_norm_rope_kv_write(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_norm_weight,
                           const Tensor& k_norm_weight, const Tensor& positions, const Tensor& inv_freq,
                           const Tensor& slot_mapping, const Tensor& k_cache, const Tensor& v_cache,
                           const QkNormRopeParams& params) {
  METRALE_EXPECT(q.device().is_cuda() && k.device().is_cuda() && v.device().is_cuda() &&
                     positions.device().is_cuda() && inv_freq.device().is_cuda() && slot_mapping.device().is_cuda() &&
                     k_cache.device().is_cuda() && v_cache.device().is_cuda(),
                 "qk_norm_rope_kv_write: tensors must be on the GPU");
  METRALE_EXPECT(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3 && k_cache.ndim() == 4 && v_cache.ndim() == 4,
                 "qk_norm_rope_kv_write: ranks");
  const int64_t tokens = q.size(0), head_dim = q.size(2), kv_heads = k.size(1);
  METRALE_EXPECT(k.size(0) == tokens && v.size(0) == tokens && k.size(2) == head_dim && v.size(2) == head_dim &&
                     v.size(1) == kv_heads && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
                 "qk_norm_rope_kv_write shapes q " + q.describe() + " k " + k.describe() + " v " + v.describe());
  METRALE_EXPECT(k_cache.shape() == v_cache.shape() && k_cache.size(2) == kv_heads && k_cache.size(3) == head_dim &&
                     k_cache.is_contiguous() && v_cache.is_contiguous(),
                 "qk_norm_rope_kv_write caches " + k_cache.describe());
  METRALE_EXPECT(q.dtype() == k.dtype() && q.dtype() == v.dtype() && k_cache.dtype() == v_cache.dtype() &&
                     (q.dtype() == k_cache.dtype() || k_cache.dtype() == DType::kF8E4M3),
                 "qk_norm_rope_kv_write: q, k, v and the caches must share a dtype on CUDA (or the caches be f8e4m3)");
  const int rotary_dim = params.rope.rotary_dim;
  METRALE_EXPECT(rotary_dim % 2 == 0 && rotary_dim >= 0 && rotary_dim <= head_dim &&
                     inv_freq.dtype() == DType::kF32 && inv_freq.numel() == rotary_dim / 2,
                 "qk_norm_rope_kv_write: rotary_dim / inv_freq " + inv_freq.describe());
  METRALE_EXPECT(positions.dtype() == DType::kI32 && positions.numel() == tokens && slot_mapping.dtype() == DType::kI32 &&
                     slot_mapping.numel() == tokens,
                 "qk_norm_rope_kv_write: positions and slot_mapping must be [T] i32");
  if (tokens == 0) return;
  METRALE_EXPECT(tokens <= INT32_MAX && head_dim <= 4096, "qk_norm_rope_kv_write: too large");
  switch (q.dtype()) {
    case DType::kBF16:
      run<__nv_bfloat16>(q, k, v, q_norm_weight, k_norm_weight, positions, inv_freq, slot_mapping, k_cache, v_cache,
                         params);
      break;
    case DType::kF32:
      run<float>(q, k, v, q_norm_weight, k_norm_weight, positions, inv_freq, slot_mapping, k_cache, v_cache, params);
      break;
    default:
      raise_message(ErrorCode::kUnsupported, "qk_norm_rope_kv_write: dtype " + std::string(dtype_name(q.dtype())) +
                                                 " is not supported on CUDA");
  }
}

}  // namespace metrale::kernels::cuda
