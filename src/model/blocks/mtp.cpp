#include "model/blocks/mtp.h"

#include "core/error.h"
#include "kernels/embedding.h"
#include "kernels/linear.h"

namespace metrale {

MtpHead::MtpHead(MtpHeadParts parts, std::vector<Buffer> device_weights)
    : parts_(std::move(parts)), device_weights_(std::move(device_weights)) {
  METRALE_CHECK(!parts_.layers.empty(), "MTP head without layers");
}

std::vector<LayerCacheSpec> MtpHead::cache_specs() const {
  std::vector<LayerCacheSpec> specs;
  for (const auto& layer : parts_.layers) {
    specs.push_back(layer.mixer->cache_spec());
    METRALE_CHECK(specs.back().kind == LayerCacheKind::kPagedKv, "MTP layers are attention layers");
  }
  return specs;
}

size_t MtpHead::scratch_bytes(int64_t layer, const ForwardBatch& batch, Device device) const {
  return parts_.layers.at(static_cast<size_t>(layer)).mixer->scratch_bytes(batch, device);
}

void MtpHead::fused_input(const StepContext& step, const Tensor& trunk_embedding, const Tensor& hidden,
                          const Tensor& residual) {
  const int64_t tokens = step.batch.num_tokens, h = parts_.fc.size(0);
  METRALE_CHECK(
      hidden.ndim() == 2 && hidden.size(0) == tokens && hidden.size(1) == h && hidden.dtype() == step.activation_dtype,
      "MTP hidden {} for {} rows of {} ({})", hidden.describe(), tokens, h, dtype_name(step.activation_dtype));
  Arena& ws = step.workspace;
  const DType act = step.activation_dtype;
  const Tensor embedded = ws.alloc(act, {tokens, h});    // [T, H] embed(x_{t+1})
  const Tensor joined = ws.alloc(act, {tokens, 2 * h});  // [T, 2H] [e_t | g_t]
  kernels::embedding(step.batch.token_ids, parts_.embed_tokens.empty() ? trunk_embedding : parts_.embed_tokens,
                     embedded);
  parts_.pre_fc_norm_embedding.apply(embedded, joined.slice(1, 0, h));
  parts_.pre_fc_norm_hidden.apply(hidden, joined.slice(1, h, 2 * h));
  kernels::linear(joined, parts_.fc, residual);
}

void MtpHead::write_keys(const StepContext& step, const LayerCache& cache, int64_t layer, const Tensor& trunk_embedding,
                         const Tensor& hidden) {
  METRALE_CHECK(layer >= 0 && layer < num_layers(), "MTP layer {} of {}", layer, num_layers());
  const int64_t tokens = step.batch.num_tokens, h = parts_.fc.size(0);
  const Tensor residual = step.workspace.alloc(step.activation_dtype, {tokens, h});  // [T, H] u_t
  const Tensor normed = step.workspace.alloc(step.activation_dtype, {tokens, h});
  fused_input(step, trunk_embedding, hidden, residual);
  DecoderLayer& block = parts_.layers[static_cast<size_t>(layer)];
  try {
    block.input_norm.apply(residual, normed);
    block.mixer->write_keys(step, cache, normed);
  } catch (const Error& e) {
    rethrow_with_context(e, "MTP layer {} (keys)", layer);
  }
}

void MtpHead::forward(const StepContext& step, const LayerCache& cache, int64_t layer, const Tensor& trunk_embedding,
                      const Tensor& hidden, const Tensor& out) {
  METRALE_CHECK(layer >= 0 && layer < num_layers(), "MTP layer {} of {}", layer, num_layers());
  const int64_t tokens = step.batch.num_tokens, h = parts_.fc.size(0);
  METRALE_CHECK(out.ndim() == 2 && out.size(0) == tokens && out.size(1) == h, "MTP output {}", out.describe());
  Arena& ws = step.workspace;
  const DType act = step.activation_dtype;
  const Tensor residual = ws.alloc(act, {tokens, h});  // [T, H] u_t, then the layer's residual stream
  const Tensor normed = ws.alloc(act, {tokens, h});
  const Tensor sublayer = ws.alloc(act, {tokens, h});
  fused_input(step, trunk_embedding, hidden, residual);
  DecoderLayer& block = parts_.layers[static_cast<size_t>(layer)];
  try {
    block.input_norm.apply(residual, normed);
    block.mixer->forward(step, cache, normed, sublayer);
    block.post_norm.add_and_apply(residual, sublayer, normed);
    block.ffn->forward(step, normed, sublayer);
    parts_.norm.add_and_apply(residual, sublayer, out);
  } catch (const Error& e) {
    rethrow_with_context(e, "MTP layer {}", layer);
  }
}

}  // namespace metrale
