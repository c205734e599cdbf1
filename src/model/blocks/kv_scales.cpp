#include "model/blocks/kv_scales.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/log.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

constexpr float kKeyRange = 200.0f;    // calibrated |k| max maps to this e4m3 magnitude (max 448)
constexpr float kValueRange = 100.0f;  // the same for values

// A checkpoint scale tensor as one value per KV head: a scalar broadcasts.
std::vector<float> per_head(std::vector<float> values, int64_t num_kv_heads, const Weights& weights,
                            const std::string& name) {
  if (values.size() == 1) return std::vector<float>(static_cast<size_t>(num_kv_heads), values[0]);
  if (static_cast<int64_t>(values.size()) != num_kv_heads) {
    raise(ErrorCode::kBadFormat, "{}: '{}{}' has {} values, expected 1 or one per KV head ({})", weights.source_name(),
          weights.prefix(), name, values.size(), num_kv_heads);
  }
  for (const float value : values) {
    if (!(value > 0.0f) || !std::isfinite(value)) {
      raise(ErrorCode::kBadFormat, "{}: '{}{}' holds {}, scales must be positive and finite", weights.source_name(),
            weights.prefix(), name, value);
    }
  }
  return values;
}

std::string format_scales(const std::vector<float>& values) {
  std::string text;
  for (size_t i = 0; i < values.size(); ++i) text += fmt::format("{}{:.4g}", i ? ", " : "", values[i]);
  return "[" + text + "]";
}

}  // namespace

AttentionKvScales::AttentionKvScales(Weights& weights, const std::string& prefix, int64_t num_kv_heads)
    : AttentionKvScales(weights, prefix, num_kv_heads, {0, num_kv_heads}) {}

AttentionKvScales::AttentionKvScales(Weights& weights, const std::string& prefix, int64_t num_kv_heads,
                                     IndexRange heads)
    : name_(weights.prefix() + prefix.substr(0, prefix.ends_with('.') ? prefix.size() - 1 : prefix.size())),
      num_kv_heads_(heads.size()),
      dtype_(weights.kv_cache().dtype),
      calibrate_(weights.kv_cache().calculate_scales) {
  METRALE_CHECK(heads.begin >= 0 && heads.begin < heads.end && heads.end <= num_kv_heads, "KV heads [{}, {}) of {}",
                heads.begin, heads.end, num_kv_heads);
  std::vector<float> k_scales(static_cast<size_t>(num_kv_heads), 1.0f), v_scales = k_scales;
  bool from_checkpoint = false;
  if (weights.has_stored(prefix + "k_scale") || weights.has_stored(prefix + "v_scale")) {
    k_scales = per_head(weights.read_host_values(prefix + "k_scale"), num_kv_heads, weights, prefix + "k_scale");
    v_scales = per_head(weights.read_host_values(prefix + "v_scale"), num_kv_heads, weights, prefix + "v_scale");
    from_checkpoint = true;
  }
  // This block's heads only (a tensor-parallel rank's share).
  k_scales = {k_scales.begin() + heads.begin, k_scales.begin() + heads.end};
  v_scales = {v_scales.begin() + heads.begin, v_scales.begin() + heads.end};
  if (dtype_ != DType::kF8E4M3) return;  // other caches store keys and values as they are
  scales_ = OwnedTensor(DType::kF32, {2, num_kv_heads_}, weights.device());
  upload(k_scales, v_scales);
  using Source = KvScaleTally::Source;
  weights.kv_scale_tally().add(calibrate_        ? Source::kCalibration
                               : from_checkpoint ? Source::kCheckpoint
                                                 : Source::kUnit);
}

void AttentionKvScales::upload(const std::vector<float>& k_scales, const std::vector<float>& v_scales) {
  std::vector<float> both = k_scales;
  both.insert(both.end(), v_scales.begin(), v_scales.end());
  copy_bytes(scales_.tensor.data(), scales_.tensor.device(), both.data(), Device::cpu(), both.size() * sizeof(float));
}

kernels::KvScales AttentionKvScales::scales_for(DType cache_dtype) const {
  if (cache_dtype != DType::kF8E4M3) return {};
  METRALE_CHECK(!scales_.tensor.empty(), "{}: an f8e4m3 KV cache, but the layer was built for {}", name_,
                kv_cache_dtype_name(dtype_));
  return {scales_.tensor.row(0), scales_.tensor.row(1)};
}

void AttentionKvScales::calibrate(const ForwardBatch& batch, DType activation, int64_t head_dim,
                                  const KvWriter& write) {
  const int64_t tokens = batch.num_tokens;
  if (tokens == 0) return;
  const Device device = batch.slot_mapping.device();
  // Row t goes to slot t of a scratch cache of one-token blocks, where the batch writes at all.
  std::vector<int32_t> slots(static_cast<size_t>(tokens));
  copy_bytes(slots.data(), Device::cpu(), batch.slot_mapping.data(), device, slots.size() * sizeof(int32_t));
  int64_t rows = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    auto& slot = slots[static_cast<size_t>(t)];
    slot = slot >= 0 ? static_cast<int32_t>(t) : -1;
    rows += slot >= 0;
  }
  if (rows == 0) return;
  OwnedTensor identity(DType::kI32, {tokens}, device);
  copy_bytes(identity.tensor.data(), device, slots.data(), Device::cpu(), slots.size() * sizeof(int32_t));
  OwnedTensor keys(activation, {tokens, 1, num_kv_heads_, head_dim}, device);
  OwnedTensor values(activation, {tokens, 1, num_kv_heads_, head_dim}, device);
  keys.buffer.zero();
  values.buffer.zero();
  write(identity.tensor, keys.tensor, values.tensor);
  synchronize(device);

  // max |x| per KV head over the written rows (rows not written are zero).
  const auto amax = [&](const OwnedTensor& cache) {
    std::vector<uint8_t> raw(cache.tensor.nbytes());
    copy_bytes(raw.data(), Device::cpu(), cache.tensor.data(), device, raw.size());
    std::vector<float> row(static_cast<size_t>(head_dim));
    std::vector<float> result(static_cast<size_t>(num_kv_heads_), 0.0f);
    const size_t row_bytes = static_cast<size_t>(head_dim) * cache.tensor.element_size();
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < num_kv_heads_; ++h) {
        convert_to_f32(activation, raw.data() + static_cast<size_t>(t * num_kv_heads_ + h) * row_bytes, row.data(),
                       row.size());
        for (const float x : row)
          result[static_cast<size_t>(h)] = std::max(result[static_cast<size_t>(h)], std::fabs(x));
      }
    }
    return result;
  };
  std::vector<float> k_scales = amax(keys), v_scales = amax(values);
  for (float& scale : k_scales) scale = scale > 0.0f && std::isfinite(scale) ? scale / kKeyRange : 1.0f;
  for (float& scale : v_scales) scale = scale > 0.0f && std::isfinite(scale) ? scale / kValueRange : 1.0f;
  upload(k_scales, v_scales);
  calibrated_ = true;
  METRALE_LOG_INFO("{}: FP8 KV scales calibrated on {} tokens and frozen: k_scale {} v_scale {}", name_, rows,
                   format_scales(k_scales), format_scales(v_scales));
}

}  // namespace metrale
