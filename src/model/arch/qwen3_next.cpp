// Qwen3-Next (model_type "qwen3_next"): Gated DeltaNet layers with the grouped in_proj_qkvz /
// in_proj_ba projections and gated full attention every full_attention_interval-th layer; the FFN of
// layer i is an MoE with a sigmoid-gated shared expert when i is not in mlp_only_layers and
// (i + 1) % decoder_sparse_step == 0, else a dense SwiGLU MLP (qwen.md §2.4, §4.4, §5.3).
#include "model/arch/architectures.h"

namespace metrale::arch {

std::unique_ptr<Model> build_qwen3_next(const ModelConfig& config, Weights& weights) {
  QwenHybridOptions options;
  options.gdn_layout = GdnProjectionLayout::kGroupedQkvz;
  options.ffn = QwenHybridFfn::kSparseStepRule;
  options.default_intermediate_size = 5632;
  options.default_num_experts = 512;
  options.default_top_k = 10;
  return build_qwen_hybrid(config, weights, options);
}

}  // namespace metrale::arch
