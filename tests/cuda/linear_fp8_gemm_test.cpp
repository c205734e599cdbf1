// The prefill path of CUDA kernels::linear_fp8: activations quantised per token and 128-wide group
// (quantize_fp8_rows, bit for bit against its CPU twin), then the cuBLASLt FP8 GEMM with 128x128
// weight scales. Each case is checked twice: on a few sampled rows against a double-precision host
// product of the same quantised activations (tight: only fp32 accumulation and the output's rounding
// separate them), and on every row against the FP8 GEMV on the exact activations (bounded by the
// activation quantisation error measured on the host for the same rows, plus a margin). Also
// `accumulate` (beta = 1) against the plain product plus the prior output, untouched padding columns,
// the path each shape took (cuBLASLt's refusals printed with its status), and graph capture after a
// warm call, including a capture that would need a larger scratch buffer (it must raise, not allocate).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/cuda_test_helpers.h"
#include "kernels/fp8_quantize.h"
#include "kernels/kernel_helpers.h"
#include "kernels/linear.h"
#include "kernels/linear_fp8.h"
#include "runtime/cuda/cuda_graph.h"
#include "runtime/device.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

using kernels::kFp8Block;
using testing::Random;
using testing::to_device;
using testing::to_host;

// Restores the GEMV/GEMM crossover when a test ends.
class GemvRowsGuard {
 public:
  GemvRowsGuard() : saved_(kernels::cuda::fp8_gemv_max_rows()) {}
  ~GemvRowsGuard() { kernels::cuda::set_fp8_gemv_max_rows(saved_); }
  GemvRowsGuard(const GemvRowsGuard&) = delete;
  GemvRowsGuard& operator=(const GemvRowsGuard&) = delete;

 private:
  int saved_;
};

struct HostFp8Weight {
  OwnedTensor codes;   // [N, K] f8e4m3
  OwnedTensor scales;  // [ceil(N/128), ceil(K/128)] f32
};

HostFp8Weight random_weight(int64_t n, int64_t k, Random& rng) {
  HostFp8Weight w{OwnedTensor(DType::kF8E4M3, {n, k}),
                  OwnedTensor(DType::kF32, {kernels::fp8_scale_blocks(n), kernels::fp8_scale_blocks(k)})};
  auto* codes = static_cast<uint8_t*>(w.codes->data());
  std::uniform_int_distribution<int> byte(0, 255);
  for (int64_t i = 0; i < n * k; ++i) {
    uint8_t code = static_cast<uint8_t>(byte(rng.engine()));
    if ((code & 0x7fu) == 0x7fu) code = 0x3e;  // NaN codes
    codes[i] = code;
  }
  testing::fill_random(*w.scales, rng, 1e-3f, 4e-3f);
  return w;
}

// x row values . dequant(W)^T for one row, in double.
std::vector<double> host_row_product(const std::vector<double>& x_row, const HostFp8Weight& w) {
  const int64_t n = w.codes->size(0), k = w.codes->size(1), scale_cols = w.scales->size(1);
  const auto* codes = static_cast<const uint8_t*>(w.codes->data());
  const float* scales = w.scales->data_as<const float>();
  std::vector<double> table(256);
  for (int c = 0; c < 256; ++c) table[static_cast<size_t>(c)] = f8e4m3_bits_to_f32(static_cast<uint8_t>(c));
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* row = codes + j * k;
    const float* row_scales = scales + (j / kFp8Block) * scale_cols;
    double sum = 0.0;
    for (int64_t g = 0; g * kFp8Block < k; ++g) {
      double partial = 0.0;
      for (int64_t c = g * kFp8Block; c < std::min(k, (g + 1) * kFp8Block); ++c) {
        partial += x_row[static_cast<size_t>(c)] * table[row[c]];
      }
      sum += partial * row_scales[g];
    }
    out[static_cast<size_t>(j)] = sum;
  }
  return out;
}

std::vector<double> doubles_of_row(const Tensor& host, int64_t row) {
  return testing::to_doubles(host.row(row));
}

// The x row after quantisation (codes * scales), from the CPU quantiser.
std::vector<double> quantised_row(const Tensor& codes, const Tensor& scales, int64_t row) {
  const int64_t k = codes.size(1), m = codes.size(0);
  const auto* bytes = static_cast<const uint8_t*>(codes.data()) + row * k;
  const float* scale_values = scales.data_as<const float>();
  std::vector<double> values(static_cast<size_t>(k));
  for (int64_t c = 0; c < k; ++c) {
    values[static_cast<size_t>(c)] =
        static_cast<double>(f8e4m3_bits_to_f32(bytes[c])) * scale_values[(c / kFp8Block) * m + row];
  }
  return values;
}

