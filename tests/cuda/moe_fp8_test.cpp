// The CUDA MoE expert ops over FP8 experts (e4m3 codes, fp32 128x128 block scales, fused layout)
// against their CPU twins on the same codes and scales: the decode kernels that dequantise in
// registers (decode-sized batches), and the grouped GEMM whose B tiles are dequantised to bf16 on
// the way into shared memory (prefill). Shapes with partial scale blocks (I 208, H 144; the FP8
// kernels need multiples of 16), one expert, empty experts, the Qwen3-Next expert shape (H 2048,
// I 512, top-10; 16 experts, so that the host reference stays quick) and its 512-expert routing at
// a smaller expert size.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "cuda/cuda_test_helpers.h"
#include "kernels/fp8_expert_helpers.h"
#include "kernels/kernel_helpers.h"
#include "kernels/moe.h"
#include "runtime/device.h"

namespace metrale {
namespace {

using testing::Random;
using testing::to_device;
using testing::to_host;

std::vector<int32_t> routes(int64_t tokens, int64_t k, int64_t used, Random& rng) {
  std::vector<int32_t> ids, pool(static_cast<size_t>(used));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng.engine());
    ids.insert(ids.end(), pool.begin(), pool.begin() + k);
  }
  return ids;
}

// The FP8 experts on the device, as the Moe block lays them out there.
struct DeviceFp8Experts {
  OwnedTensor gate_up, gate_up_scale, down, down_scale;
  kernels::MoeExpertWeights weights;
  explicit DeviceFp8Experts(const testing::Fp8Experts& host)
      : gate_up(to_device(*host.gate_up)),
        gate_up_scale(to_device(*host.gate_up_scale)),
        down(to_device(*host.down)),
        down_scale(to_device(*host.down_scale)) {
    weights = kernels::MoeExpertWeights::from_fused_fp8(*gate_up, *gate_up_scale, *down, *down_scale);
    weights.swiglu_limit = host.fp8.swiglu_limit;
  }
};

OwnedTensor poisoned_device(DType dtype, Shape shape) {
  OwnedTensor host(dtype, shape);
  testing::poison(*host);
  return to_device(*host);
}

struct Case {
  int64_t tokens, k, experts, hidden, inter;
  float limit;
};

TEST(CudaMoeFp8Decode, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7401);
  for (const Case c : {Case{1, 10, 16, 2048, 512, 0.0f}, Case{6, 10, 512, 256, 128, 0.0f},
                       Case{3, 2, 5, 144, 208, 0.0f}, Case{2, 4, 9, 128, 48, 7.0f}, Case{1, 1, 1, 16, 16, 0.0f}}) {
    for (const DType x_dtype : {DType::kBF16, DType::kF32}) {
      SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " k " << c.k << " E " << c.experts << " H " << c.hidden
                                        << " I " << c.inter << " x " << dtype_name(x_dtype));
      auto host = testing::random_fp8_experts(c.experts, c.hidden, c.inter, rng);
      host->fp8.swiglu_limit = c.limit;
      const DeviceFp8Experts device(*host);
      const OwnedTensor x_wide = testing::random_tensor(x_dtype, {c.tokens, c.hidden + 16}, rng);
      const Tensor x = x_wide->slice(1, 0, c.hidden);
      std::vector<int32_t> ids = routes(c.tokens, c.k, c.experts, rng);
      const Tensor ids_host(ids.data(), DType::kI32, {c.tokens, c.k});
      const int64_t slots = c.tokens * c.k;
      OwnedTensor h(DType::kF32, {slots, c.inter}), y(DType::kF32, {slots, c.hidden});
      kernels::moe_decode_gate_up(x, ids_host, host->fp8, *h);
      kernels::moe_decode_down(*h, ids_host, host->fp8, *y);

      const OwnedTensor x_device = to_device(*x_wide), ids_device = to_device(ids_host);
      const OwnedTensor h_device = poisoned_device(DType::kF32, {slots, c.inter});
      const OwnedTensor y_device = poisoned_device(DType::kF32, {slots, c.hidden});
      kernels::moe_decode_gate_up(x_device->slice(1, 0, c.hidden), *ids_device, device.weights, *h_device);
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*h_device), testing::to_doubles(*h), 1e-5));
      copy_tensor(*h_device, *h);  // the down projection from the same h on both sides
      kernels::moe_decode_down(*h_device, *ids_device, device.weights, *y_device);
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*y_device), testing::to_doubles(*y), 1e-5));
    }
  }
}

