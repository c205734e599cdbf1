// How the attention blocks store their keys and values: the KV-cache dtype (--kv-cache-dtype) and,
// for FP8, where the per-head scales come from (--calculate-kv-scales, or the checkpoint).
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "core/dtype.h"

namespace metrale {

struct KvCacheOptions {
  // nullopt ("auto"): the activation dtype (f32 on the CPU, bf16 on the GPU). kF8E4M3: e4m3 keys and
  // values with per-layer, per-KV-head scales, in the attention blocks that support it (GQA
  // attention; MLA latents, indexer keys and the QSA attention keep the activation dtype).
  std::optional<DType> dtype;
  // FP8: calibrate the scales on the keys and values of the first step served (then frozen), instead
  // of the checkpoint's k_scale / v_scale.
  bool calculate_scales = false;
};

// "auto" (nullopt), "bf16", "f32" / "fp32", "fp8" / "fp8_e4m3"; throws kInvalidArgument otherwise.
std::optional<DType> parse_kv_cache_dtype(const std::string& name);
std::string kv_cache_dtype_name(const std::optional<DType>& dtype);  // "auto", "bf16", "fp8_e4m3", ...

// Where each FP8 attention layer of a model got its scales, for one summary line at load.
class KvScaleTally {
 public:
  enum class Source : uint8_t { kCheckpoint, kCalibration, kUnit };
  void add(Source source);
  int count(Source source) const;
  int total() const;

 private:
  mutable std::mutex mutex_;
  int checkpoint_ = 0, calibration_ = 0, unit_ = 0;
};

}  // namespace metrale
