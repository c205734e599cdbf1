#include "model/blocks/mtp.h"

#include "core/error.h"
#include "kernels/embedding.h"
#include "kernels/linear_weight.h"

namespace metrale {

MtpHead::MtpHead(MtpHeadParts parts, std::vector<Buffer> device_weights)
    : pre_fc_norm_embedding_(std::move(parts.pre_fc_norm_embedding)),
      pre_fc_norm_hidden_(std::move(parts.pre_fc_norm_hidden)),
      fc_(parts.fc),
      embed_tokens_(parts.embed_tokens),
      layers_(std::move(parts.layers), std::move(parts.residual), "MTP layer"),
      device_weights_(std::move(device_weights)) {
  METRALE_CHECK(layers_.num_layers() > 0, "MTP head without layers");
  for (int64_t i = 0; i < layers_.num_layers(); ++i) {
    const auto [first, end] = layers_.layer_blocks(i);
    METRALE_CHECK(end - first == 1 && static_cast<int64_t>(first) == i, "MTP layer {}: stream blocks are not supported",
                  i);
  }
  METRALE_CHECK(layers_.step_input_specs().empty(), "MTP layers read no step inputs");
}

size_t MtpHead::scratch_bytes(int64_t layer, const ForwardBatch& batch, Device device) const {
  return layers_.scratch_bytes(batch, device, layer, layer + 1);
}

void MtpHead::fused_input(const StepContext& step, const TokenEmbedding& trunk_embedding, const Tensor& hidden,
                          const Tensor& residual) {
  const int64_t tokens = step.batch.num_tokens, h = fc_.size(0);
  METRALE_CHECK(
      hidden.ndim() == 2 && hidden.size(0) == tokens && hidden.size(1) == h && hidden.dtype() == step.activation_dtype,
      "MTP hidden {} for {} rows of {} ({})", hidden.describe(), tokens, h, dtype_name(step.activation_dtype));
  Arena& ws = step.workspace;
  const DType act = step.activation_dtype;
  const Tensor embedded = ws.alloc(act, {tokens, h});    // [T, H] embed(x_{t+1})
  const Tensor joined = ws.alloc(act, {tokens, 2 * h});  // [T, 2H] [e_t | g_t]
  if (embed_tokens_.empty()) {
    trunk_embedding.lookup(step, step.batch.token_ids, embedded);
  } else {
    kernels::embedding(step.batch.token_ids, embed_tokens_, embedded);
  }
  pre_fc_norm_embedding_.apply(embedded, joined.slice(1, 0, h));
  pre_fc_norm_hidden_.apply(hidden, joined.slice(1, h, 2 * h));
  kernels::linear(joined, fc_, residual);
}

void MtpHead::write_keys(const StepContext& step, std::span<const BlockCache> caches, int64_t layer,
                         const TokenEmbedding& trunk_embedding, const Tensor& hidden) {
  METRALE_CHECK(layer >= 0 && layer < num_layers(), "MTP layer {} of {}", layer, num_layers());
  const int64_t tokens = step.batch.num_tokens, h = fc_.size(0);
  const ResidualScheme& scheme = layers_.residual();
  const ResidualStreams streams = scheme.allocate(step);  // u_t, then the layer's residual
  const Tensor normed = step.workspace.alloc(step.activation_dtype, {tokens, h});
  fused_input(step, trunk_embedding, hidden, streams.input);
  scheme.begin(step, streams);
  layers_.write_keys(step, caches, streams, layer, normed);
}

void MtpHead::forward(const StepContext& step, std::span<const BlockCache> caches, int64_t layer,
                      const TokenEmbedding& trunk_embedding, const Tensor& hidden, const Tensor& out) {
  METRALE_CHECK(layer >= 0 && layer < num_layers(), "MTP layer {} of {}", layer, num_layers());
  const int64_t tokens = step.batch.num_tokens, h = fc_.size(0);
  METRALE_CHECK(out.ndim() == 2 && out.size(0) == tokens && out.size(1) == h, "MTP output {}", out.describe());
  Arena& ws = step.workspace;
  const DType act = step.activation_dtype;
  const ResidualScheme& scheme = layers_.residual();
  const ResidualStreams streams = scheme.allocate(step);  // u_t, then the layer's residual
  const Tensor normed = ws.alloc(act, {tokens, h});
  const Tensor sublayer = ws.alloc(act, {tokens, h});
  fused_input(step, trunk_embedding, hidden, streams.input);
  scheme.begin(step, streams);
  layers_.forward(step, caches, streams, layer, layer + 1, normed, sublayer, out);
}

}  // namespace metrale