// The fused decode ops over FP8 experts (the shared expert as one more slot per token, and
// moe_decode_down_combine) against their CPU twins; the last of E + 1 experts plays the shared one.
TEST(CudaMoeFp8DecodeFused, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7404);
  for (const Case c : {Case{1, 10, 16, 2048, 512, 0.0f}, Case{6, 10, 24, 256, 128, 0.0f}, Case{3, 2, 5, 144, 208, 0.0f},
                       Case{2, 8, 9, 4096, 256, 7.0f}}) {
    for (const bool gated : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " k " << c.k << " E " << c.experts << " H " << c.hidden
                                        << " I " << c.inter << " gated " << gated);
      auto host = testing::random_fp8_experts(c.experts + 1, c.hidden, c.inter, rng);
      const DeviceFp8Experts device(*host);
      const auto routed_of = [&](const OwnedTensor& gate_up, const OwnedTensor& gate_up_scale, const OwnedTensor& down,
                                 const OwnedTensor& down_scale) {
        kernels::MoeExpertWeights w = kernels::MoeExpertWeights::from_fused_fp8(
            gate_up->slice(0, 0, c.experts), gate_up_scale->slice(0, 0, c.experts), down->slice(0, 0, c.experts),
            down_scale->slice(0, 0, c.experts));
        w.swiglu_limit = c.limit;
        return w;
      };
      const kernels::MoeExpertWeights routed_host =
          routed_of(host->gate_up, host->gate_up_scale, host->down, host->down_scale);
      const kernels::MoeExpertWeights routed_device =
          routed_of(device.gate_up, device.gate_up_scale, device.down, device.down_scale);
      const auto e = static_cast<size_t>(c.experts);
      const kernels::MoeSharedExpert shared_host{host->fp8.gate[e], host->fp8.up[e], host->fp8.down[e]};
      const kernels::MoeSharedExpert shared_device{device.weights.gate[e], device.weights.up[e],
                                                   device.weights.down[e]};
      const OwnedTensor x_wide = testing::random_tensor(DType::kBF16, {c.tokens, c.hidden + 16}, rng);
      const Tensor x = x_wide->slice(1, 0, c.hidden);
      std::vector<int32_t> ids = routes(c.tokens, c.k, c.experts, rng);
      const Tensor ids_host(ids.data(), DType::kI32, {c.tokens, c.k});
      const OwnedTensor weights = testing::random_tensor(DType::kF32, {c.tokens, c.k}, rng, 0.0f, 1.0f);
      const OwnedTensor gate = testing::random_tensor(DType::kF32, {c.tokens, 1}, rng, -3.0f, 3.0f);
      const int64_t rows = c.tokens * c.k + c.tokens;
      OwnedTensor h(DType::kF32, {rows, c.inter}), out(DType::kBF16, {c.tokens, c.hidden});
      kernels::moe_decode_gate_up(x, ids_host, routed_host, *h, shared_host);

      const OwnedTensor x_device = to_device(*x_wide), ids_device = to_device(ids_host);
      const OwnedTensor h_device = poisoned_device(DType::kF32, {rows, c.inter});
      kernels::moe_decode_gate_up(x_device->slice(1, 0, c.hidden), *ids_device, routed_device, *h_device,
                                  shared_device);
      EXPECT_TRUE(testing::close_rel_l2(*to_host(*h_device), testing::to_doubles(*h), 1e-5));
      copy_tensor(*h_device, *h);
      kernels::moe_decode_down_combine(*h, ids_host, *weights, routed_host, shared_host, gated ? *gate : Tensor(),
                                       *out);
      const OwnedTensor out_device = poisoned_device(DType::kBF16, {c.tokens, c.hidden});
      kernels::moe_decode_down_combine(*h_device, *ids_device, *to_device(*weights), routed_device, shared_device,
                                       gated ? *to_device(*gate) : Tensor(), *out_device);
      EXPECT_TRUE(
          testing::close_rel_l2(*to_host(*out_device), testing::to_doubles(*out), testing::kBf16OutputTolerance));
    }
  }
}

