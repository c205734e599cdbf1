#include "kernels/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/cpu/common.h"
#include "kernels/linear_weight.h"

namespace metrale::kernels {

MoeExpertWeights MoeExpertWeights::from_fused(const Tensor& gate_up, const Tensor& down) {
  METRALE_CHECK(gate_up.ndim() == 3 && down.ndim() == 3 && gate_up.size(0) == down.size(0) &&
                    gate_up.size(1) % 2 == 0 && down.size(1) == gate_up.size(2) && down.size(2) * 2 == gate_up.size(1),
                "MoE fused expert weights: gate_up {} down {}", gate_up.describe(), down.describe());
  MoeExpertWeights weights;
  weights.num_experts = gate_up.size(0);
  weights.hidden_size = gate_up.size(2);
  weights.intermediate_size = down.size(2);
  weights.gate_up = gate_up;
  weights.down_fused = down;
  const int64_t inter = weights.intermediate_size;
  for (int64_t e = 0; e < weights.num_experts; ++e) {
    const Tensor expert = gate_up.select(0, e);  // [2I, H]
    weights.gate.push_back(expert.slice(0, 0, inter));
    weights.up.push_back(expert.slice(0, inter, 2 * inter));
    weights.down.push_back(down.select(0, e));
  }
  return weights;
}

MoeExpertWeights MoeExpertWeights::from_fused_fp8(const Tensor& gate_up, const Tensor& gate_up_scale,
                                                  const Tensor& down, const Tensor& down_scale) {
  MoeExpertWeights weights = from_fused(gate_up, down);
  const int64_t e_count = weights.num_experts, h = weights.hidden_size, inter = weights.intermediate_size;
  const int64_t inter_blocks = fp8_scale_blocks(inter), hidden_blocks = fp8_scale_blocks(h);
  METRALE_CHECK(gate_up.dtype() == DType::kF8E4M3 && down.dtype() == DType::kF8E4M3 &&
                    gate_up_scale.dtype() == DType::kF32 && down_scale.dtype() == DType::kF32 &&
                    gate_up_scale.shape() == (Shape{e_count, 2 * inter_blocks, hidden_blocks}) &&
                    down_scale.shape() == (Shape{e_count, hidden_blocks, inter_blocks}) &&
                    gate_up_scale.is_contiguous() && down_scale.is_contiguous(),
                "MoE fused FP8 expert weights: gate_up {} scales {}, down {} scales {}", gate_up.describe(),
                gate_up_scale.describe(), down.describe(), down_scale.describe());
  weights.gate_up_scale = gate_up_scale;
  weights.down_scale = down_scale;
  for (int64_t e = 0; e < e_count; ++e) {
    const auto index = static_cast<size_t>(e);
    const Tensor scales = gate_up_scale.select(0, e);  // [2 ceil(I/128), ceil(H/128)]
    weights.gate[index].scale_inv = scales.slice(0, 0, inter_blocks);
    weights.up[index].scale_inv = scales.slice(0, inter_blocks, 2 * inter_blocks);
    weights.down[index].scale_inv = down_scale.select(0, e);
  }
  return weights;
}

bool moe_shared_expert_fits(const MoeExpertWeights& experts, const MoeSharedExpert& shared) {
  if (shared.empty()) return true;
  const int64_t h = experts.hidden_size, i = experts.intermediate_size;
  if (shared.gate.empty() || shared.up.empty() || experts.gate.empty()) return false;
  if (shared.gate.weight.shape() != Shape{i, h} || shared.up.weight.shape() != Shape{i, h} ||
      shared.down.weight.shape() != Shape{h, i}) {
    return false;
  }
  const LinearWeight& routed = experts.gate.front();
  for (const LinearWeight* part : {&shared.gate, &shared.up, &shared.down}) {
    if (part->is_fp8() != routed.is_fp8() || part->weight.dtype() != routed.weight.dtype()) return false;
  }
  return true;
}

}  // namespace metrale::kernels

