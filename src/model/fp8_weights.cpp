#include "model/fp8_weights.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/linear_fp8.h"

namespace metrale {

WeightQuantization parse_weight_quantization(const std::string& name) {
  if (name == "none") return WeightQuantization::kNone;
  if (name == "fp8") return WeightQuantization::kFp8;
  raise(ErrorCode::kInvalidArgument, "unknown weight quantization '{}' (supported: none, fp8)", name);
}

bool checkpoint_has_fp8_weights(const ModelConfig& config) {
  if (!config.text.contains("quantization_config") || config.text["quantization_config"].is_null()) return false;
  const nlohmann::json& quant = config.text["quantization_config"];
  const std::string where = config.source.string() + ": quantization_config";
  if (!quant.is_object()) raise(ErrorCode::kBadFormat, "{} must be an object", where);
  const std::string method = quant.value("quant_method", std::string());
  if (method != "fp8") {
    raise(ErrorCode::kUnsupported, "{}: quant_method '{}' is not supported (supported: fp8)", where, method);
  }
  const std::string fmt = quant.contains("fmt") && quant["fmt"].is_string() ? quant["fmt"].get<std::string>() : "e4m3";
  if (fmt != "e4m3") raise(ErrorCode::kUnsupported, "{}: fmt '{}' is not supported (supported: e4m3)", where, fmt);
  if (!quant.contains("weight_block_size") || quant["weight_block_size"].is_null()) {
    raise(ErrorCode::kUnsupported,
          "{}: per-tensor FP8 scales (no weight_block_size) are not supported; "
          "weights need weight_block_size [{}, {}]",
          where, kernels::kFp8Block, kernels::kFp8Block);
  }
  const nlohmann::json& block = quant["weight_block_size"];
  const bool supported = block.is_array() && block.size() == 2 && block[0].is_number_integer() &&
                         block[1].is_number_integer() && block[0].get<int64_t>() == kernels::kFp8Block &&
                         block[1].get<int64_t>() == kernels::kFp8Block;
  if (!supported) {
    raise(ErrorCode::kUnsupported, "{}: weight_block_size {} is not supported (supported: [{}, {}])", where,
          block.dump(), kernels::kFp8Block, kernels::kFp8Block);
  }
  return true;
}

Fp8Blocks quantize_fp8_blocks(const Tensor& weight) {
  METRALE_CHECK(weight.ndim() == 2 && weight.is_contiguous() && weight.device().is_cpu() &&
                    (weight.dtype() == DType::kF32 || weight.dtype() == DType::kBF16 || weight.dtype() == DType::kF16),
                "quantize_fp8_blocks {}", weight.describe());
  constexpr float kE4M3Max = 448.0f;
  const int64_t n = weight.size(0), k = weight.size(1), b = kernels::kFp8Block;
  const int64_t row_blocks = kernels::fp8_scale_blocks(n), col_blocks = kernels::fp8_scale_blocks(k);
  Fp8Blocks result;
  result.codes.resize(static_cast<size_t>(n * k));
  result.scale_inv.resize(static_cast<size_t>(row_blocks * col_blocks));
  std::vector<float> rows(static_cast<size_t>(std::min(n, b) * k));
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    const int64_t r0 = rb * b, r1 = std::min(n, r0 + b);
    convert_to_f32(weight.dtype(),
                   static_cast<const char*>(weight.data()) + r0 * k * static_cast<int64_t>(weight.element_size()),
                   rows.data(), static_cast<size_t>((r1 - r0) * k));
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const int64_t c0 = cb * b, c1 = std::min(k, c0 + b);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(rows[static_cast<size_t>((r - r0) * k + c)]));
      const float scale = amax > 0.0f ? amax / kE4M3Max : 1.0f;
      result.scale_inv[static_cast<size_t>(rb * col_blocks + cb)] = scale;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          result.codes[static_cast<size_t>(r * k + c)] =
              f32_to_f8e4m3_bits(rows[static_cast<size_t>((r - r0) * k + c)] / scale);
    }
  }
  return result;
}

}  // namespace metrale
