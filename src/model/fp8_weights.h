// FP8 block-scaled projection weights: how a checkpoint declares them (config.json's
// quantization_config), and the block quantiser that `--quantization fp8` applies to bf16 weights.
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "runtime/tensor.h"

namespace metrale {

// Where the FP8 projection weights come from.
enum class WeightQuantization : uint8_t {
  kNone,  // plain weights; a checkpoint's FP8 tensors are still read when its config declares them
  kFp8,   // plain (bf16/f16/f32) projection weights are quantised at load (128x128 blocks, e4m3)
};

// "none" | "fp8"; throws kInvalidArgument otherwise.
WeightQuantization parse_weight_quantization(const std::string& name);

// Whether config.json declares FP8 weights: quantization_config {quant_method: "fp8", fmt: "e4m3",
// weight_block_size: [128, 128]}. False without a quantization_config; kUnsupported naming the field
// for another method, format or block size (kernels::kFp8Block is the only one).
bool checkpoint_has_fp8_weights(const ModelConfig& config);

// weight [N, K] f32|bf16|f16 (CPU) -> e4m3 codes [N, K] and scale_inv [ceil(N/128), ceil(K/128)]
// with scale = amax / 448 per block (1 for an all-zero block), code = round(w / scale).
struct Fp8Blocks {
  std::vector<uint8_t> codes;
  std::vector<float> scale_inv;
};
Fp8Blocks quantize_fp8_blocks(const Tensor& weight);

}  // namespace metrale