namespace metrale::kernels::cpu {
namespace {

void check_experts(const MoeExpertWeights& experts) {
  const auto count = static_cast<size_t>(experts.num_experts);
  METRALE_CHECK(experts.gate.size() == count && experts.up.size() == count && experts.down.size() == count,
                "MoE expert views: {} experts but {} / {} / {} views", count, experts.gate.size(), experts.up.size(),
                experts.down.size());
}

int32_t checked_expert(int32_t e, const MoeExpertWeights& experts) {
  METRALE_CHECK(e >= 0 && e < experts.num_experts, "MoE expert id {} outside [0, {})", e, experts.num_experts);
  return e;
}

inline float silu(float g) {
  return g / (1.0f + std::exp(-g));
}

// out[r] = silu(gate[r]) * up[r], stored in out's dtype, with the clamp of the clamped SwiGLU when
// limit > 0. gate, up [rows, I] f32.
void store_silu_mul(const float* gate, const float* up, int64_t width, float limit, const Tensor& out,
                    int64_t out_row) {
  std::vector<float> h(static_cast<size_t>(width));
  for (int64_t i = 0; i < width; ++i) {
    const float g = limit > 0.0f ? std::min(gate[i], limit) : gate[i];
    const float u = limit > 0.0f ? std::clamp(up[i], -limit, limit) : up[i];
    h[static_cast<size_t>(i)] = silu(g) * u;
  }
  store_f32(out.dtype(), h.data(), row_ptr_mut(out, out_row), width);
}

// Sets the choice scores of every expert outside the topk_group best groups to -inf. A group scores
// the sum of its two best choice scores (one when a group has a single expert); ties toward the
// lower group.
void limit_groups(float* choice, int64_t experts, int n_group, int topk_group) {
  if (n_group <= 1) return;
  const int64_t per_group = experts / n_group;
  std::vector<float> group_score(static_cast<size_t>(n_group));
  for (int g = 0; g < n_group; ++g) {
    float best = -INFINITY, second = -INFINITY;
    for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
      if (choice[e] > best) {
        second = best;
        best = choice[e];
      } else if (choice[e] > second) {
        second = choice[e];
      }
    }
    group_score[static_cast<size_t>(g)] = per_group >= 2 ? best + second : best;
  }
  std::vector<int> order(static_cast<size_t>(n_group));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return group_score[static_cast<size_t>(a)] > group_score[static_cast<size_t>(b)];
  });
  for (size_t rank = static_cast<size_t>(topk_group); rank < order.size(); ++rank) {
    const int g = order[rank];
    std::fill(choice + g * per_group, choice + (g + 1) * per_group, -INFINITY);
  }
}

}  // namespace

