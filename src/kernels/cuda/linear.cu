// CUDA linear: out[M, N] = x[M, K] . weight[N, K]^T (+ out with `accumulate`).
//
// Paths, by shape (all accumulate in fp32):
//   - GEMV (M <= gemv_max_rows(), default 2): each warp streams 2 or 4 weight rows once with 16-byte
//     loads, all M input rows go through L1, fp32 partial sums, warp-shuffle reduction. Bandwidth
//     bound: the weight bytes are the cost (see gemm_gemv.cuh).
//   - cuBLASLt (larger M; f32 operands at any M): row-major y = x . W^T is the column-major product
//     y^T = W . x^T, i.e. a column-major GEMM with m = N, n = M, k = K, A = W read transposed (W's
//     row-major [N, K] is a column-major [K, N] with ld K), B = x (column-major [K, M] with ld = x's
//     row stride), and C = D = out (column-major [N, M] with ld = out's row stride).
//     f32 operands (an f32 run) take CUBLAS_COMPUTE_32F, which never rounds to TF32: products and
//     sums stay IEEE fp32, as the CPU reference.
//   - a simple warp-per-output kernel for everything else (mixed or f16 operands, K % 8 != 0,
//     misaligned rows): correct, not fast.
//
// Crossover, measured on the H200 (CudaLinearBench, Qwen3-8B shapes): the GEMV streams 3.0-4.4 TB/s
// at M = 1 and 2.8-4.4 TB/s at M = 2, but only 2.0-3.5 TB/s at M = 4 and 1.3-2.0 TB/s at M = 8,
// where cuBLASLt already reaches 2.3-4.2 TB/s (M = 16 timings). So M <= 2 takes the GEMV.
// METRALE_GEMV_MAX_ROWS (<= 16) overrides it.
#include <cublasLt.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/log_level.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cublaslt_context.cuh"
#include "kernels/cuda/gemm_gemv.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/linear.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kMaxGemvRows = 16;
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

std::atomic<int>& gemv_rows_setting() {
  static std::atomic<int> rows = [] {
    int value = 2;
    if (const char* text = std::getenv("METRALE_GEMV_MAX_ROWS")) {
      char* end = nullptr;
      const long parsed = std::strtol(text, &end, 10);
      if (end != text && *end == '\0' && parsed >= 0 && parsed <= kMaxGemvRows) value = static_cast<int>(parsed);
    }
    return value;
  }();
  return rows;
}

[[noreturn]] void fail(const std::string& message) { raise_message(ErrorCode::kInternal, "linear: " + message); }

bool aligned_16(const void* pointer) { return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0; }

// The largest power of two (<= 256) dividing the address: what cuBLASLt may assume about it.
uint32_t alignment_of(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  uint32_t alignment = 256;
  while (alignment > 1 && (address % alignment) != 0) alignment >>= 1;
  return alignment;
}

// ---------------------------------------------------------------------------------------------
// GEMV: grid = ceil(N / (R * kGemvWarps)) blocks of kGemvWarps warps; warp w of block b owns
// weight rows [(b * kGemvWarps + w) * R, ... + R).

constexpr int kGemvWarps = 4;

template <int R, int M, int U, typename OutT>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_kernel(const __nv_bfloat16* x, int64_t x_stride, int m, const __nv_bfloat16* __restrict__ w,
                int n, int k, OutT* out, int64_t out_stride, bool accumulate) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kGemvWarps + warp) * R;
  if (row0 >= n) return;
  const __nv_bfloat16* w_rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) w_rows[r] = w + static_cast<int64_t>(min(row0 + r, n - 1)) * k;  // clamped: read, not written
  const __nv_bfloat16* x_rows[M];
#pragma unroll
  for (int i = 0; i < M; ++i) x_rows[i] = x + static_cast<int64_t>(min(i, m - 1)) * x_stride;
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < M; ++i) acc[r][i] = 0.0f;
  }
  gemv::warp_dot_partial<R, M, U>(w_rows, x_rows, m, k / gemv::kChunk, lane, acc, pdl::WaitForInputs{});
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