const char* path_taken(const kernels::cuda::LinearFp8PathCounts& before,
                       const kernels::cuda::LinearFp8PathCounts& after) {
  if (after.gemm_calls > before.gemm_calls) return "cuBLASLt FP8 GEMM";
  if (after.gemm_with_gemv_tail > before.gemm_with_gemv_tail) return "cuBLASLt FP8 GEMM + GEMV tail";
  return "GEMV (cuBLASLt refused or not eligible)";
}

TEST(CudaFp8Quantize, MatchesCpuTwinBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7302);
  for (const DType dtype : {DType::kBF16, DType::kF32}) {
    for (const auto& [m, k] : {std::pair<int64_t, int64_t>{1, 128}, {9, 200}, {300, 4096}, {17, 4104}, {64, 12288}}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " m " << m << " k " << k);
      const int64_t groups = kernels::fp8_scale_blocks(k);
      const OwnedTensor wide = testing::random_tensor(dtype, {m, k + 8}, rng, -5.0f, 5.0f);
      const Tensor x = wide->slice(1, 0, k);
      for (int64_t c = 0; c < std::min<int64_t>(k, kFp8Block); ++c) testing::store_element(dtype, x.data(), c, 0.0f);
      OwnedTensor codes(DType::kF8E4M3, {m, k}), scales(DType::kF32, {groups, m});
      kernels::quantize_fp8_rows(x, *codes, *scales);
      const OwnedTensor wide_device = to_device(*wide);
      const int64_t pitch = (m + 3) / 4 * 4;  // the row pitch cuBLASLt reads
      OwnedTensor codes_device(DType::kF8E4M3, {m, k}, Device::cuda());
      OwnedTensor scale_rows_device(DType::kF32, {groups, pitch}, Device::cuda());
      kernels::quantize_fp8_rows(wide_device->slice(1, 0, k), *codes_device, scale_rows_device->slice(1, 0, m));
      const OwnedTensor codes_got = to_host(*codes_device);
      const OwnedTensor scale_rows_got = to_host(*scale_rows_device);
      int64_t code_mismatches = 0, first = -1;
      for (int64_t i = 0; i < m * k; ++i) {
        if (static_cast<const uint8_t*>(codes_got->data())[i] != static_cast<const uint8_t*>(codes->data())[i]) {
          if (first < 0) first = i;
          ++code_mismatches;
        }
      }
      EXPECT_EQ(code_mismatches, 0) << "first at row " << first / k << " column " << first % k;
      int64_t scale_mismatches = 0;
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t r = 0; r < m; ++r) {
          const float got = scale_rows_got->data_as<const float>()[g * pitch + r];
          const float want = scales->data_as<const float>()[g * m + r];
          if (std::memcmp(&got, &want, sizeof(float)) != 0) ++scale_mismatches;
        }
      }
      EXPECT_EQ(scale_mismatches, 0) << "scales differ";
    }
  }
}

struct GemmCase {
  int64_t n, k;
  bool gemm_expected;  // cuBLASLt documents this shape: the GEMM must run (else only report the path)
};