void moe_route(const Tensor& router_logits, const Tensor& topk_ids, const Tensor& topk_weights,
               const MoeRouteParams& params) {
  const int64_t tokens = router_logits.size(0), experts = router_logits.size(1);
  const int k = params.top_k;
  METRALE_CHECK(k >= 1 && k <= experts, "moe top_k {} of {} experts", k, experts);
  METRALE_CHECK(topk_ids.numel() == tokens * k && topk_weights.numel() == tokens * k &&
                    topk_ids.dtype() == DType::kI32 && topk_weights.dtype() == DType::kF32,
                "moe_route outputs");
  const bool sigmoid = params.scoring == MoeScoring::kSigmoid;
  METRALE_CHECK(params.n_group >= 1 && experts % params.n_group == 0 && params.topk_group >= 1 &&
                    params.topk_group <= params.n_group &&
                    static_cast<int64_t>(params.topk_group) * (experts / params.n_group) >= k,
                "moe_route: {} groups (keep {}) of {} experts for top_k {}", params.n_group, params.topk_group, experts,
                k);
  std::vector<float> bias;
  if (!params.correction_bias.empty()) {
    METRALE_CHECK(params.correction_bias.numel() == experts && params.correction_bias.is_contiguous(),
                  "moe_route: correction_bias {} for {} experts", params.correction_bias.describe(), experts);
    bias.resize(static_cast<size_t>(experts));
    convert_to_f32(params.correction_bias.dtype(), params.correction_bias.data(), bias.data(), bias.size());
  }
  auto* ids = topk_ids.data_as<int32_t>();
  auto* weights = topk_weights.data_as<float>();
  cpu_pool().parallel_for(tokens, 16, [&](int64_t begin, int64_t end) {
    float* probs = scratch_a(experts);
    float* choice = scratch_b(experts);
    std::vector<int32_t> order(static_cast<size_t>(experts));
    for (int64_t t = begin; t < end; ++t) {
      const float* logits = as_f32(router_logits.dtype(), row_ptr(router_logits, t), probs, experts);
      if (logits != probs) std::copy(logits, logits + experts, probs);
      if (sigmoid) {
        for (int64_t e = 0; e < experts; ++e) probs[e] = 1.0f / (1.0f + std::exp(-probs[e]));
      } else {
        const float max_logit = *std::max_element(probs, probs + experts);
        double sum = 0.0;
        for (int64_t e = 0; e < experts; ++e) {
          probs[e] = std::exp(probs[e] - max_logit);
          sum += probs[e];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t e = 0; e < experts; ++e) probs[e] *= inv;
      }
      for (int64_t e = 0; e < experts; ++e)
        choice[e] = bias.empty() ? probs[e] : probs[e] + bias[static_cast<size_t>(e)];
      limit_groups(choice, experts, params.n_group, params.topk_group);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
      });
      float selected_sum = 0.0f;
      for (int j = 0; j < k; ++j) selected_sum += probs[order[static_cast<size_t>(j)]];
      if (sigmoid) selected_sum += 1e-20f;
      for (int j = 0; j < k; ++j) {
        const int32_t e = order[static_cast<size_t>(j)];
        ids[t * k + j] = e;
        const float w = params.normalize ? probs[e] / selected_sum : probs[e];
        weights[t * k + j] = params.routed_scaling_factor == 1.0f ? w : w * params.routed_scaling_factor;
      }
    }
  });
}

void gather_rows(const Tensor& src, const Tensor& index, const Tensor& out) {
  const int64_t n = index.numel(), width = src.size(1);
  METRALE_CHECK(out.size(0) == n && out.size(1) == width && src.dtype() == out.dtype(), "gather_rows shapes");
  const auto* idx = index.data_as<const int32_t>();
  const size_t bytes = static_cast<size_t>(width) * src.element_size();
  for (int64_t i = 0; i < n; ++i) {
    METRALE_CHECK(idx[i] >= 0 && idx[i] < src.size(0), "gather_rows index {}", idx[i]);
    std::memcpy(row_ptr_mut(out, i), row_ptr(src, idx[i]), bytes);
  }
}

void scatter_add_rows(const Tensor& dst, const Tensor& src, const Tensor& index, const Tensor& weight) {
  const int64_t n = index.numel(), width = dst.size(1);
  METRALE_CHECK(dst.dtype() == DType::kF32 && src.size(0) == n && src.size(1) == width && weight.numel() == n,
                "scatter_add_rows shapes");
  const auto* idx = index.data_as<const int32_t>();
  const auto* w = weight.data_as<const float>();
  float* tmp = scratch_a(width);
  for (int64_t i = 0; i < n; ++i) {
    METRALE_CHECK(idx[i] >= 0 && idx[i] < dst.size(0), "scatter_add_rows index {}", idx[i]);
    float* d = static_cast<float*>(row_ptr_mut(dst, idx[i]));
    const float* s = as_f32(src.dtype(), row_ptr(src, i), tmp, width);
    for (int64_t c = 0; c < width; ++c) d[c] += w[i] * s[c];
  }
}