template <int R, int M, int U, typename OutT>
void launch_gemv_shape(const Tensor& x, const Tensor& weight, const Tensor& out, bool accumulate, cudaStream_t stream) {
  const int m = static_cast<int>(x.size(0)), n = static_cast<int>(weight.size(0)), k = static_cast<int>(x.size(1));
  const int blocks = ceil_div(n, static_cast<int64_t>(R) * kGemvWarps);
  pdl::launch(gemv_kernel<R, M, U, OutT>, dim3(blocks), dim3(kGemvWarps * 32), 0, stream,
              x.data_as<const __nv_bfloat16>(), x.stride(0), m, weight.data_as<const __nv_bfloat16>(), n, k,
              out.data_as<OutT>(), out.stride(0), accumulate);
  METRALE_CHECK_LAUNCH("gemv_kernel");
}

// Per-M configurations: rows per warp R and chunks in flight per row U. R * U 16-byte loads are in
// flight per lane; the input chunks (U * M) and accumulators (R * M) bound the register use.
template <typename OutT>
void launch_gemv(const Tensor& x, const Tensor& weight, const Tensor& out, bool accumulate, cudaStream_t stream) {
  const int64_t m = x.size(0);
  if (m == 1) return launch_gemv_shape<2, 1, 8, OutT>(x, weight, out, accumulate, stream);
  if (m == 2) return launch_gemv_shape<2, 2, 4, OutT>(x, weight, out, accumulate, stream);
  if (m == 3) return launch_gemv_shape<4, 3, 2, OutT>(x, weight, out, accumulate, stream);
  if (m == 4) return launch_gemv_shape<4, 4, 2, OutT>(x, weight, out, accumulate, stream);
  if (m <= 8) return launch_gemv_shape<4, 8, 2, OutT>(x, weight, out, accumulate, stream);
  return launch_gemv_shape<4, 16, 1, OutT>(x, weight, out, accumulate, stream);
}

// ---------------------------------------------------------------------------------------------
// Simple path: one warp per output element, any float dtypes.

template <typename XT, typename WT, typename OutT>
__global__ void linear_simple_kernel(const XT* __restrict__ x, int64_t x_stride, const WT* __restrict__ w, OutT* out,
                                     int64_t out_stride, int m, int n, int k, bool accumulate) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t total = static_cast<int64_t>(m) * n;
  for (int64_t index = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; index < total;
       index += warps) {
    const int64_t row = index / n, col = index % n;
    float sum = 0.0f;
    for (int i = lane; i < k; i += 32) sum = fmaf(to_f32(x[row * x_stride + i]), to_f32(w[col * k + i]), sum);
    sum = warp_sum(sum);
    if (lane == 0) {
      OutT* at = out + row * out_stride + col;
      *at = from_f32<OutT>(accumulate ? sum + to_f32(*at) : sum);
    }
  }
}

void launch_simple(const Tensor& x, const Tensor& weight, const Tensor& out, bool accumulate, cudaStream_t stream) {
  const int m = static_cast<int>(x.size(0)), n = static_cast<int>(weight.size(0)), k = static_cast<int>(x.size(1));
  const int64_t warps = static_cast<int64_t>(m) * n;
  const int blocks = static_cast<int>(std::min<int64_t>((warps + 7) / 8, 132 * 64));
  METRALE_DISPATCH_FLOAT(x.dtype(), "linear x", [&] {
    using XT = scalar_t;
    METRALE_DISPATCH_FLOAT(weight.dtype(), "linear weight", [&] {
      using WT = scalar_t;
      METRALE_DISPATCH_FLOAT(out.dtype(), "linear out", [&] {
        linear_simple_kernel<XT, WT, scalar_t><<<blocks, 256, 0, stream>>>(
            x.data_as<const XT>(), x.stride(0), weight.data_as<const WT>(), out.data_as<scalar_t>(), out.stride(0), m,
            n, k, accumulate);
      });
    });
  });
  METRALE_CHECK_LAUNCH("linear_simple_kernel");
}

// ---------------------------------------------------------------------------------------------
// cuBLASLt: one handle and one workspace per device, plans cached per problem.

void lt_check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    fail(std::string(what) + " failed: " + cublasLtGetStatusName(status) + " (" + cublasLtGetStatusString(status) + ")");
  }
}

