// linear_fp8 on the GPU, two paths by the number of input rows M:
//   - M <= fp8_gemv_max_rows() (decode; default 2): a GEMV (fp8_gemv.cuh). Each warp streams a few
//     weight rows' e4m3 codes once (16 bytes a lane, up to 16 loads in flight), converts them in
//     registers (cvt pairs), dots them with up to kRowsPerPass input rows in fp32 and applies the
//     row's 128x128 block scale once per 16-code chunk.
//   - larger M (prefill): bf16 x is quantised per token and 128-wide K group to e4m3 (fp8_quantize.h)
//     into a per-device scratch buffer, then one cuBLASLt FP8 matmul with block scaling (Hopper,
//     cuBLASLt >= 12.9) computes out = x_q . W_q^T with fp32 accumulation: as in linear.cu, the
//     row-major product is the column-major out^T [N, M] = W [K, N]^T . x_q [K, M], so cuBLASLt's A is
//     the weight (TRANSA = T, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F) and B the quantised
//     activations (TRANSB = N, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F), the "TN" layout FP8
//     requires. D is bf16 or f32 (out's dtype); `accumulate` is beta = 1 with C = D = out.
//     Where cuBLASLt has no algorithm (the plan is cached as refused and logged once at debug), for
//     K or N not multiples of 16, misaligned operands, or x not bf16 (f32 runs keep exact
//     activations), the GEMV runs instead, 8 rows a pass (each pass rereads the weights).
//
// Scale layouts cuBLASLt reads (row pitches padded to 16 bytes, as Transformer Engine's "GEMM_READY"
// block scales): BLK128x128 for an operand stored K-inner is [ceil(N/128)] rows of
// round_up(ceil(K/128), 4) floats, the K blocks adjacent: the checkpoint's scale_inv
// [ceil(N/128), ceil(K/128)] itself when ceil(K/128) % 4 == 0, else a padded copy made per call in the
// scratch buffer. VEC128 is [ceil(K/128)] rows of round_up(M, 4) floats, tokens adjacent, which
// quantize_fp8_rows writes.
//
// The scratch buffer (codes [M, K] e4m3, their scales, the padded weight scales) is never allocated
// during a CUDA graph capture: it grows only outside one (a capture that would need it larger raises;
// run the shape once first, as the runner's warm-up does). A buffer a capture has used is kept alive
// when the buffer grows, since the graph replays with its pointers.
#include <cublasLt.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/log_level.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cublaslt_context.cuh"
#include "kernels/cuda/fp8_gemv.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/fp8_quantize.h"
#include "kernels/linear_fp8.h"
#include "runtime/buffer.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kGemvWarps = 4;    // warps per block of the vector GEMV
constexpr int kScalarWarps = 8;  // warps (weight rows) per block of the scalar GEMV
constexpr int kRowsPerPass = 8;  // input rows per GEMV launch

__device__ __forceinline__ float e4m3_to_f32(uint8_t code) {
  __nv_fp8_e4m3 value;
  value.__x = code;
  return static_cast<float>(value);
}

// The vector GEMV (fp8_gemv.cuh): grid = ceil(N / (R * kGemvWarps)) blocks; warp w of block b owns
// weight rows [(b * kGemvWarps + w) * R, ... + R). x [m <= M, k] rows x_stride apart; w [n, k]
// codes; scales [ceil(n/128), scale_cols].
template <int R, int M, int U, typename XT, typename OutT>
__global__ void __launch_bounds__(kGemvWarps * 32)
    fp8_gemv_kernel(const XT* x, int64_t x_stride, int m, const uint8_t* __restrict__ w,
                    const float* __restrict__ scales, int64_t scale_cols, OutT* out, int64_t out_stride, int n, int k,
                    bool accumulate) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kGemvWarps + warp) * R;
  if (row0 >= n) return;
  const uint8_t* w_rows[R];
  const float* scale_rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = min(row0 + r, n - 1);  // clamped: read, not written
    w_rows[r] = w + static_cast<int64_t>(row) * k;
    scale_rows[r] = scales + static_cast<int64_t>(row / kFp8Block) * scale_cols;
  }
  const XT* x_rows[M];
