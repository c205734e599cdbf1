#include "model/blocks/moe.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "kernels/linear.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

// METRALE_MOE_DECODE_FUSION=0 runs the unfused kernel sequence (the router and shared-gate GEMVs,
// the shared expert as an MLP, moe_decode_down, moe_combine): the A/B switch for benchmarks.
bool decode_fusion_enabled() {
  static const bool on = [] {
    const char* setting = std::getenv("METRALE_MOE_DECODE_FUSION");
    return setting == nullptr || std::strcmp(setting, "0") != 0;
  }();
  return on;
}

}  // namespace

Moe::Moe(const MoeConfig& config, Weights& weights, const std::string& prefix)
    : config_(config), full_intermediate_(config.expert_intermediate_size) {
  const int64_t e_count = config.num_experts, h = config.hidden_size;
  if (!weights.has(prefix + "experts.gate_up_proj") && !weights.has(prefix + "experts.0.gate_proj.weight")) {
    raise(ErrorCode::kNotFound, "{}: no experts under '{}{}experts.' (neither fused gate_up_proj nor per-expert keys)",
          weights.source_name(), weights.prefix(), prefix);
  }
  const bool on_cpu = weights.device().is_cpu();
  const bool fused = weights.has(prefix + "experts.gate_up_proj");
  const bool fp8_experts =
      weights.linear_is_fp8(prefix + (fused ? "experts.gate_up_proj" : "experts.0.gate_proj.weight"));
  choose_share(weights.tensor_parallel(), fp8_experts);
  router_ = on_cpu ? weights.get(prefix + "gate.weight", {e_count, h})
                   : load_device(weights, prefix + "gate.weight", {e_count, h});
  if (fp8_experts) {
    load_experts_fp8(weights, prefix, fused);
  } else if (on_cpu) {
    load_experts_cpu(weights, prefix);
  } else {
    load_experts_device(weights, prefix);
  }
  experts_.swiglu_limit = config.swiglu_limit;
  if (config.correction_bias) {
    OwnedTensor bias(DType::kF32, {e_count}, weights.device());
    weights.load_into(prefix + "gate.e_score_correction_bias", *bias);
    correction_bias_ = *bias;
    owned_.push_back(std::move(bias));
  }
  if (config.shared_expert_intermediate_size > 0) load_shared_expert(weights, prefix);
  // The decode path folds the shared expert into the routed expert kernels (one more slot per
  // token) and the combine into the down projections when the shapes and formats allow it.
  fused_decode_ = kernels::moe_shared_expert_fits(experts_, shared_slot_) &&
                  (!shared_expert_ || !shared_slot_.empty()) &&
                  config.top_k + (shared_slot_.empty() ? 0 : 1) <= kernels::kMoeDecodeCombineMaxSlots;
  if (!fused_decode_) shared_slot_ = {};
}

void Moe::choose_share(const TensorParallel& tensor_parallel, bool fp8_experts) {
  // Split only when the routed and the shared experts' units both split: a partial output is all
  // partial. FP8 experts stay whole (their fused loads read whole rows of 128-column scale blocks).
  if (!tensor_parallel.active() || fp8_experts) return;
  const std::optional<IndexRange> units = tensor_parallel.even_share(config_.expert_intermediate_size);
  const int64_t shared = config_.shared_expert_intermediate_size;
  const std::optional<IndexRange> shared_units = tensor_parallel.even_share(shared);
  if (!units || (shared > 0 && !shared_units)) return;
  partial_ = true;
  append_rows(expert_rows_.rows, *units);
  append_rows(expert_rows_.rows, {full_intermediate_ + units->begin, full_intermediate_ + units->end});
  expert_columns_ = TensorSlice::of_columns(units->begin, units->end);
  config_.expert_intermediate_size = units->size();
  if (shared > 0) {
    full_shared_intermediate_ = shared;
    append_rows(shared_rows_.rows, *shared_units);
    shared_columns_ = TensorSlice::of_columns(shared_units->begin, shared_units->end);
    config_.shared_expert_intermediate_size = shared_units->size();
  }
}

