#include "model/blocks/kda.h"

#include <cmath>
#include <optional>
#include <vector>

#include "core/error.h"
#include "kernels/causal_conv1d.h"
#include "kernels/gated_rms_norm.h"
#include "kernels/kda.h"
#include "kernels/linear_weight.h"
#include "model/tensor_parallel.h"

namespace metrale {
Tensor KdaMixer::load_f32(Weights& weights, const std::string& key, const Shape& full, const TensorSlice& slice) {
  OwnedTensor placed(DType::kF32, slice.shape_of(full), weights.device());
  weights.load_into(key, full, slice, *placed);
  const Tensor view = *placed;
  owned_.push_back(std::move(placed));
  return view;
}

KdaMixer::KdaMixer(const KdaConfig& config, Weights& weights, const std::string& prefix) : config_(config) {
  const int64_t h = config.hidden_size, heads = config.num_heads, d = config.head_dim, k = config.conv_kernel;
  if (heads <= 0 || d <= 0 || k < 1 || h <= 0) {
    raise(ErrorCode::kBadFormat, "{}: invalid KDA sizes (linear_num_heads {}, linear_head_dim {}, conv kernel {})",
          weights.source_name(), heads, d, k);
  }
  // This rank's heads: all of them, or an even share under tensor parallelism.
  const std::optional<IndexRange> share = weights.tensor_parallel().split_share(heads);
  partial_ = share.has_value();
  const IndexRange local = share.value_or(IndexRange{0, heads});
  config_.num_heads = local.size();
  const int64_t p = config.projection_dim(), pl = config_.projection_dim();
  // Slices of the stored tensors (whole when the mixer is whole).
  const TensorSlice rows = partial_ ? unit_slice(local, d) : TensorSlice{};
  const TensorSlice conv_rows = partial_ ? unit_slice(local, d, 3, p) : TensorSlice{};
  TensorSlice heads_slice;  // rows of the per-head [H] and [H, D] tensors
  if (partial_) append_rows(heads_slice.rows, local);
  const TensorSlice out_columns = partial_ ? TensorSlice::of_columns(local.begin * d, local.end * d) : TensorSlice{};
  if (weights.device().is_cuda() && !weights.fp8_linears()) {
    OwnedTensor qkv(weights.compute_dtype(), {3 * pl, h}, weights.device());
    weights.load_into(prefix + "q_proj.weight", {p, h}, rows, qkv->slice(0, 0, pl));
    weights.load_into(prefix + "k_proj.weight", {p, h}, rows, qkv->slice(0, pl, 2 * pl));
    weights.load_into(prefix + "v_proj.weight", {p, h}, rows, qkv->slice(0, 2 * pl, 3 * pl));
    qkv_proj_ = *qkv;
    owned_.push_back(std::move(qkv));
  } else {
    q_proj_ = weights.get_linear(prefix + "q_proj.weight", {p, h}, rows);
    k_proj_ = weights.get_linear(prefix + "k_proj.weight", {p, h}, rows);
    v_proj_ = weights.get_linear(prefix + "v_proj.weight", {p, h}, rows);
  }
  // conv1d.weight [3P, 1, K] as [3P, K] f32; the hub layout stores q, k and v separately.
  OwnedTensor conv(DType::kF32, {3 * pl, k}, weights.device());
  if (weights.has(prefix + "conv1d.weight") || weights.is_random()) {
    weights.load_into(prefix + "conv1d.weight", {3 * p, 1, k}, conv_rows, conv->reshape({3 * pl, 1, k}));
  } else {
    const char* parts[] = {"q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"};
    for (int64_t i = 0; i < 3; ++i) {
      weights.load_into(prefix + parts[i], {p, 1, k}, rows, conv->slice(0, i * pl, (i + 1) * pl).reshape({pl, 1, k}));
    }
  }
  conv_weight_ = *conv;
  owned_.push_back(std::move(conv));
  f_a_ = weights.get_linear(prefix + "forget_gate.f_a_proj.weight", {d, h});
  f_b_ = weights.get_linear(prefix + "forget_gate.f_b_proj.weight", {p, d}, rows);
  dt_bias_ = load_f32(weights, prefix + "forget_gate.dt_bias", {p}, rows);
  a_log_ = load_f32(weights, prefix + "forget_gate.A_log", {heads}, heads_slice);
  b_proj_ = weights.get_linear(prefix + "b_proj.weight", {heads, h}, heads_slice);
  g_a_ = weights.get_linear(prefix + "g_a_proj.weight", {d, h});
  g_b_ = weights.get_linear(prefix + "g_b_proj.weight", {p, d}, rows);
  o_norm_ = weights.get(prefix + "o_norm.weight", {d});
  o_proj_ = weights.get_linear(prefix + "o_proj.weight", {h, p}, out_columns);
}

CacheSpec KdaMixer::cache_spec() const {
  return {{CacheTensorSpec::per_slot("conv", {config_.conv_kernel - 1, 3 * config_.projection_dim()}),
           CacheTensorSpec::per_slot("recurrent", {config_.num_heads, config_.head_dim, config_.head_dim},
                                     DType::kF32)}};
}

size_t KdaMixer::scratch_bytes(const ForwardBatch& batch, Device device) const {
  if (batch.all_decode() || batch.verify) return 0;  // the recurrent form needs no scratch
  return kernels::kda_workspace_bytes(device, batch.num_tokens, batch.num_seqs, config_.num_heads, config_.head_dim,
                                      config_.head_dim);
}

size_t KdaMixer::verify_scratch_bytes(int64_t num_tokens, int64_t /*num_seqs*/, DType activation) const {
  const auto rows = static_cast<size_t>(num_tokens), p = static_cast<size_t>(config_.projection_dim());
  const size_t element = dtype_size(activation);
  return verify_scratch_aligned(rows * 3 * p * element) + verify_scratch_aligned(rows * p * element) +
         verify_scratch_aligned(rows * static_cast<size_t>(config_.num_heads) * element);
}

KdaMixer::RowInputs KdaMixer::kept_inputs(const StepContext& step) const {
  const int64_t tokens = step.batch.num_tokens, p = config_.projection_dim();
  const size_t needed = verify_scratch_bytes(tokens, step.batch.num_seqs, step.activation_dtype);
  METRALE_CHECK(step.verify_scratch.nbytes() >= needed, "KDA layer: verify scratch {} for {} bytes",
                step.verify_scratch.describe(), needed);
  auto* base = static_cast<char*>(step.verify_scratch.data());
  const Device device = step.verify_scratch.device();
  const DType act = step.activation_dtype;
  RowInputs kept;
  kept.projected = Tensor(base, act, {tokens, 3 * p}, device);
  base += verify_scratch_aligned(kept.projected.nbytes());
  kept.f = Tensor(base, act, {tokens, p}, device);
  base += verify_scratch_aligned(kept.f.nbytes());
  kept.b = Tensor(base, act, {tokens, config_.num_heads}, device);
  return kept;
}

void KdaMixer::mix(const StepContext& step, const BlockCache& cache, const RowInputs& rows, const Tensor& cu_q,
                   const Tensor& kv_lens, const Tensor& slots, int64_t max_q_len, bool recurrent, bool write_state,
                   const Tensor& core) const {
  const int64_t tokens = rows.projected.size(0), heads = config_.num_heads, d = config_.head_dim;
  const int64_t p = config_.projection_dim();
  const DType act = step.activation_dtype;
  const Tensor conv_out = step.workspace.alloc(act, {tokens, 3 * p});  // [T, 3P] silu(conv(u))
  kernels::CausalConv1dParams conv_params;
  conv_params.silu = true;
  conv_params.max_q_len = max_q_len;
  conv_params.write_state = write_state;
  conv_params.round_conv = false;  // fp32 conv weights: silu on the fp32 sum, rounded once
  kernels::causal_conv1d(rows.projected, conv_weight_, cache.tensors[kConv], cu_q, kv_lens, slots, conv_out,
                         conv_params);
  const auto element = static_cast<int64_t>(conv_out.element_size());
  auto* base = static_cast<char*>(conv_out.data());
  const Shape shape{tokens, heads, d};
  const Shape strides{3 * p, d, 1};
  const Tensor q(base, act, shape, strides, conv_out.device());
  const Tensor k(base + p * element, act, shape, strides, conv_out.device());
  const Tensor v(base + 2 * p * element, act, shape, strides, conv_out.device());
  kernels::KdaParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(d));
  params.has_lower_bound = config_.lower_bound.has_value();
  params.lower_bound = static_cast<float>(config_.lower_bound.value_or(-5.0));
  params.max_q_len = max_q_len;
  params.write_state = write_state;
  if (recurrent) {
    kernels::kda_recurrent(q, k, v, rows.f, rows.b, a_log_, dt_bias_, cache.tensors[kRecurrent], cu_q, kv_lens, slots,
                           core, params);
  } else {
    if (!step.layer_scratch.empty()) params.workspace = step.layer_scratch;
    kernels::kda_chunked(q, k, v, rows.f, rows.b, a_log_, dt_bias_, cache.tensors[kRecurrent], cu_q, kv_lens, slots,
                         core, params);
  }
}