void moe_sort(const Tensor& topk_ids, const Tensor& expert_offsets, const Tensor& sorted_slots, const Tensor& scratch) {
  const int64_t slots = topk_ids.numel(), experts = expert_offsets.numel() - 1;
  METRALE_CHECK(topk_ids.dtype() == DType::kI32 && expert_offsets.dtype() == DType::kI32 &&
                    sorted_slots.dtype() == DType::kI32 && sorted_slots.numel() == slots && experts >= 1 &&
                    topk_ids.is_contiguous() && sorted_slots.is_contiguous() && expert_offsets.is_contiguous(),
                "moe_sort: ids {} offsets {} sorted {}", topk_ids.describe(), expert_offsets.describe(),
                sorted_slots.describe());
  METRALE_CHECK(scratch.numel() >= moe_sort_scratch_elements(slots, experts), "moe_sort scratch {} too small",
                scratch.describe());
  const auto* ids = topk_ids.data_as<const int32_t>();
  auto* offsets = expert_offsets.data_as<int32_t>();
  auto* sorted = sorted_slots.data_as<int32_t>();
  std::vector<int32_t> cursor(static_cast<size_t>(experts), 0);
  for (int64_t s = 0; s < slots; ++s) {
    METRALE_CHECK(ids[s] >= 0 && ids[s] < experts, "moe_sort: expert id {} outside [0, {})", ids[s], experts);
    ++cursor[static_cast<size_t>(ids[s])];
  }
  int32_t running = 0;
  for (int64_t e = 0; e < experts; ++e) {
    offsets[e] = running;
    running += cursor[static_cast<size_t>(e)];
    cursor[static_cast<size_t>(e)] = offsets[e];
  }
  offsets[experts] = running;
  for (int64_t s = 0; s < slots; ++s) sorted[cursor[static_cast<size_t>(ids[s])]++] = static_cast<int32_t>(s);
}

void moe_decode_gate_up(const Tensor& x, const Tensor& topk_ids, const MoeExpertWeights& experts, const Tensor& h,
                        const MoeSharedExpert& shared) {
  check_experts(experts);
  METRALE_CHECK(moe_shared_expert_fits(experts, shared),
                "moe_decode_gate_up: the shared expert {} is not in the "
                "routed experts' format",
                shared.down.weight.describe());
  const int64_t tokens = x.size(0), k = topk_ids.size(1), inter = experts.intermediate_size;
  const int64_t rows = tokens * k + (shared.empty() ? 0 : tokens);
  METRALE_CHECK(topk_ids.size(0) == tokens && x.size(1) == experts.hidden_size && h.size(0) == rows &&
                    h.size(1) == inter && topk_ids.is_contiguous(),
                "moe_decode_gate_up: x {} ids {} h {}", x.describe(), topk_ids.describe(), h.describe());
  const auto* ids = topk_ids.data_as<const int32_t>();
  OwnedTensor gate(DType::kF32, {1, inter}), up(DType::kF32, {1, inter});
  for (int64_t s = 0; s < rows; ++s) {
    const bool routed = s < tokens * k;
    const int64_t t = routed ? s / k : s - tokens * k;
    const Tensor x_row = x.slice(0, t, t + 1);
    if (routed) {
      const auto e = static_cast<size_t>(checked_expert(ids[s], experts));
      linear(x_row, experts.gate[e], *gate, false);
      linear(x_row, experts.up[e], *up, false);
    } else {
      linear(x_row, shared.gate, *gate, false);
      linear(x_row, shared.up, *up, false);
    }
    store_silu_mul(gate->data_as<const float>(), up->data_as<const float>(), inter, experts.swiglu_limit, h, s);
  }
}

void moe_decode_down_combine(const Tensor& h, const Tensor& topk_ids, const Tensor& topk_weights,
                             const MoeExpertWeights& experts, const MoeSharedExpert& shared,
                             const Tensor& shared_gate_logits, const Tensor& out) {
  check_experts(experts);
  METRALE_CHECK(moe_shared_expert_fits(experts, shared),
                "moe_decode_down_combine: the shared expert {} is not in "
                "the routed experts' format",
                shared.down.weight.describe());
  const int64_t tokens = out.size(0), slots = topk_ids.numel(), hidden = experts.hidden_size;
  METRALE_CHECK(topk_ids.ndim() == 2 && topk_ids.size(0) == tokens && out.ndim() == 2 && out.size(1) == hidden &&
                    h.ndim() == 2 && h.size(0) == slots + (shared.empty() ? 0 : tokens),
                "moe_decode_down_combine: h {} ids {} out {}", h.describe(), topk_ids.describe(), out.describe());
  OwnedTensor slot_out(DType::kF32, {slots, hidden});
  cpu::moe_decode_down(h.slice(0, 0, slots), topk_ids, experts, *slot_out);
  OwnedTensor shared_out;
  if (!shared.empty()) {
    shared_out = OwnedTensor(DType::kF32, {tokens, hidden});
    linear(h.slice(0, slots, slots + tokens), shared.down, *shared_out, false);
  }
  cpu::moe_combine(*slot_out, topk_weights, shared.empty() ? Tensor() : *shared_out,
                   shared.empty() ? Tensor() : shared_gate_logits, out);
}