struct LtPlanKey {
  int64_t m, n, k, lda, ldc;
  int in_dtype;  // of x and the weight: bf16 or f32
  int out_dtype;
  bool accumulate;
  uint32_t align_x, align_w, align_out;
  bool operator==(const LtPlanKey&) const = default;
};

struct LtPlanKeyHash {
  size_t operator()(const LtPlanKey& key) const {
    return PlanKeyHasher()
        .mix(static_cast<uint64_t>(key.m))
        .mix(static_cast<uint64_t>(key.n))
        .mix(static_cast<uint64_t>(key.k))
        .mix(static_cast<uint64_t>(key.lda))
        .mix(static_cast<uint64_t>(key.ldc))
        .mix(static_cast<uint64_t>(key.in_dtype) * 64 + static_cast<uint64_t>(key.out_dtype) * 2 +
             (key.accumulate ? 1 : 0))
        .mix((static_cast<uint64_t>(key.align_x) << 32) ^ (static_cast<uint64_t>(key.align_w) << 16) ^ key.align_out)
        .value();
  }
};

// Descriptors and the chosen algorithm of one problem (host objects only).
class LtPlan : public LtPlanDescriptors {
 public:
  // With `shared` (the algorithm of the problem's M bucket): takes it if cublasLtMatmulAlgoCheck
  // accepts it for the exact layouts within the workspace, and otherwise (or without `shared`)
  // asks the heuristic. Returns false when cuBLASLt has no algorithm for the problem. `queried`
  // says whether the heuristic was asked.
  bool build(cublasLtHandle_t handle, const LtPlanKey& key, const cublasLtMatmulAlgo_t* shared, bool& queried) {
    queried = false;
    const cudaDataType_t out_type = key.out_dtype == static_cast<int>(DType::kF32) ? CUDA_R_32F : CUDA_R_16BF;
    const cudaDataType_t in_type = key.in_dtype == static_cast<int>(DType::kF32) ? CUDA_R_32F : CUDA_R_16BF;
    // CUBLAS_COMPUTE_32F (not ..._FAST_TF32): fp32 operands are multiplied in full fp32.
    lt_check(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const cublasOperation_t transpose = CUBLAS_OP_T, no_transpose = CUBLAS_OP_N;
    lt_check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)),
             "set TRANSA");
    lt_check(cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &no_transpose, sizeof(no_transpose)),
             "set TRANSB");
    // Column-major: A = W stored [K, N] (ld K), B = x stored [K, M] (ld lda), C = D = out [N, M] (ld ldc).
    lt_check(
        cublasLtMatrixLayoutCreate(&a_, in_type, static_cast<uint64_t>(key.k), static_cast<uint64_t>(key.n), key.k),
        "layout A");
    lt_check(
        cublasLtMatrixLayoutCreate(&b_, in_type, static_cast<uint64_t>(key.k), static_cast<uint64_t>(key.m), key.lda),
        "layout B");
    lt_check(cublasLtMatrixLayoutCreate(&c_, out_type, static_cast<uint64_t>(key.n), static_cast<uint64_t>(key.m),
                                        key.ldc),
             "layout C");
    lt_check(cublasLtMatmulPreferenceCreate(&preference_), "cublasLtMatmulPreferenceCreate");
    const uint64_t workspace = kCublasWorkspaceBytes;
    lt_check(cublasLtMatmulPreferenceSetAttribute(preference_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                  sizeof(workspace)),
             "set max workspace");
    const uint32_t align_a = key.align_w, align_b = key.align_x, align_c = key.align_out;
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
    if (shared != nullptr && take_checked(handle, *shared, kCublasWorkspaceBytes)) return true;
    queried = true;
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(handle, op_, a_, b_, c_, c_, preference_, 1, &result, &found);
    if (status != CUBLAS_STATUS_SUCCESS || found == 0 || result.state != CUBLAS_STATUS_SUCCESS) return false;
    algo_ = result.algo;
    workspace_bytes_ = result.workspaceSize;
    return true;
  }

  const cublasLtMatmulAlgo_t& algo() const { return algo_; }

  void run(cublasLtHandle_t handle, const void* x, const void* w, void* out, bool accumulate, void* workspace,
           cudaStream_t stream) const {
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    lt_check(cublasLtMatmul(handle, op_, &alpha, w, a_, x, b_, &beta, out, c_, out, c_, &algo_, workspace,
                            workspace_bytes_, stream),
             "cublasLtMatmul");
  }
};