void Moe::load_shared_expert(Weights& weights, const std::string& prefix) {
  const int64_t e_count = config_.num_experts, h = config_.hidden_size, s = config_.shared_expert_intermediate_size;
  const int64_t full = partial_ ? full_shared_intermediate_ : s;
  const bool on_cpu = weights.device().is_cpu();
  // Plain on the CPU (views into the mapping), compute-dtype copies on the GPU, or FP8 on either.
  const auto get = [&](const std::string& key, const Shape& shape, const TensorSlice& slice) -> kernels::LinearWeight {
    if (on_cpu || weights.linear_is_fp8(prefix + key)) return weights.get_linear(prefix + key, shape, slice);
    return load_device(weights, prefix + key, shape, slice);
  };
  const std::string& shared = config_.shared_expert_prefix;
  shared_expert_ =
      SwiGluWeights{get(shared + "gate_proj.weight", {full, h}, shared_rows_),
                    get(shared + "up_proj.weight", {full, h}, shared_rows_),
                    get(shared + "down_proj.weight", {h, full}, shared_columns_), Tensor(), config_.swiglu_limit};
  if (config_.shared_expert_gated && on_cpu) {
    shared_expert_gate_ = weights.get(prefix + "shared_expert_gate.weight", {1, h});
  } else if (config_.shared_expert_gated) {
    // On the GPU the gate is row E of the router's weight: one GEMV computes both logits.
    OwnedTensor router_and_gate(weights.compute_dtype(), {e_count + 1, h}, weights.device());
    weights.load_into(prefix + "gate.weight", router_and_gate->slice(0, 0, e_count));
    weights.load_into(prefix + "shared_expert_gate.weight", router_and_gate->slice(0, e_count, e_count + 1));
    router_and_gate_ = *router_and_gate;
    router_ = router_and_gate_.slice(0, 0, e_count);
    shared_expert_gate_ = router_and_gate_.slice(0, e_count, e_count + 1);
    owned_.push_back(std::move(router_and_gate));
  }
  if (s == config_.expert_intermediate_size) {
    shared_slot_ = kernels::MoeSharedExpert{shared_expert_->gate, shared_expert_->up, shared_expert_->down};
  }
}

void Moe::load_experts_cpu(Weights& weights, const std::string& prefix) {
  const int64_t e_count = config_.num_experts, h = config_.hidden_size, i = config_.expert_intermediate_size,
                full = full_intermediate_;
  if (weights.has(prefix + "experts.gate_up_proj")) {
    TensorSlice rows = expert_rows_;
    rows.row_dim = 1;  // [E, 2I, H]: the rows of each expert
    experts_ = kernels::MoeExpertWeights::from_fused(
        weights.get(prefix + "experts.gate_up_proj", {e_count, 2 * full, h}, rows),
        weights.get(prefix + "experts.down_proj", {e_count, h, full}, expert_columns_));
    return;
  }
  experts_.num_experts = e_count;
  experts_.hidden_size = h;
  experts_.intermediate_size = i;
  // Per expert: this rank's gate rows and up rows (the first and second half of expert_rows_).
  const TensorSlice gate_rows =
      partial_ ? TensorSlice::of_rows({expert_rows_.rows.begin(), expert_rows_.rows.begin() + i}) : TensorSlice{};
  for (int64_t e = 0; e < e_count; ++e) {
    const std::string key = prefix + "experts." + std::to_string(e) + ".";
    experts_.gate.push_back(weights.get(key + "gate_proj.weight", {full, h}, gate_rows));
    experts_.up.push_back(weights.get(key + "up_proj.weight", {full, h}, gate_rows));
    experts_.down.push_back(weights.get(key + "down_proj.weight", {h, full}, expert_columns_));
  }
}

void Moe::load_experts_device(Weights& weights, const std::string& prefix) {
  // The checkpoint's expert tensors are read from the mapping and placed straight into the fused
  // buffers (Weights::get would keep a second device copy of every expert alive).
  const int64_t e_count = config_.num_experts, h = config_.hidden_size, i = config_.expert_intermediate_size,
                full = full_intermediate_;
  const Device device = weights.device();
  OwnedTensor gate_up(weights.compute_dtype(), {e_count, 2 * i, h}, device);
  OwnedTensor down(weights.compute_dtype(), {e_count, h, i}, device);
  if (weights.has(prefix + "experts.gate_up_proj")) {
    TensorSlice rows = expert_rows_;
    rows.row_dim = 1;
    weights.load_into(prefix + "experts.gate_up_proj", {e_count, 2 * full, h}, rows, *gate_up);
    weights.load_into(prefix + "experts.down_proj", {e_count, h, full}, expert_columns_, *down);
  } else {
    const TensorSlice gate_rows =
        partial_ ? TensorSlice::of_rows({expert_rows_.rows.begin(), expert_rows_.rows.begin() + i}) : TensorSlice{};
    for (int64_t e = 0; e < e_count; ++e) {
      const std::string key = prefix + "experts." + std::to_string(e) + ".";
      const Tensor expert = gate_up->select(0, e);  // [2I, H]: gate rows, then up rows
      weights.load_into(key + "gate_proj.weight", {full, h}, gate_rows, expert.slice(0, 0, i));
      weights.load_into(key + "up_proj.weight", {full, h}, gate_rows, expert.slice(0, i, 2 * i));
      weights.load_into(key + "down_proj.weight", {h, full}, expert_columns_, down->select(0, e));
    }
  }
  experts_ = kernels::MoeExpertWeights::from_fused(*gate_up, *down);
  owned_.push_back(std::move(gate_up));
  owned_.push_back(std::move(down));
}