#pragma unroll
  for (int i = 0; i < M; ++i) x_rows[i] = x + static_cast<int64_t>(min(i, m - 1)) * x_stride;
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.0f;
  }
  fp8_gemv::warp_dot_partial<R, M, U>(w_rows, scale_rows, x_rows, m, k / fp8_gemv::kChunk, lane, acc,
                                      pdl::WaitForInputs{});
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      if (M > 1 && i >= m) continue;  // warp-uniform
      const float total = warp_sum(acc[r][i]);
      if (lane == ((r * M + i) & 31) && row0 + r < n) {
        OutT* at = out + static_cast<int64_t>(i) * out_stride + row0 + r;
        *at = from_f32<OutT>(accumulate ? total + to_f32(*at) : total);
      }
    }
  }
}

// The scalar GEMV for what the vector one cannot read (K % 16 != 0, rows not 16-byte aligned):
// one warp per weight row, element by element, up to kRowsPerPass input rows.
template <typename XT, typename OutT>
__global__ void __launch_bounds__(kScalarWarps * 32)
    fp8_gemv_scalar_kernel(const XT* __restrict__ x, int64_t x_stride, int m, const uint8_t* __restrict__ w,
                           const float* __restrict__ scales, int64_t scale_cols, OutT* out, int64_t out_stride, int n,
                           int k, bool accumulate) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kScalarWarps + (threadIdx.x >> 5);
  if (row >= n) return;
  const uint8_t* w_row = w + static_cast<int64_t>(row) * k;
  const float* row_scales = scales + static_cast<int64_t>(row / kFp8Block) * scale_cols;
  float acc[kRowsPerPass] = {};
  for (int c = lane; c < k; c += 32) {
    const float wv = e4m3_to_f32(w_row[c]) * row_scales[c / kFp8Block];
#pragma unroll
    for (int r = 0; r < kRowsPerPass; ++r)
      if (r < m) acc[r] = fmaf(to_f32(x[r * x_stride + c]), wv, acc[r]);
  }
#pragma unroll
  for (int r = 0; r < kRowsPerPass; ++r) {
    if (r >= m) break;
    const float sum = warp_sum(acc[r]);
    if (lane == 0) {
      OutT* at = out + r * out_stride + row;
      *at = from_f32<OutT>(accumulate ? sum + to_f32(*at) : sum);
    }
  }
}

void expect(bool condition, const std::string& what) {
  if (!condition) raise_message(ErrorCode::kInternal, "kernel linear_fp8: " + what);
}

template <int R, int M, int U, typename XT, typename OutT>
void launch_vector_gemv(const XT* x, int64_t x_stride, int m, const Tensor& weight, const Tensor& scale_inv, OutT* out,
                        int64_t out_stride, bool accumulate, cudaStream_t stream) {
  const int n = static_cast<int>(weight.size(0)), k = static_cast<int>(weight.size(1));
  pdl::launch(fp8_gemv_kernel<R, M, U, XT, OutT>, dim3(ceil_div(n, static_cast<int64_t>(R) * kGemvWarps)),
              dim3(kGemvWarps * 32), 0, stream, x, x_stride, m, static_cast<const uint8_t*>(weight.data()),
              scale_inv.data_as<const float>(), scale_inv.size(1), out, out_stride, n, k, accumulate);
}