void KdaMixer::forward(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& out) {
  const ForwardBatch& batch = step.batch;
  const int64_t tokens = batch.num_tokens, heads = config_.num_heads, d = config_.head_dim;
  const int64_t p = config_.projection_dim();
  METRALE_CHECK(cache.tensors.size() == 2, "KDA layer: {} cache tensors, expected the conv and recurrent states",
                cache.tensors.size());
  METRALE_CHECK(batch.state_slots.numel() == batch.num_seqs, "KDA layer: state_slots {} for {} sequences",
                batch.state_slots.describe(), batch.num_seqs);
  if (tokens == 0) return;
  Arena& ws = step.workspace;
  const DType act = step.activation_dtype;
  RowInputs rows = batch.verify ? kept_inputs(step)
                                : RowInputs{ws.alloc(act, {tokens, 3 * p}), ws.alloc(act, {tokens, p}),
                                            ws.alloc(act, {tokens, heads})};
  if (!qkv_proj_.empty()) {
    kernels::linear(x, qkv_proj_, rows.projected);
  } else {
    kernels::linear(x, q_proj_, rows.projected.slice(1, 0, p));
    kernels::linear(x, k_proj_, rows.projected.slice(1, p, 2 * p));
    kernels::linear(x, v_proj_, rows.projected.slice(1, 2 * p, 3 * p));
  }
  const Tensor low_rank = ws.alloc(act, {tokens, d});  // [T, d] the rank-d bottleneck of f, then of gamma
  kernels::linear(x, f_a_, low_rank);
  kernels::linear(low_rank, f_b_, rows.f);
  kernels::linear(x, b_proj_, rows.b);

  const Tensor core = ws.alloc(act, {tokens, heads, d});  // [T, H, d]
  mix(step, cache, rows, batch.cu_q, batch.kv_lens, batch.state_slots, batch.max_q_len,
      batch.all_decode() || batch.verify, /*write_state=*/!batch.verify, core);

  const Tensor gate = ws.alloc(act, {tokens, p});  // [T, P] gamma
  kernels::linear(x, g_a_, low_rank);
  kernels::linear(low_rank, g_b_, gate);
  kernels::gated_rms_norm(core, gate.reshape({tokens, heads, d}), o_norm_, core,
                          static_cast<float>(config_.rms_norm_eps), kernels::GatedNormGate::kSigmoid);
  kernels::linear(core.reshape({tokens, p}), o_proj_, out);
}

void KdaMixer::commit(const StepContext& step, const BlockCache& cache, const VerifyCommit& kept_rows) {
  const int64_t tokens = step.batch.num_tokens;
  if (tokens == 0) return;
  // The verify rows again, split into kept parts (their slots) and rejected parts (slot -1): the
  // conv window and the state advance over the kept rows exactly as the verify forward computed.
  const Tensor core = step.workspace.alloc(step.activation_dtype, {tokens, config_.num_heads, config_.head_dim});
  mix(step, cache, kept_inputs(step), kept_rows.cu_parts, kept_rows.kv_lens, kept_rows.slots, kept_rows.max_rows,
      true, /*write_state=*/true, core);
}

}  // namespace metrale
