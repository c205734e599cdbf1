// RMSNorm and the fused residual add + RMSNorm on the GPU, rounding like transformers in the
// activation dtype D (qwen.md §3.1):
//   plain         y = D(w * D(x * rsqrt(mean(x^2) + eps)))      (Qwen3RMSNorm)
//   zero-centred  y = D(x * rsqrt(mean(x^2) + eps) * (1 + w))   (Qwen3NextRMSNorm: fp32, one rounding)
//   add_rms_norm  residual = D(residual + x) (transformers' `hidden = residual + hidden` in D), then the
//                 norm of the new residual
// mean(x^2) and everything after it in fp32. D is the tensors' dtype (bf16 on the GPU path; f32 makes
// every D an identity).
//
// Layout: one warp per row when a row is at most 128 vectors (1024 bf16), else one CTA per row. Rows
// are loaded once, kept in registers (up to 4 vectors of 16 bytes per thread) and written once; rows
// longer than 4 x 1024 vectors are read twice instead. 16-byte vectors when every row start is 16-byte
// aligned, else element by element.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/rms_norm.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kWarpRowsPerBlock = 4;
constexpr int kCachedVectors = 4;  // per thread

// Row r of a [A, B, width] view starts at (r / B) * outer_stride + (r % B) * inner_stride elements.
struct RowLayout {
  int64_t inner = 1;
  int64_t outer_stride = 0;
  int64_t inner_stride = 0;
  __device__ __forceinline__ int64_t offset(int64_t row) const {
    return inner == 1 ? row * outer_stride : (row / inner) * outer_stride + (row % inner) * inner_stride;
  }
};

struct NormArgs {
  const void* x;
  void* residual;  // add_rms_norm only
  void* out;
  const void* weight;  // [width]
  WeightType weight_type;
  RowLayout x_rows, residual_rows, out_rows;
  int64_t rows;
  int width;
  float eps;
  bool zero_centered;
};

struct WarpReduce {
  __device__ float operator()(float value) const { return warp_sum(value); }
};
struct BlockReduce {
  float* scratch;
  __device__ float operator()(float value) const { return block_sum(value, scratch); }
};

// Normalises one row with `group` threads (a warp or the CTA); this thread is `lane` in the group and
// handles vectors lane, lane + group, ... K > 0: the row stays in registers (needs K * group >= the
// row's vectors); K == 0: the row is read again for the output.
template <typename T, int N, int K, bool kAdd, typename Reduce>
__device__ __forceinline__ void normalize_row(const NormArgs& a, int64_t row, int lane, int group,
                                              const Reduce& reduce) {
  using V = Vec<T, N>;
  const T* x = static_cast<const T*>(a.x) + a.x_rows.offset(row);
  T* residual = kAdd ? static_cast<T*>(a.residual) + a.residual_rows.offset(row) : nullptr;
  T* out = static_cast<T*>(a.out) + a.out_rows.offset(row);
  const int vectors = a.width / N;

  // Loads vector j of the input as fp32; with kAdd, first replaces the residual by D(residual + x).
  auto load_input = [&](int j, float (&values)[N]) {
    const V xv = *reinterpret_cast<const V*>(x + j * N);
    if constexpr (kAdd) {
      V rv = *reinterpret_cast<const V*>(residual + j * N);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        rv.v[e] = from_f32<T>(to_f32(rv.v[e]) + to_f32(xv.v[e]));
        values[e] = to_f32(rv.v[e]);
      }
      *reinterpret_cast<V*>(residual + j * N) = rv;
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) values[e] = to_f32(xv.v[e]);
    }
  };
  // Reloads vector j of the (new) input for the K == 0 path.
  auto reload_input = [&](int j, float (&values)[N]) {
    const V v = *reinterpret_cast<const V*>((kAdd ? static_cast<const T*>(residual) : x) + j * N);
#pragma unroll
    for (int e = 0; e < N; ++e) values[e] = to_f32(v.v[e]);
  };

  float sum_squares = 0.0f;
  float cached[K > 0 ? K : 1][N];
  if constexpr (K > 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = lane + k * group;
      if (j < vectors) {
        load_input(j, cached[k]);
#pragma unroll
        for (int e = 0; e < N; ++e) sum_squares += cached[k][e] * cached[k][e];
      }
    }
  } else {
    for (int j = lane; j < vectors; j += group) {
      float values[N];
      load_input(j, values);
#pragma unroll
      for (int e = 0; e < N; ++e) sum_squares += values[e] * values[e];
    }
  }
  const float total = reduce(sum_squares);
  const float inv_rms = rsqrtf(total / static_cast<float>(a.width) + a.eps);

  auto store_output = [&](int j, const float (&values)[N]) {
    V o;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float w = load_weight(a.weight, a.weight_type, j * N + e);
      const float normalized = values[e] * inv_rms;
      // Plain: the normalised value is rounded to D before the weight multiply; zero-centred: one rounding.
      o.v[e] = a.zero_centered ? from_f32<T>(normalized * (1.0f + w)) : from_f32<T>(w * to_f32(from_f32<T>(normalized)));
    }
    *reinterpret_cast<V*>(out + j * N) = o;
  };
  if constexpr (K > 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = lane + k * group;
      if (j < vectors) store_output(j, cached[k]);
    }
  } else {
    for (int j = lane; j < vectors; j += group) {
      float values[N];
      reload_input(j, values);
      store_output(j, values);
    }
  }
}