void moe_decode_down(const Tensor& h, const Tensor& topk_ids, const MoeExpertWeights& experts, const Tensor& slot_out) {
  check_experts(experts);
  const int64_t slots = topk_ids.numel();
  METRALE_CHECK(h.size(0) == slots && h.size(1) == experts.intermediate_size && slot_out.size(0) == slots &&
                    slot_out.size(1) == experts.hidden_size && slot_out.dtype() == DType::kF32 &&
                    topk_ids.is_contiguous(),
                "moe_decode_down: h {} ids {} out {}", h.describe(), topk_ids.describe(), slot_out.describe());
  const auto* ids = topk_ids.data_as<const int32_t>();
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = checked_expert(ids[s], experts);
    linear(h.slice(0, s, s + 1), experts.down[static_cast<size_t>(e)], slot_out.slice(0, s, s + 1), false);
  }
}

void moe_grouped_gate_up(const Tensor& x, const Tensor& sorted_slots, const Tensor& expert_offsets, int top_k,
                         const MoeExpertWeights& experts, const Tensor& h) {
  check_experts(experts);
  const int64_t slots = sorted_slots.numel(), hidden = experts.hidden_size, inter = experts.intermediate_size;
  METRALE_CHECK(top_k >= 1 && x.size(1) == hidden && x.size(0) * top_k == slots && h.size(0) == slots &&
                    h.size(1) == inter && expert_offsets.numel() == experts.num_experts + 1,
                "moe_grouped_gate_up: x {} sorted {} offsets {} h {}", x.describe(), sorted_slots.describe(),
                expert_offsets.describe(), h.describe());
  const auto* offsets = expert_offsets.data_as<const int32_t>();
  const auto* sorted = sorted_slots.data_as<const int32_t>();
  METRALE_CHECK(offsets[0] == 0 && offsets[experts.num_experts] == slots, "moe_grouped_gate_up: offsets span [{}, {})",
                offsets[0], offsets[experts.num_experts]);
  for (int64_t e = 0; e < experts.num_experts; ++e) {
    const int64_t begin = offsets[e], end = offsets[e + 1], rows = end - begin;
    METRALE_CHECK(rows >= 0 && end <= slots, "moe_grouped_gate_up: expert {} segment [{}, {})", e, begin, end);
    if (rows == 0) continue;
    std::vector<int32_t> token_rows(static_cast<size_t>(rows));
    for (int64_t p = 0; p < rows; ++p) token_rows[static_cast<size_t>(p)] = sorted[begin + p] / top_k;
    OwnedTensor expert_in(x.dtype(), {rows, hidden});
    gather_rows(x, Tensor(token_rows.data(), DType::kI32, {rows}), *expert_in);
    OwnedTensor gate(DType::kF32, {rows, inter}), up(DType::kF32, {rows, inter});
    linear(*expert_in, experts.gate[static_cast<size_t>(e)], *gate, false);
    linear(*expert_in, experts.up[static_cast<size_t>(e)], *up, false);
    for (int64_t p = 0; p < rows; ++p) {
      store_silu_mul(gate->data_as<const float>() + p * inter, up->data_as<const float>() + p * inter, inter,
                     experts.swiglu_limit, h, begin + p);
    }
  }
}