TEST(CudaMoeFp8Grouped, MatchesCpuTwin) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7402);
  for (const Case c :
       {Case{100, 10, 16, 2048, 512, 0.0f}, Case{100, 10, 512, 256, 128, 0.0f}, Case{37, 2, 6, 144, 208, 0.0f},
        Case{1, 1, 1, 16, 16, 0.0f}, Case{300, 2, 3, 256, 208, 5.0f}, Case{64, 2, 8, 528, 144, 0.0f}}) {
    SCOPED_TRACE(::testing::Message() << "T " << c.tokens << " k " << c.k << " E " << c.experts << " H " << c.hidden
                                      << " I " << c.inter);
    auto host = testing::random_fp8_experts(c.experts, c.hidden, c.inter, rng);
    host->fp8.swiglu_limit = c.limit;
    const DeviceFp8Experts device(*host);
    const OwnedTensor x_wide = testing::random_tensor(DType::kBF16, {c.tokens, c.hidden + 16}, rng);
    const Tensor x = x_wide->slice(1, 0, c.hidden);
    const int64_t used = c.experts > c.k ? c.experts - 1 : c.experts;  // one expert left empty when possible
    std::vector<int32_t> ids = routes(c.tokens, c.k, used, rng);
    const Tensor ids_host(ids.data(), DType::kI32, {c.tokens, c.k});
    const int64_t slots = c.tokens * c.k;
    OwnedTensor offsets(DType::kI32, {c.experts + 1}), sorted(DType::kI32, {slots});
    OwnedTensor scratch(DType::kI32, {kernels::moe_sort_scratch_elements(slots, c.experts)});
    kernels::moe_sort(ids_host, *offsets, *sorted, *scratch);
    OwnedTensor h(DType::kBF16, {slots, c.inter}), y(DType::kF32, {slots, c.hidden});
    kernels::moe_grouped_gate_up(x, *sorted, *offsets, static_cast<int>(c.k), host->fp8, *h);
    kernels::moe_grouped_down(*h, *sorted, *offsets, host->fp8, *y);

    const OwnedTensor x_device = to_device(*x_wide);
    const OwnedTensor offsets_device = to_device(*offsets), sorted_device = to_device(*sorted);
    const OwnedTensor h_device = poisoned_device(DType::kBF16, {slots, c.inter});
    const OwnedTensor y_device = poisoned_device(DType::kF32, {slots, c.hidden});
    kernels::moe_grouped_gate_up(x_device->slice(1, 0, c.hidden), *sorted_device, *offsets_device,
                                 static_cast<int>(c.k), device.weights, *h_device);
    // The GPU rounds the dequantised weights to bf16 for the tensor cores; h is stored in bf16.
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*h_device), testing::to_doubles(*h), 1e-2));
    copy_tensor(*h_device, *h);
    kernels::moe_grouped_down(*h_device, *sorted_device, *offsets_device, device.weights, *y_device);
    EXPECT_TRUE(testing::close_rel_l2(*to_host(*y_device), testing::to_doubles(*y), 5e-3));
  }
}

TEST(CudaMoeFp8, RejectsSizesTheKernelsCannotRead) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  Random rng(7403);
  auto host = testing::random_fp8_experts(2, 24, 16, rng);  // H 24: not a multiple of 16
  const DeviceFp8Experts device(*host);
  std::vector<int32_t> ids = {0};
  const OwnedTensor ids_device = to_device(Tensor(ids.data(), DType::kI32, {1, 1}));
  const OwnedTensor x = to_device(*testing::random_tensor(DType::kBF16, {1, 24}, rng));
  const OwnedTensor h = poisoned_device(DType::kF32, {1, 16});
  EXPECT_THROW(kernels::moe_decode_gate_up(*x, *ids_device, device.weights, *h), Error);
}

}  // namespace
}  // namespace metrale
