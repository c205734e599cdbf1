#include "model/blocks/gdn.h"

#include <cmath>
#include <optional>
#include <vector>

#include "core/error.h"
#include "kernels/causal_conv1d.h"
#include "kernels/gated_delta_rule.h"
#include "kernels/gated_rms_norm.h"
#include "kernels/linear_weight.h"
#include "kernels/moe.h"

namespace metrale {
namespace {

// The source rows of the kernels' rows [Q | K | V | Z] and [B | A] of this rank's heads (all of them
// when the mixer is whole), for either checkpoint layout: the gathers that load in_proj_*.
struct GdnRows {
  TensorSlice qkv, z, ba_b, ba_a;        // kSplit: rows of in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
  TensorSlice qkvz, ba;                  // kGroupedQkvz: rows of in_proj_qkvz, in_proj_ba (kernel order)
  TensorSlice conv, heads, out_columns;  // conv1d channels, value heads (dt_bias, A_log), out_proj columns
};

GdnRows gdn_rows(const GdnConfig& full, const TensorParallel::GroupedHeads* share) {
  const int64_t hk = full.num_k_heads, hv = full.num_v_heads, dk = full.head_k_dim, dv = full.head_v_dim;
  const int64_t key_dim = full.key_dim(), conv_dim = full.conv_dim();
  const IndexRange v_heads = share ? share->heads : IndexRange{0, hv};
  const IndexRange k_heads = share ? share->groups : IndexRange{0, hk};
  // Full kernel-order rows of this rank, in the local kernel order.
  std::vector<int64_t> qkv, z, b, a;
  append_rows(qkv, unit_rows(0, k_heads.begin, k_heads.size(), dk));
  append_rows(qkv, unit_rows(key_dim, k_heads.begin, k_heads.size(), dk));
  append_rows(qkv, unit_rows(2 * key_dim, v_heads.begin, v_heads.size(), dv));
  append_rows(z, unit_rows(0, v_heads.begin, v_heads.size(), dv));
  append_rows(b, v_heads);
  append_rows(a, v_heads);
  GdnRows rows;
  if (share) {
    rows.conv = TensorSlice::of_rows(qkv);
    rows.heads = TensorSlice::of_rows(b);
    rows.out_columns = TensorSlice::of_columns(v_heads.begin * dv, v_heads.end * dv);
  }
  if (full.layout == GdnProjectionLayout::kSplit) {
    if (share) {
      rows.qkv = TensorSlice::of_rows(qkv);
      rows.z = TensorSlice::of_rows(z);
      rows.ba_b = TensorSlice::of_rows(b);
      rows.ba_a = TensorSlice::of_rows(a);
    }
    return rows;
  }
  // Qwen3-Next groups the rows by key head g: [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)] and
  // [b_g (r) | a_g (r)]. source_of_* maps a kernel-order row [Q | K | V | Z], [B | A] to its stored row.
  const int64_t ratio = hv / hk, group = 2 * dk + 2 * ratio * dv;
  std::vector<int64_t> source_of_qkvz(static_cast<size_t>(conv_dim + full.value_dim()));
  for (int64_t r = 0; r < static_cast<int64_t>(source_of_qkvz.size()); ++r) {
    const int64_t g = r / group, offset = r % group;
    int64_t kernel_row;
    if (offset < dk) {
      kernel_row = g * dk + offset;
    } else if (offset < 2 * dk) {
      kernel_row = key_dim + g * dk + (offset - dk);
    } else if (offset < 2 * dk + ratio * dv) {
      kernel_row = 2 * key_dim + g * ratio * dv + (offset - 2 * dk);
    } else {
      kernel_row = conv_dim + g * ratio * dv + (offset - 2 * dk - ratio * dv);
    }
    source_of_qkvz[static_cast<size_t>(kernel_row)] = r;
  }
  std::vector<int64_t> source_of_ba(static_cast<size_t>(2 * hv));
  for (int64_t r = 0; r < 2 * hv; ++r) {
    const int64_t g = r / (2 * ratio), offset = r % (2 * ratio);
    source_of_ba[static_cast<size_t>(offset < ratio ? g * ratio + offset : hv + g * ratio + (offset - ratio))] = r;
  }
  for (const int64_t row : qkv) rows.qkvz.rows.push_back(source_of_qkvz[static_cast<size_t>(row)]);
  for (const int64_t row : z) rows.qkvz.rows.push_back(source_of_qkvz[static_cast<size_t>(conv_dim + row)]);
  for (const int64_t row : b) rows.ba.rows.push_back(source_of_ba[static_cast<size_t>(row)]);
  for (const int64_t row : a) rows.ba.rows.push_back(source_of_ba[static_cast<size_t>(hv + row)]);
  return rows;
}

// This rank's heads: the whole mixer unless tensor parallelism splits its value heads (with the key
// heads they read, as grouped-query attention does).
std::optional<TensorParallel::GroupedHeads> gdn_share(const GdnConfig& config, const TensorParallel& tensor_parallel) {
  if (!tensor_parallel.active()) return std::nullopt;
  return tensor_parallel.grouped_heads(config.num_v_heads, config.num_k_heads);
}

}  // namespace

GatedDeltaNet::GatedDeltaNet(const GdnConfig& config, Weights& weights, const std::string& prefix) : config_(config) {
  const int64_t h = config.hidden_size, hk = config.num_k_heads, hv = config.num_v_heads, dk = config.head_k_dim,
                dv = config.head_v_dim;
  if (hk <= 0 || hv <= 0 || dk <= 0 || dv <= 0 || config.conv_kernel < 1 || hv % hk != 0) {
    raise(ErrorCode::kBadFormat,
          "{}: invalid Gated DeltaNet sizes (linear_num_key_heads {}, linear_num_value_heads {}, key dim {}, value dim "
          "{}, conv kernel {}); value heads must be a multiple of key heads",
          weights.source_name(), hk, hv, dk, dv, config.conv_kernel);
  }
  const std::optional<TensorParallel::GroupedHeads> share = gdn_share(config, weights.tensor_parallel());
  const GdnRows rows = gdn_rows(config, share ? &*share : nullptr);
  partial_ = share.has_value();
  if (share) {
    config_.num_v_heads = share->heads.size();
    config_.num_k_heads = share->groups.size();
  }
  // Stored (full) and local sizes.
  const int64_t full_conv = config.conv_dim(), full_value = config.value_dim();
  const int64_t local_hv = config_.num_v_heads, conv_dim = config_.conv_dim(), value_dim = config_.value_dim();
  const Device device = weights.device();
  // Owned projections take the dtype weights have on the device (the compute dtype on the GPU, as
  // stored on the CPU).
  const auto owned_dtype = [&](const std::string& key) {
    if (weights.is_random()) return weights.compute_dtype();
    return weights.device_dtype(weights.store().get(weights.prefix() + key).dtype());
  };
  if (config.layout == GdnProjectionLayout::kGroupedQkvz) {
    // The grouped rows are gathered into the kernels' order (FP8: dequantised, gathered and
    // block-quantised again, Weights::get_linear of a row slice).
    const std::string qkvz_key = prefix + "in_proj_qkvz.weight", ba_key = prefix + "in_proj_ba.weight";
    const Shape qkvz_full{full_conv + full_value, h}, ba_full{2 * hv, h};
    if (!weights.linear_is_fp8(qkvz_key) && !weights.linear_is_fp8(ba_key) &&
        owned_dtype(qkvz_key) == owned_dtype(ba_key)) {
      // Both plain: one weight [QKVZ; BA], one GEMM for every projection of the mixer.
      in_proj_ = OwnedTensor(owned_dtype(qkvz_key), {conv_dim + value_dim + 2 * local_hv, h}, device);
      weights.load_into(qkvz_key, qkvz_full, rows.qkvz, in_proj_->slice(0, 0, conv_dim + value_dim));
      weights.load_into(ba_key, ba_full, rows.ba,
                        in_proj_->slice(0, conv_dim + value_dim, conv_dim + value_dim + 2 * local_hv));
    } else {
      if (weights.linear_is_fp8(qkvz_key)) {
        qkvz_proj_ = weights.get_linear(qkvz_key, qkvz_full, rows.qkvz);
      } else {
        in_proj_qkvz_ = OwnedTensor(owned_dtype(qkvz_key), {conv_dim + value_dim, h}, device);
        weights.load_into(qkvz_key, qkvz_full, rows.qkvz, *in_proj_qkvz_);
        qkvz_proj_ = *in_proj_qkvz_;
      }
      if (weights.linear_is_fp8(ba_key)) {
        ba_proj_ = weights.get_linear(ba_key, ba_full, rows.ba);
      } else {
        in_proj_ba_ = OwnedTensor(owned_dtype(ba_key), {2 * local_hv, h}, device);
        weights.load_into(ba_key, ba_full, rows.ba, *in_proj_ba_);
        ba_proj_ = *in_proj_ba_;
      }
    }
  } else if (device.is_cuda() && !weights.fp8_linears()) {
    // One GEMM for every projection on the GPU: the checkpoint's rows placed side by side,
    // [QKV; Z; B; A].
    const int64_t qkvz_rows = conv_dim + value_dim;
    in_proj_ = OwnedTensor(weights.compute_dtype(), {qkvz_rows + 2 * local_hv, h}, device);
    weights.load_into(prefix + "in_proj_qkv.weight", {full_conv, h}, rows.qkv, in_proj_->slice(0, 0, conv_dim));
    weights.load_into(prefix + "in_proj_z.weight", {full_value, h}, rows.z, in_proj_->slice(0, conv_dim, qkvz_rows));
    weights.load_into(prefix + "in_proj_b.weight", {hv, h}, rows.ba_b,
                      in_proj_->slice(0, qkvz_rows, qkvz_rows + local_hv));
    weights.load_into(prefix + "in_proj_a.weight", {hv, h}, rows.ba_a,
                      in_proj_->slice(0, qkvz_rows + local_hv, qkvz_rows + 2 * local_hv));
  } else {
    in_proj_qkv_ = weights.get_linear(prefix + "in_proj_qkv.weight", {full_conv, h}, rows.qkv);
    in_proj_z_ = weights.get_linear(prefix + "in_proj_z.weight", {full_value, h}, rows.z);
    in_proj_b_ = weights.get_linear(prefix + "in_proj_b.weight", {hv, h}, rows.ba_b);
    in_proj_a_ = weights.get_linear(prefix + "in_proj_a.weight", {hv, h}, rows.ba_a);
  }
  if (!in_proj_->empty()) {
    const int64_t qkvz_rows = conv_dim + value_dim;
    qkvz_proj_ = in_proj_->slice(0, 0, qkvz_rows);
    ba_proj_ = in_proj_->slice(0, qkvz_rows, qkvz_rows + 2 * local_hv);
  }
  // conv1d.weight [conv_dim, 1, K] as the [conv_dim, K] the kernel takes.
  conv_weight_ = weights.get(prefix + "conv1d.weight", {full_conv, 1, config.conv_kernel}, rows.conv)
                     .reshape({conv_dim, config.conv_kernel});
  dt_bias_ = weights.get(prefix + "dt_bias", {hv}, rows.heads);
  a_log_ = weights.get(prefix + "A_log", {hv}, rows.heads);
  norm_weight_ = weights.get(prefix + "norm.weight", {dv});
  out_proj_ = weights.get_linear(prefix + "out_proj.weight", {h, full_value}, rows.out_columns);
}

CacheSpec GatedDeltaNet::cache_spec() const {
  return {{CacheTensorSpec::per_slot("conv", {config_.conv_kernel - 1, config_.conv_dim()}),
           CacheTensorSpec::per_slot("recurrent", {config_.num_v_heads, config_.head_k_dim, config_.head_v_dim},
                                     DType::kF32)}};
}

size_t GatedDeltaNet::scratch_bytes(const ForwardBatch& batch, Device device) const {
  if (batch.all_decode() || batch.verify) return 0;  // the recurrent kernel needs no scratch
  return kernels::gated_delta_rule_workspace_bytes(device, batch.num_tokens, batch.num_seqs, config_.num_v_heads,
                                                   config_.head_k_dim, config_.head_v_dim);
}

size_t GatedDeltaNet::verify_scratch_bytes(int64_t num_tokens, int64_t /*num_seqs*/, DType activation) const {
  const auto rows = static_cast<size_t>(num_tokens);
  const auto projected = static_cast<size_t>(config_.conv_dim() + config_.value_dim());
  const auto heads = static_cast<size_t>(config_.num_v_heads);
  return verify_scratch_aligned(rows * projected * dtype_size(activation)) +
         2 * verify_scratch_aligned(rows * heads * sizeof(float));
}

GatedDeltaNet::KeptInputs GatedDeltaNet::kept_inputs(const StepContext& step) const {
  const int64_t tokens = step.batch.num_tokens, hv = config_.num_v_heads;
  const size_t needed = verify_scratch_bytes(tokens, step.batch.num_seqs, step.activation_dtype);
  METRALE_CHECK(step.verify_scratch.nbytes() >= needed, "GDN layer: verify scratch {} for {} bytes",
                step.verify_scratch.describe(), needed);
  auto* base = static_cast<char*>(step.verify_scratch.data());
  const Device device = step.verify_scratch.device();
  KeptInputs kept;
  kept.projected = Tensor(base, step.activation_dtype, {tokens, config_.conv_dim() + config_.value_dim()}, device);
  base += verify_scratch_aligned(kept.projected.nbytes());
  kept.g = Tensor(base, DType::kF32, {tokens, hv}, device);
  base += verify_scratch_aligned(kept.g.nbytes());
  kept.beta = Tensor(base, DType::kF32, {tokens, hv}, device);
  return kept;
}

void GatedDeltaNet::delta_rule(const StepContext& step, const Tensor& conv_out, const Tensor& g, const Tensor& beta,
                               const Tensor& state, const Tensor& cu_q, const Tensor& kv_lens, const Tensor& slots,
                               int64_t max_q_len, bool recurrent, bool write_state, const Tensor& core) const {
  const int64_t tokens = conv_out.size(0), hk = config_.num_k_heads, hv = config_.num_v_heads;
  const int64_t dk = config_.head_k_dim, dv = config_.head_v_dim, key_dim = config_.key_dim();
  const DType act = step.activation_dtype;
  const int64_t row = conv_out.stride(0);
  auto* base = static_cast<char*>(conv_out.data());
  const auto element = static_cast<int64_t>(conv_out.element_size());
  const Tensor q(base, act, {tokens, hk, dk}, {row, dk, 1}, conv_out.device());
  const Tensor k(base + key_dim * element, act, {tokens, hk, dk}, {row, dk, 1}, conv_out.device());
  const Tensor v(base + 2 * key_dim * element, act, {tokens, hv, dv}, {row, dv, 1}, conv_out.device());
  kernels::GatedDeltaRuleParams params;
  params.scale = 1.0f / std::sqrt(static_cast<float>(dk));
  params.qk_l2norm = true;
  params.max_q_len = max_q_len;
  params.write_state = write_state;
  if (recurrent) {
    kernels::gated_delta_rule_recurrent(q, k, v, g, beta, state, cu_q, kv_lens, slots, core, params);
  } else {
    if (!step.layer_scratch.empty()) params.workspace = step.layer_scratch;
    kernels::gated_delta_rule_chunked(q, k, v, g, beta, state, cu_q, kv_lens, slots, core, params);
  }
}

void GatedDeltaNet::forward(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& out) {
  const ForwardBatch& batch = step.batch;
  const int64_t tokens = batch.num_tokens, seqs = batch.num_seqs;
  METRALE_CHECK(cache.tensors.size() == 2, "GDN layer: {} cache tensors, expected the conv and recurrent states",
                cache.tensors.size());
  METRALE_CHECK(batch.state_slots.numel() == seqs, "GDN layer: state_slots {} for {} sequences",
                batch.state_slots.describe(), seqs);
  if (tokens == 0) return;
  Arena& ws = step.workspace;
  const DType act = step.activation_dtype;
  const int64_t hv = config_.num_v_heads, dv = config_.head_v_dim;
  const int64_t value_dim = config_.value_dim(), conv_dim = config_.conv_dim();
  // A verify step keeps the projections and gates for the commit.
  const KeptInputs kept = batch.verify ? kept_inputs(step) : KeptInputs{};

  // [T, conv_dim + value_dim]: the conv input [Q | K | V], then z; [T, 2 Hv]: b, then a. With one
  // weight for all of them (and outside a verify, which keeps the first part apart), column slices
  // of one GEMM's output.
  const bool one_gemm = !in_proj_->empty() && !batch.verify;
  const Tensor all = one_gemm ? ws.alloc(act, {tokens, conv_dim + value_dim + 2 * hv}) : Tensor();
  const Tensor projected = one_gemm       ? all.slice(1, 0, conv_dim + value_dim)
                           : batch.verify ? kept.projected
                                          : ws.alloc(act, {tokens, conv_dim + value_dim});
  const Tensor ba =
      one_gemm ? all.slice(1, conv_dim + value_dim, conv_dim + value_dim + 2 * hv) : ws.alloc(act, {tokens, 2 * hv});
  if (one_gemm) {
    kernels::linear(x, *in_proj_, all);
  } else if (!qkvz_proj_.empty()) {
    kernels::linear(x, qkvz_proj_, projected);
    kernels::linear(x, ba_proj_, ba);
  } else {
    kernels::linear(x, in_proj_qkv_, projected.slice(1, 0, conv_dim));
    kernels::linear(x, in_proj_z_, projected.slice(1, conv_dim, conv_dim + value_dim));
    kernels::linear(x, in_proj_b_, ba.slice(1, 0, hv));
    kernels::linear(x, in_proj_a_, ba.slice(1, hv, 2 * hv));
  }

  // Verify: the kernels read the slots and leave them as they were (the commit advances them).
  const Tensor conv_out = ws.alloc(act, {tokens, conv_dim});  // [T, conv_dim] silu(conv(qkv))
  kernels::causal_conv1d(projected.slice(1, 0, conv_dim), conv_weight_, cache.tensors[kConv], batch.cu_q, batch.kv_lens,
                         batch.state_slots, conv_out, {true, batch.max_q_len, /*write_state=*/!batch.verify});
  // [T, Hv] f32 log decay (<= 0) and write strength.
  const Tensor g = batch.verify ? kept.g : ws.alloc(DType::kF32, {tokens, hv});
  const Tensor beta = batch.verify ? kept.beta : ws.alloc(DType::kF32, {tokens, hv});
  kernels::gdn_gates(ba.slice(1, hv, 2 * hv), ba.slice(1, 0, hv), a_log_, dt_bias_, g, beta);

  // Decode and verify take the token-by-token form (a verify row computes exactly what decoding it
  // would); prefill the chunked one.
  const Tensor core = ws.alloc(act, {tokens, hv, dv});  // [T, Hv, dv] delta-rule output
  delta_rule(step, conv_out, g, beta, cache.tensors[kRecurrent], batch.cu_q, batch.kv_lens, batch.state_slots,
             batch.max_q_len, batch.all_decode() || batch.verify, /*write_state=*/!batch.verify, core);

  const Tensor z(projected.slice(1, conv_dim, conv_dim + value_dim).data(), act, {tokens, hv, dv},
                 {projected.stride(0), dv, 1}, projected.device());
  kernels::gated_rms_norm(core, z, norm_weight_, core, static_cast<float>(config_.rms_norm_eps), config_.output_gate);
  kernels::linear(core.reshape({tokens, value_dim}), out_proj_, out);
}

void GatedDeltaNet::commit(const StepContext& step, const BlockCache& cache, const VerifyCommit& kept_rows) {
  const ForwardBatch& batch = step.batch;
  const int64_t tokens = batch.num_tokens;
  if (tokens == 0) return;
  Arena& ws = step.workspace;
  const DType act = step.activation_dtype;
  const int64_t hv = config_.num_v_heads, dv = config_.head_v_dim, conv_dim = config_.conv_dim();
  const KeptInputs kept = kept_inputs(step);
  // Replays the verify rows in place, split into kept parts (on the real slots) and rejected parts
  // (slot -1, nothing kept): the conv window and the delta rule advance exactly as the verify
  // forward computed them (same kernels, same inputs, same order) over the kept rows only.
  const Tensor conv_out = ws.alloc(act, {tokens, conv_dim});
  kernels::causal_conv1d(kept.projected.slice(1, 0, conv_dim), conv_weight_, cache.tensors[kConv], kept_rows.cu_parts,
                         kept_rows.kv_lens, kept_rows.slots, conv_out, {true, kept_rows.max_rows});
  const Tensor core = ws.alloc(act, {tokens, hv, dv});  // the outputs again; only the state matters here
  delta_rule(step, conv_out, kept.g, kept.beta, cache.tensors[kRecurrent], kept_rows.cu_parts, kept_rows.kv_lens,
             kept_rows.slots, kept_rows.max_rows, true, /*write_state=*/true, core);
}

}  // namespace metrale
