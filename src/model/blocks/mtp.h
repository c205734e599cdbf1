// The multi-token-prediction (MTP) draft head of Qwen3-Next and Qwen3.5 checkpoints (`mtp.*`
// weights, models/demo/README.md §"MTP head", as vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py run it).
// Row r at trunk position t with h_t (the trunk's final hidden state, after its final norm) and the
// next token x_{t+1}:
//   e = RMSNorm(embed_tokens[x_{t+1}]; pre_fc_norm_embedding)      [H]
//   g = RMSNorm(h_t; pre_fc_norm_hidden)                          [H]
//   u = fc · [e | g]                                              fc [H, 2H], columns [0, H) take e
//   d = DecoderLayer(u)   a full-attention layer like the trunk's, with its own paged KV cache, in
//                         the head's own pre-norm residual (PreNormResidual: the layers' norms,
//                         `norm` as the final one)
//   o = RMSNorm(d; norm)  (the fused residual add of the layer's FFN output, then the norm)
//   draft logits = lm_head · o  (the trunk's LM head, shared)
// o_t is also the hidden state of a chained draft (vLLM feeds it back with the drafted token).
//
// The cache of MTP layer i (cache_specs()[i], ModelCaches::mtp[i]) is its attention's {k, v} per
// token, laid out like the trunk's attention layers and addressed through the trunk's block tables
// and slot mapping: position t's MTP key sits in the same cache slot as position t's trunk keys. An
// MTP layer has exactly one stateful block (its mixer) and reads no step inputs.
//
// Workspace per step (allocated in this order): the residual streams (allocate()), normed, sublayer
// [T, H] (write_keys: the first two), embedded [T, H], joined [T, 2H], all in the activation dtype,
// then the layer's own temporaries.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "kernels/linear_weight.h"
#include "model/blocks/layer.h"
#include "model/blocks/layer_stack.h"
#include "model/blocks/norms.h"
#include "model/blocks/residual.h"
#include "model/blocks/token_embedding.h"
#include "runtime/buffer.h"

namespace metrale {

struct MtpHeadParts {
  RmsNorm pre_fc_norm_embedding;  // [H]
  RmsNorm pre_fc_norm_hidden;     // [H]
  kernels::LinearWeight fc;       // [H, 2H], plain or FP8
  std::vector<DecoderLayer> layers;
  // The layers' sites and the head's final norm `norm` [H] (PreNormResidual for Qwen3.5 / Qwen3-Next).
  std::unique_ptr<ResidualScheme> residual;
  Tensor embed_tokens;  // [V, H] when the head has its own embedding; empty: the trunk's
};

class MtpHead {
 public:
  // `device_weights`: device copies of the head's weights (GPU), kept alive with the head.
  MtpHead(MtpHeadParts parts, std::vector<Buffer> device_weights);

  int64_t num_layers() const { return layers_.num_layers(); }
  // One per layer, in layer order.
  std::vector<CacheSpec> cache_specs() const { return layers_.cache_specs(); }
  BlockCapabilities capabilities() const { return layers_.capabilities(); }
  // Bytes of StepContext::layer_scratch layer `layer` needs for `batch`.
  size_t scratch_bytes(int64_t layer, const ForwardBatch& batch, Device device) const;
  // hidden [T, H], out [T, H] (o_t) in the activation dtype; `trunk_embedding` (the trunk's table,
  // or a tensor-parallel rank's rows of it) is used unless the head has its own. `caches`: one per
  // layer (ModelCaches::mtp).
  void forward(const StepContext& step, std::span<const BlockCache> caches, int64_t layer,
               const TokenEmbedding& trunk_embedding, const Tensor& hidden, const Tensor& out);
  // Only the keys forward() writes for these rows (u, the layer's input norm, its K/V projection):
  // rows whose output nobody reads, e.g. every catch-up row but a sequence's last.
  void write_keys(const StepContext& step, std::span<const BlockCache> caches, int64_t layer,
                  const TokenEmbedding& trunk_embedding, const Tensor& hidden);

 private:
  // u = fc · [e | g] of the rows (see above) into `residual` [T, H]; checks the shapes.
  void fused_input(const StepContext& step, const TokenEmbedding& trunk_embedding, const Tensor& hidden,
                   const Tensor& residual);

  RmsNorm pre_fc_norm_embedding_, pre_fc_norm_hidden_;
  kernels::LinearWeight fc_;
  Tensor embed_tokens_;
  LayerStack layers_;
  std::vector<Buffer> device_weights_;
};

}  // namespace metrale
