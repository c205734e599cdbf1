#include "model/blocks/decoder.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/embedding.h"
#include "kernels/linear.h"
#include "kernels/moe.h"

namespace metrale {

Tensor load_embedding(Weights& weights, const ModelConfig& config) {
  return weights.get("embed_tokens.weight", {config.vocab_size, config.hidden_size});
}

Tensor load_lm_head(Weights& weights, const ModelConfig& config, const Tensor& embedding) {
  if (weights.has_root("lm_head.weight")) {
    return weights.get_root("lm_head.weight", {config.vocab_size, config.hidden_size});
  }
  if (!config.tie_word_embeddings) {
    raise(ErrorCode::kNotFound, "{}: checkpoint has no 'lm_head.weight' and tie_word_embeddings is false",
          weights.source_name());
  }
  return embedding;
}

DecoderModel::DecoderModel(ModelConfig config, Weights& weights, DecoderParts parts)
    : config_(std::move(config)),
      device_(weights.device()),
      store_(weights.store_ptr()),
      device_weights_(weights.take_device_buffers()),
      parts_(std::move(parts)) {}

std::vector<LayerCacheSpec> DecoderModel::cache_specs() const {
  std::vector<LayerCacheSpec> specs;
  specs.reserve(parts_.layers.size());
  for (const auto& layer : parts_.layers) specs.push_back(layer.mixer->cache_spec());
  return specs;
}

void DecoderModel::forward(const ForwardBatch& batch, std::span<const LayerCache> caches, const Tensor& logits,
                           Arena& workspace) {
  METRALE_CHECK(caches.size() == parts_.layers.size(), "{} layer caches for {} layers", caches.size(),
                parts_.layers.size());
  const int64_t tokens = batch.num_tokens, hidden = config_.hidden_size;
  // The CPU is the fp32 reference; the GPU keeps bf16 activations (fp32 inside kernels), as the
  // checkpoints' own bf16 inference does.
  const DType act = device_.is_cpu() ? DType::kF32 : DType::kBF16;
  StepContext step{batch, workspace, act, Tensor()};
  size_t scratch = 0;
  for (const auto& layer : parts_.layers) scratch = std::max(scratch, layer.mixer->scratch_bytes(batch, device_));
  if (scratch > 0) step.layer_scratch = workspace.alloc(DType::kU8, {static_cast<int64_t>(scratch)});
  const Tensor residual = workspace.alloc(act, {tokens, hidden});  // [T, H] the residual stream h
  const Tensor normed = workspace.alloc(act, {tokens, hidden});    // [T, H] normalised sublayer input
  const Tensor sublayer = workspace.alloc(act, {tokens, hidden});  // [T, H] sublayer output
  kernels::embedding(batch.token_ids, parts_.embed_tokens, residual);
  parts_.layers.front().input_norm.apply(residual, normed);
  for (size_t i = 0; i < parts_.layers.size(); ++i) {
    DecoderLayer& layer = parts_.layers[i];
    const Arena::Scope layer_temporaries(workspace);
    try {
      layer.mixer->forward(step, caches[i], normed, sublayer);
      layer.post_norm.add_and_apply(residual, sublayer, normed);
      layer.ffn->forward(step, normed, sublayer);
      const RmsNorm& next_norm = i + 1 < parts_.layers.size() ? parts_.layers[i + 1].input_norm : parts_.final_norm;
      next_norm.add_and_apply(residual, sublayer, normed);
    } catch (const Error& e) {
      rethrow_with_context(e, "layer {}", i);
    }
  }
  // Only the requested rows reach the LM head.
  const int64_t rows = batch.logit_rows.numel();
  METRALE_CHECK(logits.size(0) == rows && logits.size(1) == config_.vocab_size, "logits {} for {} rows",
                logits.describe(), rows);
  const Tensor selected = workspace.alloc(act, {rows, hidden});
  kernels::gather_rows(normed, batch.logit_rows, selected);
  kernels::linear(selected, parts_.lm_head, logits);
}

}  // namespace metrale
