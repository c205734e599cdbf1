// DecoderModel: the pre-norm residual stack shared by the Qwen3 family:
//   h = embed(ids); per layer: h += mixer(norm_in(h)); h += ffn(norm_post(h));
//   logits = lm_head(norm_final(h)) for the batch's logit rows.
// Architecture files build the layers (and the optional MTP head) and hand them over; this class
// owns the forward loop, the MTP step and the commit of verify steps.
#pragma once

#include <memory>
#include <vector>

#include "model/blocks/layer.h"
#include "model/blocks/mtp.h"
#include "model/model.h"

namespace metrale {

struct DecoderParts {
  Tensor embed_tokens;  // [V, H]
  std::vector<DecoderLayer> layers;
  RmsNorm final_norm;
  Tensor lm_head;                // [V, H] (the embedding when tied)
  std::unique_ptr<MtpHead> mtp;  // optional draft head
};

class DecoderModel : public Model {
 public:
  DecoderModel(ModelConfig config, Weights& weights, DecoderParts parts);

  const ModelConfig& config() const override { return config_; }
  Device device() const override { return device_; }
  std::vector<LayerCacheSpec> cache_specs() const override;
  void forward(const ForwardBatch& batch, std::span<const LayerCache> caches, const Tensor& logits,
               Arena& workspace) override;

  size_t verify_scratch_bytes(int64_t num_tokens, int64_t num_seqs) const override;
  void commit_verified(const ForwardBatch& batch, std::span<const int32_t> kept_rows,
                       std::span<const LayerCache> caches, Arena& workspace) override;
  void commit_kept_rows(const ForwardBatch& batch, const VerifyCommit& kept, std::span<const LayerCache> caches,
                        Arena& workspace) override;

  bool has_mtp() const override { return parts_.mtp != nullptr; }
  int64_t num_mtp_layers() const override { return parts_.mtp ? parts_.mtp->num_layers() : 0; }
  std::vector<LayerCacheSpec> mtp_cache_specs() const override;
  void mtp_forward(const ForwardBatch& batch, std::span<const LayerCache> caches, const Tensor& hidden,
                   const Tensor& logits, Arena& workspace, int64_t mtp_layer) override;
  void mtp_write_keys(const ForwardBatch& batch, std::span<const LayerCache> caches, const Tensor& hidden,
                      Arena& workspace, int64_t mtp_layer) override;

 private:
  DType activation_dtype() const;
  // The index in `caches` of MTP layer `mtp_layer`'s KV; throws when there is no such layer.
  size_t mtp_cache_index(std::span<const LayerCache> caches, int64_t mtp_layer) const;
  // Offsets of each layer's region in ForwardBatch::verify_scratch, and the total ([layers + 1]).
  std::vector<size_t> verify_scratch_offsets(int64_t num_tokens, int64_t num_seqs) const;
  // logits [R, V] = lm_head(final_hidden[logit_rows]); final_hidden [T, H].
  void compute_logits(const ForwardBatch& batch, const Tensor& final_hidden, const Tensor& logits,
                      Arena& workspace) const;

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
