// The multi-token-prediction (MTP) draft head of Qwen3-Next and Qwen3.5 checkpoints (`mtp.*`
// weights, models/demo/README.md §"MTP head", as vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py run it).
// Row r at trunk position t with h_t (the trunk's final hidden state, after its final norm) and the
// next token x_{t+1}:
//   e = RMSNorm(embed_tokens[x_{t+1}]; pre_fc_norm_embedding)      [H]
//   g = RMSNorm(h_t; pre_fc_norm_hidden)                          [H]
//   u = fc · [e | g]                                              fc [H, 2H], columns [0, H) take e
//   d = DecoderLayer(u)   a full-attention layer like the trunk's, with its own paged KV cache
//   o = RMSNorm(d; norm)  (the fused residual add of the layer's FFN output, then the norm)
//   draft logits = lm_head · o  (the trunk's LM head, shared)
// o_t is also the hidden state of a chained draft (vLLM feeds it back with the drafted token).
//
// The KV cache of MTP layer i is a kPagedKv spec (cache_specs()), laid out like the trunk's attention
// layers and addressed through the trunk's block tables and slot mapping: position t's MTP key sits
// in the same cache slot as position t's trunk keys.
//
// Workspace per step (allocated in this order): residual, normed, sublayer [T, H] (write_keys: the
// first two), embedded [T, H], joined [T, 2H], all in the activation dtype, then the layer's own
// temporaries.
#pragma once

#include <vector>

#include "model/blocks/layer.h"
#include "runtime/buffer.h"

namespace metrale {

struct MtpHeadParts {
  RmsNorm pre_fc_norm_embedding;  // [H]
  RmsNorm pre_fc_norm_hidden;     // [H]
  Tensor fc;                      // [H, 2H]
  std::vector<DecoderLayer> layers;
  RmsNorm norm;         // [H]
  Tensor embed_tokens;  // [V, H] when the head has its own embedding; empty: the trunk's
};

class MtpHead {
 public:
  // `device_weights`: device copies of the head's weights (GPU), kept alive with the head.
  MtpHead(MtpHeadParts parts, std::vector<Buffer> device_weights);

  int64_t num_layers() const { return static_cast<int64_t>(parts_.layers.size()); }
  std::vector<LayerCacheSpec> cache_specs() const;
  // Bytes of StepContext::layer_scratch layer `layer` needs for `batch`.
  size_t scratch_bytes(int64_t layer, const ForwardBatch& batch, Device device) const;
  // hidden [T, H], out [T, H] (o_t) in the activation dtype; `trunk_embedding` [V, H] is used unless
  // the head has its own. `cache` is layer `layer`'s paged KV.
  void forward(const StepContext& step, const LayerCache& cache, int64_t layer, const Tensor& trunk_embedding,
               const Tensor& hidden, const Tensor& out);
  // Only the keys forward() writes to `cache` for these rows (u, the layer's input norm, its K/V
  // projection): rows whose output nobody reads, e.g. every catch-up row but a sequence's last.
  void write_keys(const StepContext& step, const LayerCache& cache, int64_t layer, const Tensor& trunk_embedding,
                  const Tensor& hidden);

 private:
  // u = fc · [e | g] of the rows (see above) into `residual` [T, H]; checks the shapes.
  void fused_input(const StepContext& step, const Tensor& trunk_embedding, const Tensor& hidden,
                   const Tensor& residual);

  MtpHeadParts parts_;
  std::vector<Buffer> device_weights_;
};

}  // namespace metrale