template <typename T, int N, bool kAdd>
__global__ void __launch_bounds__(32 * kWarpRowsPerBlock) rms_norm_warp_kernel(NormArgs a) {
  pdl::wait_then_allow_dependents();  // launched through pdl::launch; the next GEMV stages meanwhile
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpRowsPerBlock + threadIdx.x / 32;
  if (row >= a.rows) return;  // whole warps leave together
  normalize_row<T, N, kCachedVectors, kAdd>(a, row, threadIdx.x & 31, 32, WarpReduce{});
}

template <typename T, int N, int K, bool kAdd>
__global__ void __launch_bounds__(1024) rms_norm_block_kernel(NormArgs a) {
  pdl::wait_then_allow_dependents();  // launched through pdl::launch; the next GEMV stages meanwhile
  __shared__ float scratch[32];
  normalize_row<T, N, K, kAdd>(a, blockIdx.x, threadIdx.x, blockDim.x, BlockReduce{scratch});
}

// Rows of a tensor whose last dim is contiguous: up to two leading strides (more leading dims must
// collapse evenly).
RowLayout row_layout(const Tensor& t, const char* what) {
  METRALE_EXPECT(t.ndim() >= 1 && (t.stride(-1) == 1 || t.size(-1) == 1),
                 std::string(what) + ": last dim must be contiguous (" + t.describe() + ")");
  RowLayout layout;
  if (t.ndim() == 1) return layout;
  if (t.ndim() == 2) {
    layout.outer_stride = t.stride(0);
    return layout;
  }
  layout.inner = t.size(-2);
  layout.inner_stride = t.stride(-2);
  layout.outer_stride = t.stride(-3);
  for (int d = t.ndim() - 4; d >= 0; --d) {
    METRALE_EXPECT(t.size(d) == 1 || t.stride(d) == t.stride(d + 1) * t.size(d + 1),
                   std::string(what) + ": leading dims do not collapse (" + t.describe() + ")");
  }
  return layout;
}

bool vector_aligned(const void* pointer, const RowLayout& layout, int64_t element_size) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0 && (layout.outer_stride * element_size) % 16 == 0 &&
         (layout.inner_stride * element_size) % 16 == 0;
}

