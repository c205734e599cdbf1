// DecoderModel: the decoder stack shared by the Qwen3 family and the models after it:
//   streams = residual.begin(embed(ids)); per layer: its stream blocks, then the mixer and FFN sites
//   joined by the residual scheme; hidden = residual.finish(streams);
//   logits = lm_head(hidden) for the batch's logit rows.
// Architecture files build the layers, the residual scheme (the pre-norm residual for Qwen3:
// blocks/pre_norm.h) and the optional MTP head and hand them over; this class owns the forward, the
// MTP step and the commit of verify steps. Its stateful blocks are the trunk's (LayerStack order);
// the MTP head's come through ModelCaches::mtp.
#pragma once

#include <memory>
#include <vector>

#include "model/blocks/layer.h"
#include "model/blocks/layer_stack.h"
#include "model/blocks/mtp.h"
#include "model/blocks/residual.h"
#include "model/blocks/token_embedding.h"
#include "model/model.h"

namespace metrale {

struct DecoderParts {
  TokenEmbedding embed_tokens;  // [V, H], or a tensor-parallel rank's rows
  std::vector<DecoderLayer> layers;
  std::unique_ptr<ResidualScheme> residual;  // two sites per layer, and the final norm
  Tensor lm_head;                            // [V, H] (the embedding when tied)
  std::unique_ptr<MtpHead> mtp;              // optional draft head
};

class DecoderModel : public Model {
 public:
  DecoderModel(ModelConfig config, Weights& weights, DecoderParts parts);

  const ModelConfig& config() const override { return config_; }
  Device device() const override { return device_; }
  DType activation_dtype() const override { return activation_dtype_; }
  ModelCapabilities capabilities() const override;
  std::vector<CacheSpec> cache_specs() const override { return trunk_.cache_specs(); }
  std::vector<StepInputSpec> step_input_specs() const override { return trunk_.step_input_specs(); }
  void prestage(const PrestageRows& rows, std::span<const Tensor> host_inputs) const override;
  void forward(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& logits, Arena& workspace) override;

  size_t verify_scratch_bytes(int64_t num_tokens, int64_t num_seqs) const override;
  double routed_weight_bytes(int64_t rows) const override { return trunk_.routed_weight_bytes(rows); }
  void commit_verified(const ForwardBatch& batch, std::span<const int32_t> kept_rows, const ModelCaches& caches,
                       Arena& workspace) override;
  void commit_kept_rows(const ForwardBatch& batch, const VerifyCommit& kept, const ModelCaches& caches,
                        Arena& workspace) override;

  bool has_mtp() const override { return mtp_ != nullptr; }
  int64_t num_mtp_layers() const override { return mtp_ ? mtp_->num_layers() : 0; }
  std::vector<CacheSpec> mtp_cache_specs() const override;
  void mtp_forward(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& hidden, const Tensor& logits,
                   Arena& workspace, int64_t mtp_layer) override;
  void mtp_write_keys(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& hidden, Arena& workspace,
                      int64_t mtp_layer) override;

  const LayerStack& trunk() const { return trunk_; }

 private:
  MtpHead& mtp_head(int64_t mtp_layer) const;
  // logits [R, V] = lm_head(final_hidden[logit_rows]); final_hidden [T, H].
  void compute_logits(const ForwardBatch& batch, const Tensor& final_hidden, const Tensor& logits,
                      Arena& workspace) const;

  ModelConfig config_;
  Device device_;
  DType activation_dtype_;                    // Weights::compute_dtype() of the load
  std::shared_ptr<const WeightStore> store_;  // keeps mapped weights alive
  std::vector<Buffer> device_weights_;        // owned device copies (GPU builds)
  TokenEmbedding embed_tokens_;
  Tensor lm_head_;
  LayerStack trunk_;
  std::unique_ptr<MtpHead> mtp_;
  Communicator* communicator_;  // the tensor-parallel group (null: one rank)
  // The hidden columns lm_head_ [V, columns] covers: all of them, or a tensor-parallel rank's share.
  IndexRange lm_head_columns_;
};

// Loads the embedding and the LM head (tied or not) of a decoder model. Under tensor parallelism the
// LM head is the rank's share of the hidden columns [V, H / size] (when H splits evenly): the same
// weight and FLOP share as a vocabulary split, summed by one all-reduce of the logits instead of an
// all-gather and a transpose.
TokenEmbedding load_embedding(Weights& weights, const ModelConfig& config);
Tensor load_lm_head(Weights& weights, const ModelConfig& config, const TokenEmbedding& embedding);

}  // namespace metrale
