// Random FP8 expert weights for the MoE op tests (CPU and CUDA): e4m3 codes with 128x128 block
// scales in the fused layout of kernels::MoeExpertWeights (gate rows' scale blocks, then up rows'),
// and the same weights dequantised to f32, so that the FP8 ops can be held against the plain ones.
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>

#include "kernels/kernel_helpers.h"
#include "kernels/linear_fp8.h"
#include "kernels/moe.h"

namespace metrale::testing {

// Quantises w [rows, cols] f32 (amax / 448 per 128x128 block) into codes [rows, cols] and scales
// [ceil(rows/128), ceil(cols/128)], and overwrites w with the dequantised values.
inline void quantize_blocks_in_place(float* w, int64_t rows, int64_t cols, uint8_t* codes, float* scales) {
  const int64_t b = kernels::kFp8Block, scale_cols = kernels::fp8_scale_blocks(cols);
  for (int64_t r0 = 0; r0 < rows; r0 += b) {
    for (int64_t c0 = 0; c0 < cols; c0 += b) {
      float amax = 0.0f;
      for (int64_t r = r0; r < std::min(rows, r0 + b); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + b); ++c) amax = std::max(amax, std::fabs(w[r * cols + c]));
      const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
      scales[(r0 / b) * scale_cols + c0 / b] = scale;
      for (int64_t r = r0; r < std::min(rows, r0 + b); ++r) {
        for (int64_t c = c0; c < std::min(cols, c0 + b); ++c) {
          const uint8_t code = f32_to_f8e4m3_bits(w[r * cols + c] / scale);
          codes[r * cols + c] = code;
          w[r * cols + c] = f8e4m3_bits_to_f32(code) * scale;
        }
      }
    }
  }
}

struct Fp8Experts {
  OwnedTensor gate_up, gate_up_scale, down, down_scale;  // f8e4m3 [E, 2I, H], f32 scales; [E, H, I], f32 scales
  OwnedTensor gate_up_plain, down_plain;                 // the dequantised weights, f32
  kernels::MoeExpertWeights fp8, plain;
};

// Weights uniform in [-0.1, 0.1] before quantisation (activations stay O(1)).
inline std::unique_ptr<Fp8Experts> random_fp8_experts(int64_t experts, int64_t hidden, int64_t inter, Random& rng) {
  auto set = std::make_unique<Fp8Experts>();
  const int64_t hb = kernels::fp8_scale_blocks(hidden), ib = kernels::fp8_scale_blocks(inter);
  set->gate_up_plain = random_tensor(DType::kF32, {experts, 2 * inter, hidden}, rng, -0.1f, 0.1f);
  set->down_plain = random_tensor(DType::kF32, {experts, hidden, inter}, rng, -0.1f, 0.1f);
  set->gate_up = OwnedTensor(DType::kF8E4M3, {experts, 2 * inter, hidden});
  set->gate_up_scale = OwnedTensor(DType::kF32, {experts, 2 * ib, hb});
  set->down = OwnedTensor(DType::kF8E4M3, {experts, hidden, inter});
  set->down_scale = OwnedTensor(DType::kF32, {experts, hb, ib});
  auto* gate_up = set->gate_up_plain->data_as<float>();
  auto* down = set->down_plain->data_as<float>();
  auto* gate_up_codes = static_cast<uint8_t*>(set->gate_up->data());
  auto* down_codes = static_cast<uint8_t*>(set->down->data());
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t half = 0; half < 2; ++half) {  // gate rows, then up rows: separate scale blocks
      const int64_t offset = (e * 2 + half) * inter * hidden;
      quantize_blocks_in_place(gate_up + offset, inter, hidden, gate_up_codes + offset,
                               set->gate_up_scale->data_as<float>() + (e * 2 + half) * ib * hb);
    }
    quantize_blocks_in_place(down + e * hidden * inter, hidden, inter, down_codes + e * hidden * inter,
                             set->down_scale->data_as<float>() + e * hb * ib);
  }
  set->fp8 =
      kernels::MoeExpertWeights::from_fused_fp8(*set->gate_up, *set->gate_up_scale, *set->down, *set->down_scale);
  set->plain = kernels::MoeExpertWeights::from_fused(*set->gate_up_plain, *set->down_plain);
  return set;
}

}  // namespace metrale::testing