TEST(CudaLinearFp8Gemm, MatchesReferenceWithinActivationQuantisation) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  kernels::linear_prepare(Device::cuda());
  GemvRowsGuard guard;
  Random rng(7303);
  const GemmCase cases[] = {{4096, 4096, true},  {1536, 4096, true},  {12288, 4096, true},
                            {4096, 12288, true}, {4112, 4096, false},  // N % 128 != 0 (a partial scale block of rows)
                            {1024, 1408, false},                       // ceil(K/128) = 11: the padded weight-scale copy
                            {512, 4160, false}};                       // K % 128 != 0 (a partial scale block along K)
  const int64_t ms[] = {9, 64, 300, 2048};
  constexpr int64_t kOutPad = 8;  // keeps bf16 rows 16-byte aligned
  for (const GemmCase& c : cases) {
    const HostFp8Weight w = random_weight(c.n, c.k, rng);
    const OwnedTensor codes_device = to_device(*w.codes), scales_device = to_device(*w.scales);
    for (const int64_t m : ms) {
      const OwnedTensor x = testing::random_tensor(DType::kBF16, {m, c.k}, rng);
      OwnedTensor x_codes(DType::kF8E4M3, {m, c.k}), x_scales(DType::kF32, {kernels::fp8_scale_blocks(c.k), m});
      kernels::quantize_fp8_rows(*x, *x_codes, *x_scales);
      const OwnedTensor x_device = to_device(*x);
      // Sampled rows on the host: the product of the quantised and of the exact activations.
      std::vector<double> quantised_ref, exact_ref;
      const std::vector<int64_t> sampled = {0, m / 2, m - 1};
      for (const int64_t r : sampled) {
        const std::vector<double> q = host_row_product(quantised_row(*x_codes, *x_scales, r), w);
        const std::vector<double> e = host_row_product(doubles_of_row(*x, r), w);
        quantised_ref.insert(quantised_ref.end(), q.begin(), q.end());
        exact_ref.insert(exact_ref.end(), e.begin(), e.end());
      }
      const double quantisation_error = testing::relative_l2(quantised_ref, exact_ref);
      // Every row: the GEMV on the exact activations, f32 output.
      kernels::cuda::set_fp8_gemv_max_rows(INT_MAX);
      OwnedTensor reference_device(DType::kF32, {m, c.n}, Device::cuda());
      kernels::linear_fp8(*x_device, *codes_device, *scales_device, *reference_device);
      kernels::cuda::set_fp8_gemv_max_rows(8);
      const std::vector<double> reference = testing::to_doubles(*to_host(*reference_device));
      for (const DType out_dtype : {DType::kBF16, DType::kF32}) {
        SCOPED_TRACE(::testing::Message()
                     << "m " << m << " n " << c.n << " k " << c.k << " out " << dtype_name(out_dtype));
        OwnedTensor out_host(out_dtype, {m, c.n + kOutPad});
        testing::poison(*out_host);
        const OwnedTensor out_wide = to_device(*out_host);
        const Tensor out = out_wide->slice(1, 0, c.n);
        const auto before = kernels::cuda::linear_fp8_path_counts();
        kernels::linear_fp8(*x_device, *codes_device, *scales_device, out);
        const auto after = kernels::cuda::linear_fp8_path_counts();
        const char* path = path_taken(before, after);
        std::printf("[fp8 gemm] m %5lld n %5lld k %5lld out %-4s: %s%s%s\n", static_cast<long long>(m),
                    static_cast<long long>(c.n), static_cast<long long>(c.k),
                    std::string(dtype_name(out_dtype)).c_str(), path,
                    after.refused_plans > before.refused_plans ? "; refused: " : "",
                    after.refused_plans > before.refused_plans ? after.last_refusal.c_str() : "");
        if (c.gemm_expected && m % 16 == 0) {
          EXPECT_GT(after.gemm_calls, before.gemm_calls)
              << "the FP8 GEMM did not run (" << path << "); last cuBLASLt refusal: " << after.last_refusal;
        }
        const OwnedTensor got_wide = to_host(*out_wide);
        const Tensor got = got_wide->slice(1, 0, c.n);
        EXPECT_EQ(testing::element_bytes(got_wide->slice(1, c.n, c.n + kOutPad)),
                  testing::element_bytes(out_host->slice(1, c.n, c.n + kOutPad)))
            << "padding columns written";

        std::vector<double> got_rows;
        for (const int64_t r : sampled) {
          const std::vector<double> g = doubles_of_row(got, r);
          got_rows.insert(got_rows.end(), g.begin(), g.end());
        }
        const bool gemm_ran = after.gemm_calls > before.gemm_calls;
        // The GEMM computes on the quantised activations; the GEMV (any row it took) on the exact ones.
        // The FP8 tensor cores accumulate with fewer mantissa bits than fp32 between promotions to
        // fp32 (2.3e-4 relative L2 at K 4096 on the H200), and a bf16 output adds its rounding.
        const double accumulation = 5e-4;
        const double output_rounding =
            out_dtype == DType::kF32 ? accumulation : testing::kBf16OutputTolerance + accumulation;
        if (gemm_ran) {
          EXPECT_TRUE(testing::close_rel_l2(got_rows, quantised_ref, output_rounding))
              << "sampled rows against x_q . W^T on the host (activation quantisation error alone: "
              << quantisation_error << ")";
        }
        const double bound = 1.25 * quantisation_error + output_rounding + 2e-3;
        EXPECT_TRUE(testing::close_rel_l2(got, reference, bound))
            << "all rows against the GEMV on exact x; activation quantisation error " << quantisation_error;
        std::printf("[fp8 gemm]   activation quantisation error %.3e, bound %.3e\n", quantisation_error, bound);

        // accumulate: out = prior + x . W^T, against the plain product just computed.
        const OwnedTensor prior = testing::random_tensor(out_dtype, {m, c.n + kOutPad}, rng, -2.0f, 2.0f);
        const OwnedTensor acc_wide = to_device(*prior);
        kernels::linear_fp8(*x_device, *codes_device, *scales_device, acc_wide->slice(1, 0, c.n), true);
        const OwnedTensor acc_host = to_host(*acc_wide);
        const std::vector<double> plain = testing::to_doubles(got),
                                  before_values = testing::to_doubles(prior->slice(1, 0, c.n));
        std::vector<double> expected(plain.size());
        for (size_t i = 0; i < plain.size(); ++i) expected[i] = plain[i] + before_values[i];
        EXPECT_TRUE(testing::close_rel_l2(acc_host->slice(1, 0, c.n), expected, output_rounding))
            << "accumulate against the plain product plus the prior output";
        EXPECT_EQ(testing::element_bytes(acc_host->slice(1, c.n, c.n + kOutPad)),
                  testing::element_bytes(prior->slice(1, c.n, c.n + kOutPad)))
            << "padding columns written (accumulate)";
      }
    }
  }
}

