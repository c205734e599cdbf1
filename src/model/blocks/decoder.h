// DecoderModel: the pre-norm residual stack shared by the Qwen3 family:
//   h = embed(ids); per layer: h += mixer(norm_in(h)); h += ffn(norm_post(h));
//   logits = lm_head(norm_final(h)) for the batch's logit rows.
// Architecture files build the layers and hand them over; this class owns the forward loop.
#pragma once

#include <memory>
#include <vector>

#include "model/blocks/layer.h"
#include "model/blocks/norms.h"
#include "model/model.h"

namespace metrale {

struct DecoderLayer {
  RmsNorm input_norm;
  std::unique_ptr<Mixer> mixer;
  RmsNorm post_norm;
  std::unique_ptr<FeedForward> ffn;
};

struct DecoderParts {
  Tensor embed_tokens;  // [V, H]
  std::vector<DecoderLayer> layers;
  RmsNorm final_norm;
  Tensor lm_head;       // [V, H] (the embedding when tied)
};

class DecoderModel : public Model {
 public:
  DecoderModel(ModelConfig config, Weights& weights, DecoderParts parts);

  const ModelConfig& config() const override { return config_; }
  Device device() const override { return device_; }
  std::vector<LayerCacheSpec> cache_specs() const override;
  void forward(const ForwardBatch& batch, std::span<const LayerCache> caches, const Tensor& logits,
               Arena& workspace) override;

 private:
  ModelConfig config_;
  Device device_;
  std::shared_ptr<const WeightStore> store_;  // keeps mapped weights alive
  std::vector<Buffer> device_weights_;        // owned device copies (GPU builds)
  DecoderParts parts_;
};

// Loads the embedding and the LM head (tied or not) of a decoder model.
Tensor load_embedding(Weights& weights, const ModelConfig& config);
Tensor load_lm_head(Weights& weights, const ModelConfig& config, const Tensor& embedding);

}  // namespace metrale