// Per-M configurations: rows per warp R and chunks in flight per row U (R * U 16-byte loads in flight
// per lane). At M = 1, measured on the H200 at the Qwen3-8B / Qwen3-Next shapes: 4 x 4 matches 2 x 8
// on the small shapes and is 2-5% ahead from 12288 x 4096 up; 4 x 8, 8 x 4, 8 x 2 and 1 x 16 are slower.
template <typename XT, typename OutT>
void launch_vector_pass(const XT* x, int64_t x_stride, int m, const Tensor& weight, const Tensor& scale_inv, OutT* out,
                        int64_t out_stride, bool accumulate, cudaStream_t stream) {
  const auto go = [&]<int R, int M, int U>() {
    launch_vector_gemv<R, M, U>(x, x_stride, m, weight, scale_inv, out, out_stride, accumulate, stream);
  };
  if (m == 1) return go.template operator()<4, 1, 4>();
  if (m == 2) return go.template operator()<2, 2, 4>();
  if (m <= 4) return go.template operator()<2, 4, 2>();
  return go.template operator()<2, kRowsPerPass, 1>();
}

// Rows [row0, m) of x through the GEMV, kRowsPerPass a launch.
void launch_gemv_rows(const Tensor& x, const Tensor& weight, const Tensor& scale_inv, const Tensor& out,
                      bool accumulate, int64_t row0, cudaStream_t stream) {
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  METRALE_DISPATCH_FLOAT(x.dtype(), "linear_fp8 x", [&] {
    using XT = scalar_t;
    METRALE_DISPATCH_FLOAT(out.dtype(), "linear_fp8 out", [&] {
      const bool vector = k % fp8_gemv::kChunk == 0 && aligned(weight.data()) && aligned(x.data()) &&
                          (x.stride(0) * static_cast<int64_t>(sizeof(XT))) % 16 == 0;
      for (int64_t r0 = row0; r0 < m; r0 += kRowsPerPass) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsPerPass, m - r0));
        const XT* x_pass = x.data_as<const XT>() + r0 * x.stride(0);
        scalar_t* out_pass = out.data_as<scalar_t>() + r0 * out.stride(0);
        if (vector) {
          launch_vector_pass(x_pass, x.stride(0), rows, weight, scale_inv, out_pass, out.stride(0), accumulate, stream);
        } else {
          fp8_gemv_scalar_kernel<XT, scalar_t><<<ceil_div(n, kScalarWarps), kScalarWarps * 32, 0, stream>>>(
              x_pass, x.stride(0), rows, static_cast<const uint8_t*>(weight.data()), scale_inv.data_as<const float>(),
              scale_inv.size(1), out_pass, out.stride(0), static_cast<int>(n), static_cast<int>(k), accumulate);
        }
      }
    });
  });
  METRALE_CHECK_LAUNCH("fp8_gemv_kernel");
}

// ---------------------------------------------------------------------------------------------
// The FP8 GEMM through cuBLASLt.

constexpr int64_t kMaxGemvRowsSetting = INT_MAX;
// Measured on the H200 (metrale_linear_fp8_bench, 4096 x 4096): the GEMM (activation quantisation
// included) takes 20 us from M = 4 up to 128, the GEMV 34 us at M = 4 and 53 us at M = 8.
constexpr int kDefaultFp8GemvRows = 2;

std::atomic<int>& fp8_gemv_rows_setting() {
  static std::atomic<int> rows = [] {
    int value = kDefaultFp8GemvRows;
    if (const char* text = std::getenv("METRALE_FP8_GEMV_MAX_ROWS")) {
      char* end = nullptr;
      const long parsed = std::strtol(text, &end, 10);
      if (end != text && *end == '\0' && parsed >= 0 && parsed <= kMaxGemvRowsSetting) value = static_cast<int>(parsed);
    }
    return value;
  }();
  return rows;
}

struct PathCounters {
  std::atomic<uint64_t> gemv_calls{0}, gemm_calls{0}, gemm_with_gemv_tail{0}, refused_plans{0};
};

PathCounters& path_counters() {
  static PathCounters counters;
  return counters;
}

std::string& last_refusal_locked() {
  static std::string text;
  return text;
}

std::string status_text(cublasStatus_t status) {
  return std::string(cublasLtGetStatusName(status)) + " (" + cublasLtGetStatusString(status) + ")";
}

void lt_check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    raise_message(ErrorCode::kInternal, std::string("kernel linear_fp8: ") + what + " failed: " + status_text(status));
  }
}