template <typename T, int N, bool kAdd>
void launch(const NormArgs& a, cudaStream_t stream) {
  const int vectors = a.width / N;
  if (vectors <= 32 * kCachedVectors) {
    const auto grid = static_cast<unsigned int>((a.rows + kWarpRowsPerBlock - 1) / kWarpRowsPerBlock);
    pdl::launch(rms_norm_warp_kernel<T, N, kAdd>, dim3(grid), dim3(32 * kWarpRowsPerBlock), 0, stream, a);
  } else if (vectors <= 1024 * kCachedVectors) {
    // About two vectors per thread (never more than kCachedVectors).
    const int threads = std::min(1024, std::max(64, (vectors / 2 + 31) / 32 * 32));
    pdl::launch(rms_norm_block_kernel<T, N, kCachedVectors, kAdd>, dim3(static_cast<unsigned int>(a.rows)),
                dim3(threads), 0, stream, a);
  } else {
    pdl::launch(rms_norm_block_kernel<T, N, 0, kAdd>, dim3(static_cast<unsigned int>(a.rows)), dim3(1024), 0, stream,
                a);
  }
}

template <bool kAdd>
void run_norm(const Tensor* residual, const Tensor& x, const Tensor& weight, const Tensor& out,
              const RmsNormParams& params, const char* what) {
  METRALE_EXPECT(x.device().is_cuda() && out.device().is_cuda() && weight.device().is_cuda() &&
                     (residual == nullptr || residual->device().is_cuda()),
                 std::string(what) + ": tensors must be on the GPU");
  METRALE_EXPECT(x.dtype() == out.dtype() && (residual == nullptr || residual->dtype() == x.dtype()),
                 std::string(what) + ": x, out (and residual) must share a dtype");
  METRALE_EXPECT(x.shape() == out.shape() && (residual == nullptr || residual->shape() == x.shape()),
                 std::string(what) + ": shapes " + x.describe() + " " + out.describe());
  const int64_t width = x.size(-1);
  METRALE_EXPECT(weight.numel() == width && (weight.ndim() != 1 || weight.stride(0) == 1 || width == 1),
                 std::string(what) + ": weight " + weight.describe());
  METRALE_EXPECT(width <= INT32_MAX, std::string(what) + ": row too wide");
  NormArgs a{};
  a.x = x.data();
  a.residual = residual ? residual->data() : nullptr;
  a.out = out.data();
  a.weight = weight.data();
  a.weight_type = weight_type_of(weight, "rms_norm");
  a.x_rows = row_layout(x, what);
  a.out_rows = row_layout(out, what);
  if (residual) a.residual_rows = row_layout(*residual, what);
  a.rows = width == 0 ? 0 : x.numel() / width;
  a.width = static_cast<int>(width);
  a.eps = params.eps;
  a.zero_centered = params.kind == RmsNormKind::kZeroCentered;
  if (a.rows == 0) return;
  METRALE_EXPECT(a.rows <= INT32_MAX, std::string(what) + ": too many rows");
  const auto element_size = static_cast<int64_t>(x.element_size());
  const int64_t vector_elements = 16 / element_size;
  const bool vectorised = width % vector_elements == 0 && vector_aligned(a.x, a.x_rows, element_size) &&
                          vector_aligned(a.out, a.out_rows, element_size) &&
                          (residual == nullptr || vector_aligned(a.residual, a.residual_rows, element_size));
  const cudaStream_t stream = stream_of(out);
  switch (x.dtype()) {
    case DType::kBF16:
      vectorised ? launch<__nv_bfloat16, 8, kAdd>(a, stream) : launch<__nv_bfloat16, 1, kAdd>(a, stream);
      break;
    case DType::kF32:
      vectorised ? launch<float, 4, kAdd>(a, stream) : launch<float, 1, kAdd>(a, stream);
      break;
    default:
      raise_message(ErrorCode::kUnsupported,
                    std::string(what) + ": dtype " + std::string(dtype_name(x.dtype())) + " is not supported on CUDA");
  }
  METRALE_CHECK_LAUNCH(what);
}

}  // namespace

void rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, const RmsNormParams& params) {
  run_norm<false>(nullptr, x, weight, out, params, "rms_norm");
}

void add_rms_norm(const Tensor& residual, const Tensor& x, const Tensor& weight, const Tensor& out,
                  const RmsNormParams& params) {
  run_norm<true>(&residual, x, weight, out, params, "add_rms_norm");
}

}  // namespace metrale::kernels::cuda