void moe_grouped_down(const Tensor& h, const Tensor& sorted_slots, const Tensor& expert_offsets,
                      const MoeExpertWeights& experts, const Tensor& slot_out) {
  check_experts(experts);
  const int64_t slots = sorted_slots.numel(), hidden = experts.hidden_size;
  METRALE_CHECK(h.size(0) == slots && h.size(1) == experts.intermediate_size && slot_out.size(0) == slots &&
                    slot_out.size(1) == hidden && slot_out.dtype() == DType::kF32 &&
                    expert_offsets.numel() == experts.num_experts + 1,
                "moe_grouped_down: h {} sorted {} offsets {} out {}", h.describe(), sorted_slots.describe(),
                expert_offsets.describe(), slot_out.describe());
  const auto* offsets = expert_offsets.data_as<const int32_t>();
  const auto* sorted = sorted_slots.data_as<const int32_t>();
  for (int64_t e = 0; e < experts.num_experts; ++e) {
    const int64_t begin = offsets[e], end = offsets[e + 1], rows = end - begin;
    METRALE_CHECK(rows >= 0 && begin >= 0 && end <= slots, "moe_grouped_down: expert {} segment [{}, {})", e, begin,
                  end);
    if (rows == 0) continue;
    OwnedTensor expert_out(DType::kF32, {rows, hidden});
    linear(h.slice(0, begin, end), experts.down[static_cast<size_t>(e)], *expert_out, false);
    for (int64_t p = 0; p < rows; ++p) {
      const int32_t slot = sorted[begin + p];
      METRALE_CHECK(slot >= 0 && slot < slots, "moe_grouped_down: slot {}", slot);
      std::copy_n(expert_out->data_as<const float>() + p * hidden, hidden,
                  static_cast<float*>(row_ptr_mut(slot_out, slot)));
    }
  }
}

void moe_combine(const Tensor& slot_out, const Tensor& topk_weights, const Tensor& shared_out,
                 const Tensor& shared_gate_logits, const Tensor& out) {
  const int64_t tokens = out.size(0), hidden = out.size(1), k = topk_weights.size(1);
  const bool shared = !shared_out.empty();
  METRALE_CHECK(slot_out.dtype() == DType::kF32 && slot_out.size(0) == tokens * k && slot_out.size(1) == hidden &&
                    topk_weights.dtype() == DType::kF32 && topk_weights.size(0) == tokens &&
                    topk_weights.is_contiguous() && slot_out.stride(1) == 1 && out.stride(1) == 1,
                "moe_combine: slot_out {} weights {} out {}", slot_out.describe(), topk_weights.describe(),
                out.describe());
  const bool gated = shared && !shared_gate_logits.empty();
  if (shared) {
    METRALE_CHECK(shared_out.dtype() == DType::kF32 && shared_out.size(0) == tokens && shared_out.size(1) == hidden &&
                      shared_out.stride(1) == 1,
                  "moe_combine: shared {}", shared_out.describe());
  }
  if (gated) {
    METRALE_CHECK(shared_gate_logits.dtype() == DType::kF32 && shared_gate_logits.numel() == tokens,
                  "moe_combine: shared gate {}", shared_gate_logits.describe());
  }
  const auto* weights = topk_weights.data_as<const float>();
  cpu_pool().parallel_for(tokens, 1, [&](int64_t begin, int64_t end) {
    float* acc = scratch_a(hidden);
    for (int64_t t = begin; t < end; ++t) {
      std::fill_n(acc, hidden, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const float w = weights[t * k + j];
        const auto* row = static_cast<const float*>(row_ptr(slot_out, t * k + j));
        for (int64_t c = 0; c < hidden; ++c) acc[c] += w * row[c];
      }
      if (gated) {
        const float logit = shared_gate_logits.data_as<const float>()[t * shared_gate_logits.stride(0)];
        const float gate = 1.0f / (1.0f + std::exp(-logit));
        const auto* row = static_cast<const float*>(row_ptr(shared_out, t));
        for (int64_t c = 0; c < hidden; ++c) acc[c] += gate * row[c];
      } else if (shared) {
        // The routed sum in out's dtype, then the shared expert added in that dtype.
        const auto* row = static_cast<const float*>(row_ptr(shared_out, t));
        for (int64_t c = 0; c < hidden; ++c) {
          acc[c] = round_as(out.dtype(), acc[c]) + round_as(out.dtype(), row[c]);
        }
      }
      store_f32(out.dtype(), acc, row_ptr_mut(out, t), hidden);
    }
  });
}

}  // namespace metrale::kernels::cpu