// The largest power of two (<= 256) dividing the address: what cuBLASLt may assume about it.
uint32_t alignment_of(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t alignment = 256;
  while (alignment > 1 && (address % alignment) != 0) alignment >>= 1;
  return alignment;
}

constexpr int64_t round_up(int64_t value, int64_t to) {
  return (value + to - 1) / to * to;
}
constexpr size_t kScratchAlign = 256;
size_t align_bytes(size_t bytes) {
  return (bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
}

// Where one call's pieces lie in the scratch buffer.
struct ScratchLayout {
  size_t codes = 0, act_scales = 0, weight_scales = 0, total = 0;  // byte offsets and the size
  int64_t act_scale_pitch = 0;     // floats between the activation scales' rows (round_up(M, 4))
  int64_t weight_scale_pitch = 0;  // floats between the weight's scale rows (round_up(K/128, 4))
  bool pad_weight_scales = false;  // the checkpoint's scales are not that pitch (or 16-byte aligned): copy them
};

ScratchLayout scratch_layout(int64_t m, int64_t n, int64_t k, bool misaligned_weight_scales) {
  ScratchLayout layout;
  const int64_t k_blocks = fp8_scale_blocks(k);
  layout.act_scales = align_bytes(static_cast<size_t>(m * k));
  layout.act_scale_pitch = round_up(m, 4);
  layout.weight_scales =
      layout.act_scales + align_bytes(static_cast<size_t>(k_blocks * layout.act_scale_pitch) * sizeof(float));
  layout.weight_scale_pitch = round_up(k_blocks, 4);
  layout.pad_weight_scales = layout.weight_scale_pitch != k_blocks || misaligned_weight_scales;
  layout.total = layout.weight_scales;
  if (layout.pad_weight_scales) {
    layout.total += align_bytes(static_cast<size_t>(fp8_scale_blocks(n) * layout.weight_scale_pitch) * sizeof(float));
  }
  return layout;
}

struct Fp8PlanKey {
  int64_t m, n, k, ldc;
  int out_dtype;
  bool accumulate;
  uint32_t align_w, align_out;
  bool operator==(const Fp8PlanKey&) const = default;
};

struct Fp8PlanKeyHash {
  size_t operator()(const Fp8PlanKey& key) const {
    return PlanKeyHasher()
        .mix(static_cast<uint64_t>(key.m))
        .mix(static_cast<uint64_t>(key.n))
        .mix(static_cast<uint64_t>(key.k))
        .mix(static_cast<uint64_t>(key.ldc))
        .mix(static_cast<uint64_t>(key.out_dtype) * 2 + (key.accumulate ? 1 : 0))
        .mix((static_cast<uint64_t>(key.align_w) << 16) ^ key.align_out)
        .value();
  }
};

// Descriptors and the chosen algorithm of one problem (host objects only). The scale pointers are
// descriptor attributes: run() sets them for each call (layers of one shape share the plan).
class Fp8Plan : public LtPlanDescriptors {
 public:
  // Empty when cuBLASLt has an algorithm for the problem, else why not (status names, for the logs).
  // With `shared` (the algorithm of the problem's M bucket), takes it when cublasLtMatmulAlgoCheck
  // accepts it for the exact layouts within the workspace; otherwise asks the heuristic (`queried`).
  std::string build(cublasLtHandle_t handle, const Fp8PlanKey& key, size_t workspace_bytes, const void* w_scales,
                    const void* x_scales, const cublasLtMatmulAlgo_t* shared, bool& queried) {
    queried = false;
    const cudaDataType_t out_type = key.out_dtype == static_cast<int>(DType::kF32) ? CUDA_R_32F : CUDA_R_16BF;
    lt_check(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const cublasOperation_t transpose = CUBLAS_OP_T, no_transpose = CUBLAS_OP_N;
    lt_check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)),
             "set TRANSA");
    lt_check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &no_transpose, sizeof(no_transpose)),
             "set TRANSB");
    const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                  b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    lt_check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)),
             "set A_SCALE_MODE");
    lt_check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)),
             "set B_SCALE_MODE");
    set_scales(w_scales, x_scales);
    // Column-major: A = W stored [K, N] (ld K), B = x codes stored [K, M] (ld K), C = D = out [N, M].
    lt_check(cublasLtMatrixLayoutCreate(&a_, CUDA_R_8F_E4M3, static_cast<uint64_t>(key.k), static_cast<uint64_t>(key.n),
                                        key.k),
             "layout A");
    lt_check(cublasLtMatrixLayoutCreate(&b_, CUDA_R_8F_E4M3, static_cast<uint64_t>(key.k), static_cast<uint64_t>(key.m),
                                        key.k),
             "layout B");
    lt_check(
        cublasLtMatrixLayoutCreate(&c_, out_type, static_cast<uint64_t>(key.n), static_cast<uint64_t>(key.m), key.ldc),
        "layout C");
    lt_check(cublasLtMatmulPreferenceCreate(&preference_), "cublasLtMatmulPreferenceCreate");
    const uint64_t workspace = workspace_bytes;
    lt_check(cublasLtMatmulPreferenceSetAttribute(preference_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                  sizeof(workspace)),
             "set max workspace");
    const uint32_t align_a = key.align_w, align_b = static_cast<uint32_t>(kScratchAlign), align_c = key.align_out;
    lt_check(cublasLtMatmulPreferenceSetAttribute(preference_, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                                  sizeof(align_a)),
             "set alignment A");
    lt_check(cublasLtMatmulPreferenceSetAttribute(preference_, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                                                  sizeof(align_b)),
             "set alignment B");
    lt_check(cublasLtMatmulPreferenceSetAttribute(preference_, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                                  sizeof(align_c)),
             "set alignment C");
    lt_check(cublasLtMatmulPreferenceSetAttribute(preference_, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c,
                                                  sizeof(align_c)),
             "set alignment D");
    if (shared != nullptr && take_checked(handle, *shared, workspace_bytes)) return {};
    queried = true;
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle, op_, a_, b_, c_, c_, preference_, 1, &result, &found);
    if (status != CUBLAS_STATUS_SUCCESS) return "cublasLtMatmulAlgoGetHeuristic returned " + status_text(status);
    if (found == 0) return "cublasLtMatmulAlgoGetHeuristic found no algorithm";
    if (result.state != CUBLAS_STATUS_SUCCESS)
      return "the heuristic's algorithm has state " + status_text(result.state);
    algo_ = result.algo;
    workspace_bytes_ = result.workspaceSize;
    return {};
  }

  const cublasLtMatmulAlgo_t& algo() const { return algo_; }

  // Enqueues the matmul; returns its status (not-supported and invalid-value mean: take the GEMV).
  cublasStatus_t run(cublasLtHandle_t handle, const void* w, const void* w_scales, const void* x_codes,
                     const void* x_scales, void* out, bool accumulate, void* workspace, cudaStream_t stream) {
    set_scales(w_scales, x_scales);
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    return cublasLtMatmul(handle, op_, &alpha, w, a_, x_codes, b_, &beta, out, c_, out, c_, &algo_, workspace,
                          workspace_bytes_, stream);
  }

 private:
  void set_scales(const void* w_scales, const void* x_scales) {
    lt_check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scales, sizeof(w_scales)),
             "set A_SCALE_POINTER");
    lt_check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scales, sizeof(x_scales)),
             "set B_SCALE_POINTER");
  }
};