TEST(CudaLinearFp8Gemm, ReplaysInsideCudaGraph) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  kernels::linear_prepare(Device::cuda());
  GemvRowsGuard guard;
  kernels::cuda::set_fp8_gemv_max_rows(8);
  Random rng(7304);
  const auto stream = static_cast<cudaStream_t>(current_stream(Device::cuda()));
  const int64_t n = 512, k = 1024;
  const HostFp8Weight w = random_weight(n, k, rng);
  const OwnedTensor codes = to_device(*w.codes), scales = to_device(*w.scales);

  // Small graph: warm call, capture, poison, replay; the replay must reproduce the eager bits.
  const int64_t m = 64;
  const OwnedTensor x = to_device(*testing::random_tensor(DType::kBF16, {m, k}, rng));
  const OwnedTensor out(DType::kBF16, {m, n}, Device::cuda());
  const auto before = kernels::cuda::linear_fp8_path_counts();
  kernels::linear_fp8(*x, *codes, *scales, *out);  // eager first: plan and scratch exist before the capture
  std::printf("[fp8 gemm] graph case m %lld: %s\n", static_cast<long long>(m),
              path_taken(before, kernels::cuda::linear_fp8_path_counts()));
  const OwnedTensor eager = to_host(*out);
  CudaGraph graph;
  graph.begin_capture(stream);
  kernels::linear_fp8(*x, *codes, *scales, *out);
  graph.end_capture(stream);
  const auto replay_matches = [&](const char* what) {
    OwnedTensor nan_host(DType::kBF16, {m, n});
    testing::poison(*nan_host);
    copy_tensor(*out, *nan_host);
    graph.launch(stream);
    const OwnedTensor got = to_host(*out);
    EXPECT_EQ(testing::element_bytes(*got), testing::element_bytes(*eager)) << what;
  };
  replay_matches("replay after capture");

  // A capture that needs a larger scratch buffer than any call so far raises instead of allocating.
  const int64_t big_m = 8192, big_k = 8192;
  const HostFp8Weight big_w = random_weight(n, big_k, rng);
  const OwnedTensor big_codes = to_device(*big_w.codes), big_scales = to_device(*big_w.scales);
  const OwnedTensor big_x = to_device(*testing::random_tensor(DType::kBF16, {big_m, big_k}, rng));
  const OwnedTensor big_out(DType::kBF16, {big_m, n}, Device::cuda());
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  bool raised = false;
  try {
    kernels::linear_fp8(*big_x, *big_codes, *big_scales, *big_out);
  } catch (const Error& e) {
    raised = true;
    std::printf("[fp8 gemm] capture without warm-up raised as it must: %s\n", e.what());
  }
  cudaGraph_t broken = nullptr;
  cudaStreamEndCapture(stream, &broken);
  if (broken != nullptr) cudaGraphDestroy(broken);
  const auto counts = kernels::cuda::linear_fp8_path_counts();
  if (counts.gemm_calls > before.gemm_calls) {
    EXPECT_TRUE(raised) << "the capture grew the scratch buffer";
  }

  // Outside a capture the buffer grows; the first graph keeps the buffer it captured and still replays.
  kernels::linear_fp8(*big_x, *big_codes, *big_scales, *big_out);
  synchronize(Device::cuda());
  replay_matches("replay after the scratch buffer grew");
}

}  // namespace
}  // namespace metrale