void Moe::load_experts_fp8(Weights& weights, const std::string& prefix, bool fused) {
  const int64_t e_count = config_.num_experts, h = config_.hidden_size, i = config_.expert_intermediate_size;
  const int64_t hb = kernels::fp8_scale_blocks(h), ib = kernels::fp8_scale_blocks(i);
  const Device device = weights.device();
  OwnedTensor gate_up(DType::kF8E4M3, {e_count, 2 * i, h}, device);
  OwnedTensor gate_up_scale(DType::kF32, {e_count, 2 * ib, hb}, device);
  OwnedTensor down(DType::kF8E4M3, {e_count, h, i}, device);
  OwnedTensor down_scale(DType::kF32, {e_count, hb, ib}, device);
  for (int64_t e = 0; e < e_count; ++e) {
    const Tensor codes = gate_up->select(0, e), scales = gate_up_scale->select(0, e);
    const Tensor gate = codes.slice(0, 0, i), gate_scale = scales.slice(0, 0, ib);
    const Tensor up = codes.slice(0, i, 2 * i), up_scale = scales.slice(0, ib, 2 * ib);
    if (fused) {
      weights.load_fp8_into(prefix + "experts.gate_up_proj", gate, gate_scale, e, 0);
      weights.load_fp8_into(prefix + "experts.gate_up_proj", up, up_scale, e, i);
      weights.load_fp8_into(prefix + "experts.down_proj", down->select(0, e), down_scale->select(0, e), e, 0);
    } else {
      const std::string key = prefix + "experts." + std::to_string(e) + ".";
      weights.load_fp8_into(key + "gate_proj.weight", gate, gate_scale);
      weights.load_fp8_into(key + "up_proj.weight", up, up_scale);
      weights.load_fp8_into(key + "down_proj.weight", down->select(0, e), down_scale->select(0, e));
    }
  }
  experts_ = kernels::MoeExpertWeights::from_fused_fp8(*gate_up, *gate_up_scale, *down, *down_scale);
  for (OwnedTensor* owned : {&gate_up, &gate_up_scale, &down, &down_scale}) owned_.push_back(std::move(*owned));
}

Tensor Moe::load_device(Weights& weights, const std::string& key, const Shape& shape, const TensorSlice& slice) {
  OwnedTensor placed(weights.compute_dtype(), slice.shape_of(shape), weights.device());
  weights.load_into(key, shape, slice, *placed);
  const Tensor view = *placed;
  owned_.push_back(std::move(placed));
  return view;
}

double Moe::routed_weight_bytes(int64_t rows) const {
  if (rows <= 0 || config_.num_experts <= 0) return 0.0;
  const auto experts = static_cast<double>(config_.num_experts);
  const double miss = 1.0 - std::min(1.0, static_cast<double>(config_.top_k) / experts);
  const double distinct = experts * (1.0 - std::pow(miss, static_cast<double>(rows)));
  const double per_expert = 3.0 * static_cast<double>(config_.hidden_size) *
                            static_cast<double>(config_.expert_intermediate_size) *
                            static_cast<double>(dtype_size(router_.dtype()));
  return distinct * per_expert;
}