// One device's FP8 GEMM state. Guarded by cublaslt_mutex().
struct Fp8Device {
  // Problems cuBLASLt has no algorithm for map to nullptr (they take the GEMV).
  std::unordered_map<Fp8PlanKey, std::unique_ptr<Fp8Plan>, Fp8PlanKeyHash> plans;
  // Per M bucket (the key's m is the bucket): the heuristic's algorithm at M = the bucket, tried
  // first by every problem of the bucket; nullopt where cuBLASLt had none.
  std::unordered_map<Fp8PlanKey, std::optional<cublasLtMatmulAlgo_t>, Fp8PlanKeyHash> bucket_algos;
  Buffer scratch;
  bool scratch_captured = false;  // a graph capture has used `scratch`: keep it alive if it is replaced
  std::vector<Buffer> retired;    // earlier scratch buffers that captured graphs still point into
};

Fp8Device& fp8_device_locked(int index) {
  static std::vector<std::unique_ptr<Fp8Device>> devices;
  if (static_cast<int>(devices.size()) <= index) devices.resize(static_cast<size_t>(index) + 1);
  std::unique_ptr<Fp8Device>& slot = devices[static_cast<size_t>(index)];
  if (!slot) slot = std::make_unique<Fp8Device>();
  return *slot;
}

bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  METRALE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  return capture != cudaStreamCaptureStatusNone;
}

// The device's scratch buffer, at least `bytes` long. Grows only outside a graph capture.
void* scratch_locked(Fp8Device& device, int index, size_t bytes, cudaStream_t stream) {
  const bool capturing = is_capturing(stream);
  if (device.scratch.size() < bytes) {
    if (capturing) {
      raise_message(ErrorCode::kInternal,
                    "kernel linear_fp8: the FP8 GEMM's scratch buffer on cuda:" + std::to_string(index) +
                        " would grow to " + std::to_string(bytes) +
                        " bytes during CUDA graph capture; run the same shape once before capturing");
    }
    if (device.scratch_captured) {
      device.retired.push_back(std::move(device.scratch));
    } else {
      device.scratch = Buffer();  // cudaFree waits for the kernels still reading it
    }
    device.scratch = Buffer(Device::cuda(index), bytes);
    device.scratch_captured = false;
  }
  if (capturing) device.scratch_captured = true;
  return device.scratch.data();
}

// out[0:m] = x[0:m] . dequant(W)^T (+ out) through the FP8 GEMM; false where cuBLASLt refuses it
// (nothing was written then).
bool run_fp8_gemm(const Tensor& x, const Tensor& weight, const Tensor& scale_inv, const Tensor& out, bool accumulate,
                  cudaStream_t stream) {
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const int index = out.device().index;
  const Fp8PlanKey key{m,
                       n,
                       k,
                       out.stride(0),
                       static_cast<int>(out.dtype()),
                       accumulate,
                       alignment_of(weight.data()),
                       alignment_of(out.data())};
  const ScratchLayout layout = scratch_layout(m, n, k, alignment_of(scale_inv.data()) < 16);
  std::lock_guard lock(cublaslt_mutex());
  const CublasLtContext lt = cublaslt_context_locked(index, stream);
  Fp8Device& device = fp8_device_locked(index);
  auto it = device.plans.find(key);
  if (it != device.plans.end() && !it->second) return false;
  auto* scratch = static_cast<char*>(scratch_locked(device, index, layout.total, stream));
  void* codes = scratch + layout.codes;
  auto* x_scales = reinterpret_cast<float*>(scratch + layout.act_scales);
  const void* w_scales = scale_inv.data();
  if (layout.pad_weight_scales) {
    void* padded = scratch + layout.weight_scales;
    const size_t pitch = static_cast<size_t>(layout.weight_scale_pitch) * sizeof(float);
    const size_t rows = static_cast<size_t>(scale_inv.size(0)), width = static_cast<size_t>(scale_inv.size(1)) * 4;
    METRALE_CUDA_CHECK(cudaMemsetAsync(padded, 0, pitch * rows, stream));
    METRALE_CUDA_CHECK(
        cudaMemcpy2DAsync(padded, pitch, scale_inv.data(), width, width, rows, cudaMemcpyDeviceToDevice, stream));
    w_scales = padded;
  }
  if (it == device.plans.end()) {
    const auto start = std::chrono::steady_clock::now();
    Fp8PlanKey bucket_key = key;
    bucket_key.m = m_bucket(m);
    auto bucket = device.bucket_algos.find(bucket_key);
    if (bucket == device.bucket_algos.end()) {
      Fp8Plan representative;
      bool queried = false;
      std::optional<cublasLtMatmulAlgo_t> algo;
      if (representative.build(lt.handle, bucket_key, lt.workspace_bytes, w_scales, x_scales, nullptr, queried).empty())
        algo = representative.algo();
      bucket = device.bucket_algos.emplace(bucket_key, algo).first;
    }
    auto plan = std::make_unique<Fp8Plan>();
    bool queried = false;
    const std::string refusal = plan->build(lt.handle, key, lt.workspace_bytes, w_scales, x_scales,
                                            bucket->second ? &*bucket->second : nullptr, queried);
    const std::string shape = "m " + std::to_string(m) + " n " + std::to_string(n) + " k " + std::to_string(k) +
                              " ldc " + std::to_string(key.ldc) + " out " + std::string(dtype_name(out.dtype())) +
                              (accumulate ? " accumulate" : "");
    if (!refusal.empty()) {
      plan.reset();
      path_counters().refused_plans.fetch_add(1, std::memory_order_relaxed);
      last_refusal_locked() = shape + ": " + refusal;
      log_write(LogLevel::kDebug, "linear_fp8: no cuBLASLt FP8 block-scaled GEMM for " + shape + " (" + refusal +
                                      "); the GEMV runs instead");
    } else if (log_level() <= LogLevel::kDebug) {
      const double ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      log_write(LogLevel::kDebug, "cuBLASLt FP8 plan for " + shape + " (bucket " + std::to_string(bucket_key.m) +
                                      "): " + std::to_string(ms) + " ms" +
                                      (queried ? ", heuristic" : ", bucket algorithm"));
    }
    it = device.plans.emplace(key, std::move(plan)).first;
    if (!it->second) return false;
  }
  const Tensor code_view(codes, DType::kF8E4M3, {m, k}, out.device());
  const int64_t k_blocks = fp8_scale_blocks(k);
  if (layout.act_scale_pitch != m) {
    // Defined padding: cuBLASLt may read the scales of the tokens past M (their output is dropped).
    METRALE_CUDA_CHECK(
        cudaMemsetAsync(x_scales, 0, static_cast<size_t>(k_blocks * layout.act_scale_pitch) * 4, stream));
  }
  const Tensor scale_view(x_scales, DType::kF32, {k_blocks, m}, {layout.act_scale_pitch, 1}, out.device());
  quantize_fp8_rows(x, code_view, scale_view);
  const cublasStatus_t status = it->second->run(lt.handle, weight.data(), w_scales, codes, x_scales, out.data(),
                                                accumulate, lt.workspace, stream);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE) {
    // Refused at launch (the matmul was not enqueued): forget the plan, the GEMV takes this shape from now on.
    path_counters().refused_plans.fetch_add(1, std::memory_order_relaxed);
    last_refusal_locked() = "m " + std::to_string(m) + " n " + std::to_string(n) + " k " + std::to_string(k) +
                            ": cublasLtMatmul returned " + status_text(status);
    log_write(LogLevel::kDebug, "linear_fp8: " + last_refusal_locked() + "; the GEMV runs instead");
    it->second.reset();
    return false;
  }
  lt_check(status, "cublasLtMatmul");
  return true;
}

