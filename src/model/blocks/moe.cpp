#include "model/blocks/moe.h"

#include <cmath>

#include "core/error.h"
#include "kernels/linear.h"
#include "kernels/moe.h"

namespace metrale {

Moe::Moe(const MoeConfig& config, Weights& weights, const std::string& prefix) : config_(config) {
  const int64_t e_count = config.num_experts, h = config.hidden_size, i = config.expert_intermediate_size;
  router_ = weights.get(prefix + "gate.weight", {e_count, h});
  experts_.resize(static_cast<size_t>(e_count));
  if (weights.has(prefix + "experts.gate_up_proj")) {
    const Tensor gate_up = weights.get(prefix + "experts.gate_up_proj", {e_count, 2 * i, h});
    const Tensor down = weights.get(prefix + "experts.down_proj", {e_count, h, i});
    for (int64_t e = 0; e < e_count; ++e) {
      const Tensor expert = gate_up.select(0, e);  // [2I, H]
      experts_[static_cast<size_t>(e)] = {expert.slice(0, 0, i), expert.slice(0, i, 2 * i), down.select(0, e)};
    }
  } else if (weights.has(prefix + "experts.0.gate_proj.weight")) {
    for (int64_t e = 0; e < e_count; ++e) {
      const std::string key = prefix + "experts." + std::to_string(e) + ".";
      experts_[static_cast<size_t>(e)] = {weights.get(key + "gate_proj.weight", {i, h}),
                                          weights.get(key + "up_proj.weight", {i, h}),
                                          weights.get(key + "down_proj.weight", {h, i})};
    }
  } else {
    raise(ErrorCode::kNotFound, "{}: no experts under '{}{}experts.' (neither fused gate_up_proj nor per-expert keys)",
          weights.store().dir().string(), weights.prefix(), prefix);
  }
  if (config.shared_expert_intermediate_size > 0) {
    const int64_t s = config.shared_expert_intermediate_size;
    shared_expert_ = SwiGluWeights{weights.get(prefix + "shared_expert.gate_proj.weight", {s, h}),
                                   weights.get(prefix + "shared_expert.up_proj.weight", {s, h}),
                                   weights.get(prefix + "shared_expert.down_proj.weight", {h, s})};
    shared_expert_gate_ = weights.get(prefix + "shared_expert_gate.weight", {1, h});
  }
}

void Moe::forward(const StepContext& step, const Tensor& x, const Tensor& out) {
  METRALE_CHECK(out.device().is_cpu() && out.dtype() == DType::kF32, "Moe: only the CPU path exists so far");
  const int64_t tokens = x.size(0), k = config_.top_k, e_count = config_.num_experts, h = config_.hidden_size;
  Arena& ws = step.workspace;
  const Tensor router_logits = ws.alloc(DType::kF32, {tokens, e_count});
  kernels::linear(x, router_, router_logits);
  const Tensor topk_ids = ws.alloc(DType::kI32, {tokens, k});
  const Tensor topk_weights = ws.alloc(DType::kF32, {tokens, k});
  kernels::moe_route(router_logits, topk_ids, topk_weights,
                     {static_cast<int>(k), config_.normalize_top_k});

  // Group the (token, slot) pairs by expert: counting sort over expert ids.
  const auto* ids = topk_ids.data_as<const int32_t>();
  const auto* weights = topk_weights.data_as<const float>();
  std::vector<int64_t> offsets(static_cast<size_t>(e_count + 1), 0);
  for (int64_t n = 0; n < tokens * k; ++n) ++offsets[static_cast<size_t>(ids[n]) + 1];
  for (int64_t e = 0; e < e_count; ++e) offsets[static_cast<size_t>(e + 1)] += offsets[static_cast<size_t>(e)];
  const Tensor sorted_tokens = ws.alloc(DType::kI32, {tokens * k});
  const Tensor sorted_weights = ws.alloc(DType::kF32, {tokens * k});
  {
    std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
    auto* token_out = sorted_tokens.data_as<int32_t>();
    auto* weight_out = sorted_weights.data_as<float>();
    for (int64_t n = 0; n < tokens * k; ++n) {
      const int64_t pos = cursor[static_cast<size_t>(ids[n])]++;
      token_out[pos] = static_cast<int32_t>(n / k);
      weight_out[pos] = weights[n];
    }
  }

  // Routed experts: the fp32 output accumulates w * expert(x) over each token's k slots.
  std::fill_n(out.data_as<float>(), tokens * h, 0.0f);
  for (int64_t e = 0; e < e_count; ++e) {
    const int64_t begin = offsets[static_cast<size_t>(e)], end = offsets[static_cast<size_t>(e + 1)];
    if (begin == end) continue;
    const int64_t rows = end - begin;
    const Tensor token_index = sorted_tokens.slice(0, begin, end);
    const Tensor expert_in = ws.alloc(x.dtype(), {rows, h});
    const Tensor expert_out = ws.alloc(DType::kF32, {rows, h});
    kernels::gather_rows(x, token_index, expert_in);
    experts_[static_cast<size_t>(e)].run(step, expert_in, expert_out);
    kernels::scatter_add_rows(out, expert_out, token_index, sorted_weights.slice(0, begin, end));
  }

  if (shared_expert_) {
    // out += sigmoid(x . w_gate) * shared_expert(x)
    const Tensor shared_out = ws.alloc(DType::kF32, {tokens, h});
    shared_expert_->run(step, x, shared_out);
    const Tensor gate_logit = ws.alloc(DType::kF32, {tokens, 1});
    kernels::linear(x, shared_expert_gate_, gate_logit);
    auto* o = out.data_as<float>();
    const auto* s = shared_out.data_as<const float>();
    const auto* g = gate_logit.data_as<const float>();
    for (int64_t t = 0; t < tokens; ++t) {
      const float gate = 1.0f / (1.0f + std::exp(-g[t]));
      for (int64_t c = 0; c < h; ++c) o[t * h + c] += gate * s[t * h + c];
    }
  }
}

}  // namespace metrale