void Moe::forward(const StepContext& step, const Tensor& x, const Tensor& out) {
  const int64_t tokens = x.size(0), k = config_.top_k, e_count = config_.num_experts, h = config_.hidden_size,
                inter = config_.expert_intermediate_size;
  METRALE_CHECK(x.ndim() == 2 && x.size(1) == h && out.ndim() == 2 && out.size(0) == tokens && out.size(1) == h,
                "Moe: x {} out {}", x.describe(), out.describe());
  if (tokens == 0) return;
  Arena& ws = step.workspace;
  Tensor router_logits, shared_gate_logits;
  if (!router_and_gate_.empty() && decode_fusion_enabled()) {
    const Tensor logits = ws.alloc(DType::kF32, {tokens, e_count + 1});  // [T, E + 1]: the router's, the gate's
    kernels::linear(x, router_and_gate_, logits);
    router_logits = logits.slice(1, 0, e_count);
    shared_gate_logits = logits.slice(1, e_count, e_count + 1);
  } else {
    router_logits = ws.alloc(DType::kF32, {tokens, e_count});
    kernels::linear(x, router_, router_logits);
  }
  const Tensor topk_ids = ws.alloc(DType::kI32, {tokens, k});
  const Tensor topk_weights = ws.alloc(DType::kF32, {tokens, k});
  kernels::MoeRouteParams route;
  route.top_k = static_cast<int>(k);
  route.normalize = config_.normalize_top_k;
  route.scoring = config_.scoring;
  route.correction_bias = correction_bias_;
  route.n_group = config_.n_group;
  route.topk_group = config_.topk_group;
  route.routed_scaling_factor = config_.routed_scaling_factor;
  kernels::moe_route(router_logits, topk_ids, topk_weights, route);

  const int64_t slots = tokens * k;
  if (slots <= kernels::kMoeDecodeMaxSlots && fused_decode_ && decode_fusion_enabled()) {
    // [T * k (+ T), I] f32: the routed slots, then the shared expert's slot of every token.
    const Tensor hidden = ws.alloc(DType::kF32, {slots + (shared_slot_.empty() ? 0 : tokens), inter});
    kernels::moe_decode_gate_up(x, topk_ids, experts_, hidden, shared_slot_);
    if (!shared_slot_.empty() && !shared_expert_gate_.empty() && shared_gate_logits.empty()) {
      shared_gate_logits = ws.alloc(DType::kF32, {tokens, 1});
      kernels::linear(x, shared_expert_gate_, shared_gate_logits);
    }
    kernels::moe_decode_down_combine(hidden, topk_ids, topk_weights, experts_, shared_slot_, shared_gate_logits, out);
    return;
  }
  // Routed experts: one fp32 output row per (token, slot), in slot order.
  const Tensor slot_out = ws.alloc(DType::kF32, {slots, h});
  if (slots <= kernels::kMoeDecodeMaxSlots) {
    const Tensor hidden = ws.alloc(DType::kF32, {slots, inter});  // [T * k, I]
    kernels::moe_decode_gate_up(x, topk_ids, experts_, hidden);
    kernels::moe_decode_down(hidden, topk_ids, experts_, slot_out);
  } else {
    const Tensor expert_offsets = ws.alloc(DType::kI32, {e_count + 1});
    const Tensor sorted_slots = ws.alloc(DType::kI32, {slots});
    const Tensor sort_scratch = ws.alloc(DType::kI32, {kernels::moe_sort_scratch_elements(slots, e_count)});
    kernels::moe_sort(topk_ids, expert_offsets, sorted_slots, sort_scratch);
    // [T * k, I] in expert-sorted order, activation dtype (the CUDA tensor-core GEMM writes bf16).
    const Tensor hidden = ws.alloc(step.activation_dtype, {slots, inter});
    kernels::moe_grouped_gate_up(x, sorted_slots, expert_offsets, static_cast<int>(k), experts_, hidden);
    kernels::moe_grouped_down(hidden, sorted_slots, expert_offsets, experts_, slot_out);
  }

  // Shared expert: out += sigmoid(x . w_gate) * shared_expert(x), inside the same fp32 sum.
  Tensor shared_out;
  if (shared_expert_) {
    shared_out = ws.alloc(DType::kF32, {tokens, h});
    shared_expert_->run(step, x, shared_out);
    if (!shared_expert_gate_.empty() && shared_gate_logits.empty()) {
      shared_gate_logits = ws.alloc(DType::kF32, {tokens, 1});
      kernels::linear(x, shared_expert_gate_, shared_gate_logits);
    }
  }
  kernels::moe_combine(slot_out, topk_weights, shared_out, shared_gate_logits, out);
}

}  // namespace metrale