// The GEMM's preconditions apart from cuBLASLt's own choice: bf16 activations (f32 runs keep exact
// ones), 16-byte rows of codes (K % 16) and 16-byte aligned weights and output rows.
bool gemm_candidate(const Tensor& x, const Tensor& weight, const Tensor& out) {
  const int64_t k = x.size(1), n = weight.size(0);
  const auto out_row_bytes = static_cast<int64_t>(out.element_size()) * out.stride(0);
  return x.dtype() == DType::kBF16 && (out.dtype() == DType::kBF16 || out.dtype() == DType::kF32) && k % 16 == 0 &&
         n % 16 == 0 && out_row_bytes % 16 == 0 && alignment_of(weight.data()) >= 16 && alignment_of(out.data()) >= 16;
}

}  // namespace

int fp8_gemv_max_rows() {
  return fp8_gemv_rows_setting().load(std::memory_order_relaxed);
}

void set_fp8_gemv_max_rows(int rows) {
  METRALE_EXPECT(rows >= 0, "fp8_gemv_max_rows must be >= 0");
  fp8_gemv_rows_setting().store(rows, std::memory_order_relaxed);
}

LinearFp8PathCounts linear_fp8_path_counts() {
  LinearFp8PathCounts counts;
  PathCounters& counters = path_counters();
  counts.gemv_calls = counters.gemv_calls.load(std::memory_order_relaxed);
  counts.gemm_calls = counters.gemm_calls.load(std::memory_order_relaxed);
  counts.gemm_with_gemv_tail = counters.gemm_with_gemv_tail.load(std::memory_order_relaxed);
  counts.refused_plans = counters.refused_plans.load(std::memory_order_relaxed);
  std::lock_guard lock(cublaslt_mutex());
  counts.last_refusal = last_refusal_locked();
  return counts;
}

