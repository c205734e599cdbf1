#include "model/kv_cache_options.h"

#include "core/error.h"

namespace metrale {

std::optional<DType> parse_kv_cache_dtype(const std::string& name) {
  if (name == "auto") return std::nullopt;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "f32" || name == "fp32" || name == "float32") return DType::kF32;
  if (name == "fp8" || name == "fp8_e4m3") return DType::kF8E4M3;
  raise(ErrorCode::kInvalidArgument, "unknown KV-cache dtype '{}' (supported: auto, bf16, fp32, fp8, fp8_e4m3)", name);
}

std::string kv_cache_dtype_name(const std::optional<DType>& dtype) {
  if (!dtype) return "auto";
  if (*dtype == DType::kF8E4M3) return "fp8_e4m3";
  return std::string(dtype_name(*dtype));
}

void KvScaleTally::add(Source source) {
  std::lock_guard lock(mutex_);
  switch (source) {
    case Source::kCheckpoint:
      ++checkpoint_;
      break;
    case Source::kCalibration:
      ++calibration_;
      break;
    case Source::kUnit:
      ++unit_;
      break;
  }
}

int KvScaleTally::count(Source source) const {
  std::lock_guard lock(mutex_);
  switch (source) {
    case Source::kCheckpoint:
      return checkpoint_;
    case Source::kCalibration:
      return calibration_;
    case Source::kUnit:
      return unit_;
  }
  return 0;
}

int KvScaleTally::total() const {
  std::lock_guard lock(mutex_);
  return checkpoint_ + calibration_ + unit_;
}

}  // namespace metrale
