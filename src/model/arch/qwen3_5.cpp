// Qwen3.5 text (model_type "qwen3_5", its text config "qwen3_5_text"): Gated DeltaNet layers with
// the split in_proj_qkv / z / b / a projections, gated full attention, a dense SwiGLU MLP in every
// layer (qwen.md §2.5, §4.5, §5.4). Weights under model. or model.language_model.; the MTP head from
// mtp.* when present (blocks/mtp.h); model.visual.* is never read.
#include "model/arch/architectures.h"

namespace metrale::arch {

std::unique_ptr<Model> build_qwen3_5(const ModelConfig& config, Weights& weights) {
  QwenHybridOptions options;
  options.gdn_layout = GdnProjectionLayout::kSplit;
  options.ffn = QwenHybridFfn::kDense;
  options.default_intermediate_size = 12288;
  return build_qwen_hybrid(config, weights, options);
}

}  // namespace metrale::arch