void linear_fp8(const Tensor& x, const Tensor& weight, const Tensor& scale_inv, const Tensor& out, bool accumulate) {
  expect(x.ndim() == 2 && weight.ndim() == 2 && out.ndim() == 2 && scale_inv.ndim() == 2,
         "x, weight, scales and out must be 2-D");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  expect(weight.size(1) == k && out.size(0) == m && out.size(1) == n,
         "shapes x " + x.describe() + " weight " + weight.describe() + " out " + out.describe());
  expect(weight.dtype() == DType::kF8E4M3 && scale_inv.dtype() == DType::kF32 &&
             scale_inv.size(0) == fp8_scale_blocks(n) && scale_inv.size(1) == fp8_scale_blocks(k) &&
             scale_inv.is_contiguous(),
         "weight " + weight.describe() + " with scales " + scale_inv.describe());
  expect(x.device() == out.device() && weight.device() == out.device() && scale_inv.device() == out.device(),
         "tensors on different devices");
  expect(x.stride(1) == 1 && weight.stride(1) == 1 && weight.stride(0) == k && out.stride(1) == 1,
         "needs contiguous rows");
  expect(m < (int64_t{1} << 31) && n < (int64_t{1} << 31) && k < (int64_t{1} << 31), "size over 2^31");
  if (m == 0 || n == 0) return;
  const cudaStream_t stream = stream_of(out);
  int64_t gemm_rows = 0;
  if (m > fp8_gemv_max_rows() && k > 0 && gemm_candidate(x, weight, out)) {
    if (run_fp8_gemm(x, weight, scale_inv, out, accumulate, stream)) {
      gemm_rows = m;
    } else if (const int64_t aligned_rows = m / 16 * 16; aligned_rows != m && aligned_rows > fp8_gemv_max_rows()) {
      // Should cuBLASLt refuse a token count that is not a multiple of 16, the GEMM takes the
      // first M / 16 * 16 rows and the GEMV the rest.
      if (run_fp8_gemm(x.slice(0, 0, aligned_rows), weight, scale_inv, out.slice(0, 0, aligned_rows), accumulate,
                       stream)) {
        gemm_rows = aligned_rows;
      }
    }
  }
  PathCounters& counters = path_counters();
  if (gemm_rows == m) {
    counters.gemm_calls.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (gemm_rows > 0) {
    counters.gemm_with_gemv_tail.fetch_add(1, std::memory_order_relaxed);
  } else {
    counters.gemv_calls.fetch_add(1, std::memory_order_relaxed);
  }
  launch_gemv_rows(x, weight, scale_inv, out, accumulate, gemm_rows, stream);
}

}  // namespace metrale::kernels::cuda
