// The FP8 KV-cache scales of one attention layer: one per KV head for the keys and one for the
// values (a cached e4m3 element e of head h stands for e * scale[h]). Where they come from:
//  - --calculate-kv-scales (KvCacheOptions::calculate_scales): calibrated on the keys and values of
//    the first step served, then frozen and logged: scale = max |x| over that step's rows of the head
//    / 200 for keys and / 100 for values (vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT). The headroom
//    is for later tokens beyond the first step's range; e4m3's precision is relative, so it costs only
//    resolution below 2^-6 * scale;
//  - else the checkpoint's `<prefix>k_scale` and `<prefix>v_scale` (vLLM / HF FP8 checkpoints), a
//    scalar ([] or [1]) or one per KV head ([n_kv]); they are read, and so count as used, whatever
//    the cache dtype;
//  - else 1.0 (the load logs one warning for all such layers, from KvScaleTally).
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "kernels/attention.h"
#include "model/forward_batch.h"
#include "model/weight_store.h"

namespace metrale {

class AttentionKvScales {
 public:
  AttentionKvScales(Weights& weights, const std::string& prefix, int64_t num_kv_heads);
  // The scales of KV heads `heads` of the layer's `num_kv_heads` (a tensor-parallel rank's share).
  AttentionKvScales(Weights& weights, const std::string& prefix, int64_t num_kv_heads, IndexRange heads);

  // The dtype the layer declares for its K and V cache tensors (nullopt: the activation dtype).
  std::optional<DType> cache_dtype() const { return dtype_; }
  // The scales the kernels take for caches of `cache_dtype` (empty unless f8e4m3).
  kernels::KvScales scales_for(DType cache_dtype) const;
  // Whether the scales still wait for calibration: f8e4m3 caches, calculate_scales, and no step
  // with ForwardBatch::calibrate_kv_scales that wrote a key yet.
  bool calibration_pending(DType cache_dtype) const {
    return cache_dtype == DType::kF8E4M3 && calibrate_ && !calibrated_;
  }

  // Writes the layer's keys and values of every batch row into k_cache and v_cache
  // [T, 1, n_kv, head_dim] of the activation dtype at `slots` [T] i32 (row t at slot t, or -1 where
  // the batch writes nothing), without touching the real cache or the queries.
  using KvWriter = std::function<void(const Tensor& slots, const Tensor& k_cache, const Tensor& v_cache)>;
  // Calibrates the scales from the batch's rows that write the cache (no such row: still pending).
  // Synchronises with the device (once per layer in the engine's life).
  void calibrate(const ForwardBatch& batch, DType activation, int64_t head_dim, const KvWriter& write);

 private:
  void upload(const std::vector<float>& k_scales, const std::vector<float>& v_scales);

  std::string name_;  // the layer, for messages: "model.layers.3.self_attn"
  int64_t num_kv_heads_ = 0;
  std::optional<DType> dtype_;
  bool calibrate_ = false;
  bool calibrated_ = false;
  OwnedTensor scales_;  // [2, n_kv] f32 on the model's device: the keys' row, then the values'
};

}  // namespace metrale