struct LtDevice {
  cublasLtHandle_t handle = nullptr;
  Buffer workspace;
  // Problems cuBLASLt has no algorithm for map to nullptr (they take the simple path).
  std::unordered_map<LtPlanKey, std::unique_ptr<LtPlan>, LtPlanKeyHash> plans;
  // Per M bucket (the key's m is the bucket): the heuristic's algorithm for M = the bucket, which
  // every problem of the bucket tries first; nullopt where cuBLASLt had none.
  std::unordered_map<LtPlanKey, std::optional<cublasLtMatmulAlgo_t>, LtPlanKeyHash> bucket_algos;
  LinearPlanStats stats;

  LtDevice() = default;
  LtDevice(const LtDevice&) = delete;
  LtDevice& operator=(const LtDevice&) = delete;
  ~LtDevice() {
    plans.clear();
    if (handle != nullptr) cublasLtDestroy(handle);
  }
};

std::mutex& lt_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::vector<std::unique_ptr<LtDevice>>& lt_devices() {
  static std::vector<std::unique_ptr<LtDevice>> devices;
  return devices;
}

// The device's cuBLASLt state, created on first use. Caller holds lt_mutex(). `stream` (may be
// null) is checked for an active capture before anything is allocated.
LtDevice& lt_device_locked(int index, cudaStream_t stream) {
  auto& devices = lt_devices();
  if (static_cast<int>(devices.size()) <= index) devices.resize(static_cast<size_t>(index) + 1);
  std::unique_ptr<LtDevice>& slot = devices[static_cast<size_t>(index)];
  if (slot) return *slot;
  if (stream != nullptr) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    METRALE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      fail("the cuBLASLt handle and workspace of cuda:" + std::to_string(index) +
           " would be created during CUDA graph capture; call kernels::linear_prepare(device) before capturing");
    }
  }
  auto state = std::make_unique<LtDevice>();
  METRALE_CUDA_CHECK(cudaSetDevice(index));
  lt_check(cublasLtCreate(&state->handle), "cublasLtCreate");
  state->workspace = Buffer(Device::cuda(index), kCublasWorkspaceBytes);
  slot = std::move(state);
  return *slot;
}

// The plan of an exact problem (nullptr: cuBLASLt has none), from its M bucket's algorithm when
// that one passes the check. Caller holds lt_mutex().
std::unique_ptr<LtPlan> build_plan(LtDevice& device, const LtPlanKey& key) {
  const auto start = std::chrono::steady_clock::now();
  LtPlanKey bucket_key = key;
  bucket_key.m = m_bucket(key.m);
  auto bucket = device.bucket_algos.find(bucket_key);
  if (bucket == device.bucket_algos.end()) {
    LtPlan representative;
    bool queried = false;
    std::optional<cublasLtMatmulAlgo_t> algo;
    if (representative.build(device.handle, bucket_key, nullptr, queried)) algo = representative.algo();
    ++device.stats.heuristic_queries;
    bucket = device.bucket_algos.emplace(bucket_key, algo).first;
  }
  auto plan = std::make_unique<LtPlan>();
  bool queried = false;
  const bool built = plan->build(device.handle, key, bucket->second ? &*bucket->second : nullptr, queried);
  ++device.stats.plans;
  if (queried) ++device.stats.heuristic_queries;
  if (!queried && built) ++device.stats.bucket_algorithms_taken;
  if (log_level() <= LogLevel::kDebug) {
    const double ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    log_write(LogLevel::kDebug, "cuBLASLt plan " + std::to_string(device.plans.size() + 1) + " for m " +
                                    std::to_string(key.m) + " (bucket " + std::to_string(bucket_key.m) + ") n " +
                                    std::to_string(key.n) + " k " + std::to_string(key.k) + ": " +
                                    std::to_string(ms) + " ms" + (queried ? ", heuristic" : ", bucket algorithm"));
  }
  return built ? std::move(plan) : nullptr;
}

