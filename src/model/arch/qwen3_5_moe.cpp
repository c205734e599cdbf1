// Qwen3.5-MoE text (model_type "qwen3_5_moe", its text config "qwen3_5_moe_text"): as Qwen3.5, with
// an MoE and sigmoid-gated shared expert in every layer whose router always renormalises the top-k
// weights (qwen.md §2.5, §4.5, §5.4). Experts load per expert or fused ([E, 2I, H] / [E, H, I]).
#include "model/arch/architectures.h"

namespace metrale::arch {

std::unique_ptr<Model> build_qwen3_5_moe(const ModelConfig& config, Weights& weights) {
  QwenHybridOptions options;
  options.gdn_layout = GdnProjectionLayout::kSplit;
  options.ffn = QwenHybridFfn::kMoe;
  options.default_num_experts = 256;
  options.default_top_k = 8;
  return build_qwen_hybrid(config, weights, options);
}

}  // namespace metrale::arch
