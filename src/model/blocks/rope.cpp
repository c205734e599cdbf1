#include "model/blocks/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "core/error.h"

namespace metrale {

RotaryEmbedding::RotaryEmbedding(const RopeConfig& config, int64_t head_dim, int64_t max_position_embeddings,
                                 Device device, int64_t rotary_dim_override) {
  const int64_t dim = rotary_dim_override > 0
                          ? rotary_dim_override
                          : static_cast<int64_t>(static_cast<double>(head_dim) * config.partial_rotary_factor);
  if (dim <= 0 || dim % 2 != 0 || dim > head_dim) {
    raise(ErrorCode::kBadFormat, "rotary dimension {} is invalid for head_dim {}", dim, head_dim);
  }
  params_.rotary_dim = static_cast<int>(dim);
  const int64_t half = dim / 2;
  // pos_freq_i = theta ^ (2i / dim) in fp32, inv_freq = 1 / pos_freq (transformers'
  // compute_default_rope_parameters: arange(0, dim, 2).float() / dim, then base ** that).
  std::vector<float> pos_freq(static_cast<size_t>(half)), inv(static_cast<size_t>(half));
  const float base = static_cast<float>(config.theta);
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    pos_freq[static_cast<size_t>(i)] = std::pow(base, exponent);
    inv[static_cast<size_t>(i)] = 1.0f / pos_freq[static_cast<size_t>(i)];
  }
  if (config.type == "default") {
    // nothing more
  } else if (config.type == "linear") {
    for (auto& value : inv) value /= static_cast<float>(config.factor);
  } else if (config.type == "yarn") {
    const double original = static_cast<double>(config.original_max_position_embeddings.value_or(max_position_embeddings));
    double factor = config.factor;
    if (factor <= 0) factor = static_cast<double>(max_position_embeddings) / original;
    const auto correction_dim = [&](double rotations) {
      return static_cast<double>(dim) * std::log(original / (rotations * 2 * std::numbers::pi)) / (2 * std::log(config.theta));
    };
    double low = correction_dim(config.beta_fast), high = correction_dim(config.beta_slow);
    if (config.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < half; ++i) {
      const float ramp = static_cast<float>(std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0));
      const float extrapolation_factor = 1.0f - ramp;
      const float extrapolation = 1.0f / pos_freq[static_cast<size_t>(i)];
      const float interpolation = 1.0f / (static_cast<float>(factor) * pos_freq[static_cast<size_t>(i)]);
      inv[static_cast<size_t>(i)] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
    }
    params_.attention_scaling = config.attention_factor
                                    ? static_cast<float>(*config.attention_factor)
                                    : (factor <= 1.0 ? 1.0f : static_cast<float>(0.1 * std::log(factor) + 1.0));
  } else {
    raise(ErrorCode::kUnsupported, "rope_type '{}' is not supported (default, linear and yarn are)", config.type);
  }
  inv_freq_ = OwnedTensor(DType::kF32, {half}, device);
  copy_bytes(inv_freq_.tensor.data(), device, inv.data(), Device::cpu(), inv.size() * sizeof(float));
}

}  // namespace metrale
