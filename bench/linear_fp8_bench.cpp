// The FP8 prefill GEMM (kernels::linear_fp8 at M > fp8_gemv_max_rows(): activation quantisation plus
// the cuBLASLt block-scaled FP8 matmul) against the bf16 cuBLASLt GEMM of kernels::linear on the same
// shapes, and against the FP8 GEMV the prefill used before (8 rows a pass). Shapes: (N x K) =
// 4096 x 4096 and 12288 x 4096 at M = 512, 2048, 8192; then the GEMV/GEMM crossover at small M.
// TFLOP/s counts 2 M N K per call, against the H200's dense peaks (785 TFLOP/s bf16, ~1570 FP8).
//
// Timing as bench/glm5_kernel_bench.cpp: an L2 flush of 256 MB before every repetition, CUDA events
// around the call, the median.
// Then the decode GEMVs (M = 1, 2) of both dtypes against the copy bandwidth, first.
// Usage: metrale_linear_fp8_bench [--reps N] [--no-gemv] [--decode-only]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/fp8_quantize.h"
#include "kernels/linear.h"
#include "kernels/linear_fp8.h"
#include "kernels/random_fill.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/stream.h"
#include "runtime/tensor.h"

namespace metrale {
namespace {

constexpr size_t kFlushBytes = size_t{256} << 20;
constexpr double kBf16PeakTflops = 785.0, kFp8PeakTflops = 1570.0;

class Timer {
 public:
  explicit Timer(int reps) : reps_(reps), flush_(DType::kU8, {static_cast<int64_t>(kFlushBytes)}, Device::cuda()) {
    stream_ = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  }
  // Median milliseconds of one call.
  double time(const std::function<void()>& fn) {
    for (int i = 0; i < 3; ++i) fn();
    std::vector<std::unique_ptr<CudaEvent>> starts, stops;
    for (int i = 0; i < reps_; ++i) {
      METRALE_CUDA_CHECK(cudaMemsetAsync(flush_->data(), 0, kFlushBytes, stream_));
      starts.push_back(std::make_unique<CudaEvent>());
      stops.push_back(std::make_unique<CudaEvent>());
      starts.back()->record(stream_);
      fn();
      stops.back()->record(stream_);
    }
    stops.back()->synchronize();
    std::vector<double> ms;
    for (int i = 0; i < reps_; ++i) {
      ms.push_back(stops[static_cast<size_t>(i)]->elapsed_ms_since(*starts[static_cast<size_t>(i)]));
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

 private:
  int reps_;
  OwnedTensor flush_;
  cudaStream_t stream_ = nullptr;
};

OwnedTensor random_device(DType dtype, Shape shape, uint64_t seed) {
  OwnedTensor t(dtype, shape, Device::cuda());
  kernels::RandomFillParams params;
  params.seed = seed;
  params.mean = 0.0f;
  params.stddev = 1.0f;
  kernels::random_fill(*t, params);
  return t;
}

// Random finite e4m3 codes (an xorshift on the host) and scales near 2e-3.
struct Fp8Weight {
  OwnedTensor codes, scales;
};

Fp8Weight random_fp8_weight(int64_t n, int64_t k, uint64_t seed) {
  OwnedTensor host(DType::kF8E4M3, {n, k});
  auto* bytes = static_cast<uint8_t*>(host->data());
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < n * k; ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    uint8_t code = static_cast<uint8_t>(state >> 24);
    if ((code & 0x7fu) == 0x7fu) code = 0x3e;
    bytes[i] = code;
  }
  Fp8Weight w{OwnedTensor(DType::kF8E4M3, {n, k}, Device::cuda()),
              OwnedTensor(DType::kF32, {kernels::fp8_scale_blocks(n), kernels::fp8_scale_blocks(k)})};
  copy_tensor(*w.codes, *host);
  float* scales = w.scales->data_as<float>();
  for (int64_t i = 0; i < w.scales->numel(); ++i) scales[i] = 2e-3f;
  OwnedTensor scales_device(DType::kF32, w.scales->shape(), Device::cuda());
  copy_tensor(*scales_device, *w.scales);
  w.scales = std::move(scales_device);
  return w;
}

double tflops(int64_t m, int64_t n, int64_t k, double ms) {
  return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) / (ms * 1e-3) / 1e12;
}

void report(const char* what, int64_t m, int64_t n, int64_t k, double ms, double peak) {
  const double t = tflops(m, n, k, ms);
  std::printf("  %-28s M %5lld: %9.1f us  %7.1f TFLOP/s  (%4.1f%% of %.0f)\n", what, static_cast<long long>(m),
              ms * 1e3, t, 100.0 * t / peak, peak);
  std::fflush(stdout);
}

const char* fp8_path(const kernels::cuda::LinearFp8PathCounts& before) {
  const auto after = kernels::cuda::linear_fp8_path_counts();
  if (after.gemm_calls > before.gemm_calls) return "GEMM";
  if (after.gemm_with_gemv_tail > before.gemm_with_gemv_tail) return "GEMM+GEMV tail";
  return "GEMV";
}

void bench_shape(Timer& timer, int64_t n, int64_t k, bool with_gemv) {
  std::printf("N %lld x K %lld\n", static_cast<long long>(n), static_cast<long long>(k));
  const Fp8Weight w = random_fp8_weight(n, k, static_cast<uint64_t>(n * 31 + k));
  const OwnedTensor w_bf16 = random_device(DType::kBF16, {n, k}, 17);
  for (const int64_t m : {512, 2048, 8192}) {
    const OwnedTensor x = random_device(DType::kBF16, {m, k}, static_cast<uint64_t>(m));
    const OwnedTensor out(DType::kBF16, {m, n}, Device::cuda());
    report("bf16 cuBLASLt (linear)", m, n, k, timer.time([&] { kernels::linear(*x, *w_bf16, *out); }), kBf16PeakTflops);
    const auto before = kernels::cuda::linear_fp8_path_counts();
    const double fp8_ms = timer.time([&] { kernels::linear_fp8(*x, *w.codes, *w.scales, *out); });
    const std::string label = std::string("fp8 linear_fp8 (") + fp8_path(before) + ")";
    report(label.c_str(), m, n, k, fp8_ms, kFp8PeakTflops);
    if (const auto counts = kernels::cuda::linear_fp8_path_counts(); !counts.last_refusal.empty()) {
      std::printf("    last cuBLASLt refusal: %s\n", counts.last_refusal.c_str());
    }
    OwnedTensor codes(DType::kF8E4M3, {m, k}, Device::cuda());
    OwnedTensor scales(DType::kF32, {kernels::fp8_scale_blocks(k), m}, Device::cuda());
    const double quantise_ms = timer.time([&] { kernels::quantize_fp8_rows(*x, *codes, *scales); });
    std::printf("  %-28s M %5lld: %9.1f us  (%.0f GB/s)\n", "  of which quantize_fp8_rows", static_cast<long long>(m),
                quantise_ms * 1e3, static_cast<double>(m * k * 3) / (quantise_ms * 1e-3) / 1e9);
    if (with_gemv) {
      const int saved = kernels::cuda::fp8_gemv_max_rows();
      kernels::cuda::set_fp8_gemv_max_rows(INT_MAX);
      report("fp8 GEMV, 8 rows a pass", m, n, k,
             timer.time([&] { kernels::linear_fp8(*x, *w.codes, *w.scales, *out); }), kFp8PeakTflops);
      kernels::cuda::set_fp8_gemv_max_rows(saved);
    }
  }
}

// Small M: where the GEMM overtakes the GEMV (METRALE_FP8_GEMV_MAX_ROWS sets the crossover).
void bench_crossover(Timer& timer, int64_t n, int64_t k) {
  std::printf("crossover, N %lld x K %lld (weights %.0f MB)\n", static_cast<long long>(n), static_cast<long long>(k),
              static_cast<double>(n * k) / 1e6);
  const Fp8Weight w = random_fp8_weight(n, k, 5);
  const int saved = kernels::cuda::fp8_gemv_max_rows();
  for (const int64_t m : {1, 2, 4, 8, 16, 32, 64, 128}) {
    const OwnedTensor x = random_device(DType::kBF16, {m, k}, static_cast<uint64_t>(m));
    const OwnedTensor out(DType::kBF16, {m, n}, Device::cuda());
    kernels::cuda::set_fp8_gemv_max_rows(INT_MAX);
    const double gemv_ms = timer.time([&] { kernels::linear_fp8(*x, *w.codes, *w.scales, *out); });
    kernels::cuda::set_fp8_gemv_max_rows(0);
    const auto before = kernels::cuda::linear_fp8_path_counts();
    const double gemm_ms = timer.time([&] { kernels::linear_fp8(*x, *w.codes, *w.scales, *out); });
    std::printf("  M %4lld: GEMV %8.1f us, %s %8.1f us\n", static_cast<long long>(m), gemv_ms * 1e3, fp8_path(before),
                gemm_ms * 1e3);
  }
  kernels::cuda::set_fp8_gemv_max_rows(saved);
}

// Device-to-device copy bandwidth (read + write bytes per second) of 1 GiB: the practical HBM limit.
double copy_bandwidth(Timer& timer) {
  constexpr int64_t kBytes = int64_t{1} << 30;
  const OwnedTensor src(DType::kU8, {kBytes}, Device::cuda()), dst(DType::kU8, {kBytes}, Device::cuda());
  const double ms = timer.time([&] { copy_tensor(*dst, *src); });
  return 2.0 * static_cast<double>(kBytes) / (ms * 1e-3);
}

// Decode (M = 1, 2): the FP8 GEMV against the bf16 GEMV of kernels::linear on the projection shapes
// of Qwen3-8B and Qwen3-Next-80B-A3B, as bytes of weights read per second and as a fraction of the
// copy bandwidth measured in the same run.
void bench_decode(Timer& timer) {
  const double copy = copy_bandwidth(timer);
  std::printf("decode GEMV (copy bandwidth %.0f GB/s)\n", copy / 1e9);
  const int64_t shapes[][2] = {{4096, 4096},  {12288, 4096}, {4096, 12288}, {24576, 4096},
                               {12288, 2048}, {2048, 4096},  {151936, 4096}};
  for (const auto& [n, k] : shapes) {
    const Fp8Weight w = random_fp8_weight(n, k, static_cast<uint64_t>(n + k));
    const OwnedTensor w_bf16 = random_device(DType::kBF16, {n, k}, 23);
    for (const int64_t m : {1, 2}) {
      const OwnedTensor x = random_device(DType::kBF16, {m, k}, static_cast<uint64_t>(m));
      const OwnedTensor out(DType::kBF16, {m, n}, Device::cuda());
      const double bf16_ms = timer.time([&] { kernels::linear(*x, *w_bf16, *out); });
      const double fp8_ms = timer.time([&] { kernels::linear_fp8(*x, *w.codes, *w.scales, *out); });
      const double bytes = static_cast<double>(n * k);
      std::printf(
          "  N %6lld x K %5lld M %lld: bf16 %7.1f us %5.0f GB/s (%4.1f%%) | fp8 %7.1f us %5.0f GB/s (%4.1f%%)\n",
          static_cast<long long>(n), static_cast<long long>(k), static_cast<long long>(m), bf16_ms * 1e3,
          2 * bytes / (bf16_ms * 1e-3) / 1e9, 100.0 * 2 * bytes / (bf16_ms * 1e-3) / copy, fp8_ms * 1e3,
          bytes / (fp8_ms * 1e-3) / 1e9, 100.0 * bytes / (fp8_ms * 1e-3) / copy);
      std::fflush(stdout);
    }
  }
}

int run(int argc, char** argv) {
  int reps = 20;
  bool with_gemv = true, decode_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--no-gemv") == 0) {
      with_gemv = false;
    } else if (std::strcmp(argv[i], "--decode-only") == 0) {
      decode_only = true;
    } else {
      std::fprintf(stderr, "usage: %s [--reps N] [--no-gemv] [--decode-only]\n", argv[0]);
      return 2;
    }
  }
  if (!cuda_available()) {
    std::fprintf(stderr, "metrale_linear_fp8_bench: no GPU\n");
    return 1;
  }
  kernels::linear_prepare(Device::cuda());
  Timer timer(reps);
  bench_decode(timer);
  if (decode_only) return 0;
  bench_shape(timer, 4096, 4096, with_gemv);
  bench_shape(timer, 12288, 4096, with_gemv);
  bench_crossover(timer, 4096, 4096);
  bench_crossover(timer, 12288, 4096);
  synchronize(Device::cuda());
  return 0;
}

}  // namespace
}  // namespace metrale

int main(int argc, char** argv) {
  try {
    return metrale::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "metrale_linear_fp8_bench: %s\n", e.what());
    return 1;
  }
}
