// Builders of every architecture, one per file in this folder, listed once in model/registry.cpp.
#pragma once

#include <memory>
#include <vector>

#include "model/blocks/attention.h"
#include "model/blocks/gdn.h"
#include "model/config.h"
#include "model/model.h"
#include "model/weight_store.h"

namespace metrale::arch {

std::unique_ptr<Model> build_qwen3(const ModelConfig& config, Weights& weights);
std::unique_ptr<Model> build_qwen3_moe(const ModelConfig& config, Weights& weights);
std::unique_ptr<Model> build_qwen3_next(const ModelConfig& config, Weights& weights);
std::unique_ptr<Model> build_qwen3_5(const ModelConfig& config, Weights& weights);
std::unique_ptr<Model> build_qwen3_5_moe(const ModelConfig& config, Weights& weights);
std::unique_ptr<Model> build_qwen4_exp(const ModelConfig& config, Weights& weights);
std::unique_ptr<Model> build_glm5_next(const ModelConfig& config, Weights& weights);
// The tensors of a glm5_next checkpoint the reference does not read either: the MTP layer when
// no head is built, other layers' shared_head copies, a composite checkpoint's vision tower.
bool glm5_next_ignores(const ModelConfig& config, std::string_view name);

// Shared by the Qwen3 family files.
AttentionConfig qwen3_attention_config(const ModelConfig& config);
std::vector<int> qwen3_sliding_windows(const ModelConfig& config);

// The Qwen hybrid family (qwen3_next, qwen3_5, qwen3_5_moe), model/arch/qwen_hybrid.cpp.
enum class QwenHybridFfn {
  kSparseStepRule,  // qwen3_next: MoE unless in mlp_only_layers or off the decoder_sparse_step
  kDense,           // qwen3_5: SwiGLU MLP of intermediate_size everywhere
  kMoe,             // qwen3_5_moe: MoE + shared expert everywhere, top-k always renormalised
};
struct QwenHybridOptions {
  GdnProjectionLayout gdn_layout = GdnProjectionLayout::kSplit;
  QwenHybridFfn ffn = QwenHybridFfn::kDense;
  // The model's defaults for fields a config.json may omit.
  int64_t default_intermediate_size = 0;
  int64_t default_num_experts = 0;
  int64_t default_top_k = 0;
};
std::unique_ptr<Model> build_qwen_hybrid(const ModelConfig& config, Weights& weights, const QwenHybridOptions& options);
// true for full_attention layers, from layer_types (legacy names accepted) or full_attention_interval.
std::vector<bool> qwen_hybrid_full_attention_layers(const ModelConfig& config);
// partial_rotary_factor from the config, or the 0.25 these models inject when it is absent.
double qwen_hybrid_partial_rotary_factor(const ModelConfig& config);

// qwen4_exp's layer kinds (model/arch/qwen4_exp.cpp): attention[i] for qwen_sparse_attention layers
// (layer_types, full_attention rewritten, or every full_attention_interval-th layer), ple_layers the
// 0-based, sorted, de-duplicated ple_layer_ids (each a linear_attention layer). kBadFormat otherwise.
struct Qwen4ExpLayout {
  std::vector<bool> attention;
  std::vector<int64_t> ple_layers;
};
Qwen4ExpLayout qwen4_exp_layout(const ModelConfig& config);

}  // namespace metrale::arch