// Runs the product through cuBLASLt; false when cuBLASLt has no algorithm for it.
bool run_cublaslt(const Tensor& x, const Tensor& weight, const Tensor& out, bool accumulate, cudaStream_t stream) {
  const LtPlanKey key{x.size(0),
                      weight.size(0),
                      x.size(1),
                      x.stride(0),
                      out.stride(0),
                      static_cast<int>(x.dtype()),
                      static_cast<int>(out.dtype()),
                      accumulate,
                      alignment_of(x.data()),
                      alignment_of(weight.data()),
                      alignment_of(out.data())};
  std::lock_guard lock(lt_mutex());
  LtDevice& device = lt_device_locked(out.device().index, stream);
  auto it = device.plans.find(key);
  if (it == device.plans.end()) it = device.plans.emplace(key, build_plan(device, key)).first;
  if (!it->second) return false;
  it->second->run(device.handle, x.data(), weight.data(), out.data(), accumulate, device.workspace.data(), stream);
  return true;
}

}  // namespace

std::mutex& cublaslt_mutex() { return lt_mutex(); }

CublasLtContext cublaslt_context_locked(int device_index, cudaStream_t stream) {
  LtDevice& device = lt_device_locked(device_index, stream);
  return {device.handle, device.workspace.data(), kCublasWorkspaceBytes};
}

void linear_prepare(int device_index) {
  std::lock_guard lock(lt_mutex());
  lt_device_locked(device_index, nullptr);
}

LinearPlanStats linear_plan_stats(int device_index) {
  std::lock_guard lock(lt_mutex());
  return lt_device_locked(device_index, nullptr).stats;
}

int gemv_max_rows() { return gemv_rows_setting().load(std::memory_order_relaxed); }

void set_gemv_max_rows(int rows) {
  METRALE_EXPECT(rows >= 0 && rows <= kMaxGemvRows, "gemv_max_rows must be in [0, 16]");
  gemv_rows_setting().store(rows, std::memory_order_relaxed);
}

void linear(const Tensor& x, const Tensor& weight, const Tensor& out, bool accumulate) {
  METRALE_EXPECT(x.ndim() == 2 && weight.ndim() == 2 && out.ndim() == 2, "linear: x, weight and out must be 2-D");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  if (weight.size(1) != k || out.size(0) != m || out.size(1) != n) {
    fail("shapes x " + x.describe() + " weight " + weight.describe() + " out " + out.describe());
  }
  METRALE_EXPECT(x.device() == out.device() && weight.device() == out.device(), "linear: tensors on different devices");
  METRALE_EXPECT(x.stride(1) == 1 && weight.stride(1) == 1 && weight.stride(0) == k && out.stride(1) == 1 &&
                     x.stride(0) >= k && out.stride(0) >= n,
                 "linear needs contiguous rows");
  METRALE_EXPECT(m < (int64_t{1} << 31) && n < (int64_t{1} << 31) && k < (int64_t{1} << 31), "linear: size over 2^31");
  if (m == 0 || n == 0) return;
  const cudaStream_t stream = stream_of(out);
  const bool bf16_operands = x.dtype() == DType::kBF16 && weight.dtype() == DType::kBF16 &&
                             (out.dtype() == DType::kF32 || out.dtype() == DType::kBF16);
  const bool vectorizable = k % gemv::kChunk == 0 && x.stride(0) % gemv::kChunk == 0 && aligned_16(x.data()) &&
                            aligned_16(weight.data());
  // f32 x and weight with an f32 out (f32 runs): cuBLASLt at every M; no GEMV for fp32 weights.
  const bool f32_operands = x.dtype() == DType::kF32 && weight.dtype() == DType::kF32 && out.dtype() == DType::kF32;
  if (f32_operands && k > 0 && run_cublaslt(x, weight, out, accumulate, stream)) return;
  if (bf16_operands && k > 0) {
    if (m <= gemv_max_rows()) {
      if (vectorizable) {
        if (out.dtype() == DType::kF32) {
          launch_gemv<float>(x, weight, out, accumulate, stream);
        } else {
          launch_gemv<__nv_bfloat16>(x, weight, out, accumulate, stream);
        }
        return;
      }
    } else if (run_cublaslt(x, weight, out, accumulate, stream)) {
      return;
    }
  }
  launch_simple(x, weight, out, accumulate, stream);
}

}  // namespace metrale::kernels::cuda
