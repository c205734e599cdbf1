#include "model/blocks/decoder.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/embedding.h"
#include "kernels/linear.h"
#include "kernels/moe.h"
#include "runtime/buffer.h"
#include "runtime/communicator.h"

namespace metrale {

TokenEmbedding load_embedding(Weights& weights, const ModelConfig& config) {
  return load_token_embedding(weights, config);
}

Tensor load_lm_head(Weights& weights, const ModelConfig& config, const TokenEmbedding& embedding) {
  const Shape full{config.vocab_size, config.hidden_size};
  // Tensor parallelism: this rank's share of the hidden columns (DecoderModel sums the partial logits).
  const std::optional<IndexRange> columns = weights.tensor_parallel().split_share(config.hidden_size);
  const TensorSlice slice = columns ? TensorSlice::of_columns(columns->begin, columns->end) : TensorSlice{};
  if (weights.has_root("lm_head.weight")) return weights.get_root("lm_head.weight", full, slice);
  if (!config.tie_word_embeddings) {
    raise(ErrorCode::kNotFound, "{}: checkpoint has no 'lm_head.weight' and tie_word_embeddings is false",
          weights.source_name());
  }
  // Tied: the embedding's table when whole, else the head's own share read again.
  return columns || !embedding.whole() ? weights.get("embed_tokens.weight", full, slice) : embedding.table;
}

DecoderModel::DecoderModel(ModelConfig config, Weights& weights, DecoderParts parts)
    : config_(std::move(config)),
      device_(weights.device()),
      activation_dtype_(weights.compute_dtype()),
      store_(weights.store_ptr()),
      device_weights_(weights.take_device_buffers()),
      embed_tokens_(parts.embed_tokens),
      lm_head_(parts.lm_head),
      trunk_(std::move(parts.layers), std::move(parts.residual), "layer"),
      mtp_(std::move(parts.mtp)),
      communicator_(weights.tensor_parallel().communicator),
      lm_head_columns_{0, config_.hidden_size} {
  if (lm_head_.size(1) != config_.hidden_size) {
    const std::optional<IndexRange> columns = weights.tensor_parallel().even_share(config_.hidden_size);
    METRALE_CHECK(columns && columns->size() == lm_head_.size(1) && communicator_ != nullptr,
                  "an LM head of {} columns for hidden size {}", lm_head_.size(1), config_.hidden_size);
    lm_head_columns_ = *columns;
  }
  METRALE_CHECK(trunk_.num_layers() > 0, "{}: a decoder without layers", config_.source.string());
  METRALE_CHECK(trunk_.residual().hidden_size() == config_.hidden_size,
                "residual scheme of width {} for hidden size {}", trunk_.residual().hidden_size(), config_.hidden_size);
}

ModelCapabilities DecoderModel::capabilities() const {
  const BlockCapabilities trunk = trunk_.capabilities();
  const BlockCapabilities head = mtp_ ? mtp_->capabilities() : BlockCapabilities{};
  return {trunk.graph_safe && head.graph_safe, trunk.needs_prestage || head.needs_prestage,
          trunk.supports_verify && head.supports_verify};
}

void DecoderModel::prestage(const PrestageRows& rows, std::span<const Tensor> host_inputs) const {
  trunk_.prestage(rows, host_inputs);
}

std::vector<CacheSpec> DecoderModel::mtp_cache_specs() const {
  return mtp_ ? mtp_->cache_specs() : std::vector<CacheSpec>{};
}

namespace {

// A host i32 array as a tensor on `device`: a view on the CPU, a workspace copy on the GPU.
Tensor device_i32(std::span<const int32_t> values, Arena& workspace, Device device) {
  const auto count = static_cast<int64_t>(values.size());
  if (device.is_cpu()) return Tensor(const_cast<int32_t*>(values.data()), DType::kI32, {count});
  const Tensor copy = workspace.alloc(DType::kI32, {count});
  if (count > 0) copy_bytes(copy.data(), device, values.data(), Device::cpu(), values.size_bytes());
  return copy;
}

}  // namespace

size_t DecoderModel::verify_scratch_bytes(int64_t num_tokens, int64_t num_seqs) const {
  return trunk_.verify_scratch_offsets(num_tokens, num_seqs, activation_dtype()).back();
}

void DecoderModel::compute_logits(const ForwardBatch& batch, const Tensor& final_hidden, const Tensor& logits,
                                  Arena& workspace) const {
  // Only the requested rows reach the LM head.
  const int64_t rows = batch.logit_rows.numel();
  METRALE_CHECK(logits.size(0) == rows && logits.size(1) == config_.vocab_size, "logits {} for {} rows",
                logits.describe(), rows);
  const Tensor selected = workspace.alloc(final_hidden.dtype(), {rows, config_.hidden_size});
  kernels::gather_rows(final_hidden, batch.logit_rows, selected);
  if (lm_head_columns_.size() == config_.hidden_size) {
    kernels::linear(selected, lm_head_, logits);
    return;
  }
  // A tensor-parallel share of the hidden columns: the logits are the sum of the ranks' partials.
  kernels::linear(selected.slice(1, lm_head_columns_.begin, lm_head_columns_.end), lm_head_, logits);
  communicator_->all_reduce_sum(logits);
}

void DecoderModel::forward(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& logits,
                           Arena& workspace) {
  const int64_t tokens = batch.num_tokens, hidden = config_.hidden_size;
  const DType act = activation_dtype();
  StepContext step{batch, workspace, act, Tensor(), Tensor()};
  step.communicator = communicator_;
  const size_t scratch = trunk_.scratch_bytes(batch, device_, 0, trunk_.num_layers());
  if (scratch > 0) step.layer_scratch = workspace.alloc(DType::kU8, {static_cast<int64_t>(scratch)});
  std::vector<size_t> verify_offsets;
  if (batch.verify) {
    verify_offsets = trunk_.verify_scratch_offsets(tokens, batch.num_seqs, act);
    METRALE_CHECK(batch.verify_scratch.nbytes() >= verify_offsets.back() && batch.verify_scratch.ndim() == 1,
                  "verify step: verify_scratch {} for {} bytes", batch.verify_scratch.describe(),
                  verify_offsets.back());
  }
  if (!batch.hidden_out.empty()) {
    METRALE_CHECK(batch.hidden_out.ndim() == 2 && batch.hidden_out.size(0) == tokens &&
                      batch.hidden_out.size(1) == hidden && batch.hidden_out.dtype() == act,
                  "hidden_out {} for {} rows of {} ({})", batch.hidden_out.describe(), tokens, hidden, dtype_name(act));
  }
  const ResidualScheme& scheme = trunk_.residual();
  const ResidualStreams streams = scheme.allocate(step);           // the residual streams [T, W]
  const Tensor normed = workspace.alloc(act, {tokens, hidden});    // [T, H] site input
  const Tensor sublayer = workspace.alloc(act, {tokens, hidden});  // [T, H] site output
  // [T, H] the final hidden state: the caller's hidden_out when asked for.
  const Tensor final_hidden = batch.hidden_out.empty() ? normed : batch.hidden_out;
  embed_tokens_.lookup(step, batch.token_ids, streams.input);
  scheme.begin(step, streams);
  trunk_.forward(step, caches.blocks, streams, 0, trunk_.num_layers(), normed, sublayer, final_hidden, verify_offsets);
  compute_logits(batch, final_hidden, logits, workspace);
}

void DecoderModel::commit_verified(const ForwardBatch& batch, std::span<const int32_t> kept_rows,
                                   const ModelCaches& caches, Arena& workspace) {
  METRALE_CHECK(batch.verify, "commit_verified needs the batch of a verify step");
  const int64_t seqs = batch.num_seqs;
  if (static_cast<int64_t>(kept_rows.size()) != seqs) {
    raise(ErrorCode::kInvalidArgument, "commit_verified: {} kept-row counts for {} sequences", kept_rows.size(), seqs);
  }
  if (!trunk_.needs_commit()) return;  // no per-slot state: the verify forward left every cache right
  const auto parts = static_cast<size_t>(2 * seqs);
  std::vector<int32_t> cu_parts(parts + 1), kv_lens(parts), slots(parts);
  VerifyCommit kept;
  kept.max_rows = fill_commit_parts(batch.host_cu_q, batch.host_kv_lens, batch.host_state_slots, kept_rows,
                                    cu_parts.data(), kv_lens.data(), slots.data());
  kept.cu_parts = device_i32(cu_parts, workspace, device_);
  kept.kv_lens = device_i32(kv_lens, workspace, device_);
  kept.slots = device_i32(slots, workspace, device_);
  commit_kept_rows(batch, kept, caches, workspace);
}

void DecoderModel::commit_kept_rows(const ForwardBatch& batch, const VerifyCommit& kept, const ModelCaches& caches,
                                    Arena& workspace) {
  METRALE_CHECK(batch.verify, "commit_kept_rows needs the batch of a verify step");
  METRALE_CHECK(kept.cu_parts.numel() == 2 * batch.num_seqs + 1 && kept.kv_lens.numel() == 2 * batch.num_seqs &&
                    kept.slots.numel() == 2 * batch.num_seqs,
                "commit: cu_parts {}, kv_lens {}, slots {} for {} sequences", kept.cu_parts.describe(),
                kept.kv_lens.describe(), kept.slots.describe(), batch.num_seqs);
  if (!trunk_.needs_commit()) return;
  const DType act = activation_dtype();
  const std::vector<size_t> offsets = trunk_.verify_scratch_offsets(batch.num_tokens, batch.num_seqs, act);
  METRALE_CHECK(batch.verify_scratch.nbytes() >= offsets.back(), "verify_scratch {} for {} bytes",
                batch.verify_scratch.describe(), offsets.back());
  StepContext step{batch, workspace, act, Tensor(), Tensor()};
  step.communicator = communicator_;
  trunk_.commit(step, caches.blocks, kept, offsets);
}

MtpHead& DecoderModel::mtp_head(int64_t mtp_layer) const {
  if (!mtp_) raise(ErrorCode::kUnsupported, "{}: the checkpoint has no MTP head", config_.source.string());
  if (mtp_layer < 0 || mtp_layer >= mtp_->num_layers()) {
    raise(ErrorCode::kInvalidArgument, "MTP layer {} of {}", mtp_layer, mtp_->num_layers());
  }
  return *mtp_;
}

void DecoderModel::mtp_write_keys(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& hidden,
                                  Arena& workspace, int64_t mtp_layer) {
  MtpHead& head = mtp_head(mtp_layer);
  StepContext step{batch, workspace, activation_dtype(), Tensor(), Tensor()};
  step.communicator = communicator_;
  head.write_keys(step, caches.mtp, mtp_layer, embed_tokens_, hidden);
}

void DecoderModel::mtp_forward(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& hidden,
                               const Tensor& logits, Arena& workspace, int64_t mtp_layer) {
  MtpHead& head = mtp_head(mtp_layer);
  const DType act = activation_dtype();
  StepContext step{batch, workspace, act, Tensor(), Tensor()};
  step.communicator = communicator_;
  const size_t scratch = head.scratch_bytes(mtp_layer, batch, device_);
  if (scratch > 0) step.layer_scratch = workspace.alloc(DType::kU8, {static_cast<int64_t>(scratch)});
  const Tensor out = batch.hidden_out.empty() ? workspace.alloc(act, {batch.num_tokens, config_.hidden_size})
                                              : batch.hidden_out;  // [T, H] o_t
  head.forward(step, caches.mtp, mtp_layer, embed_tokens_, hidden, out);
  compute_logits(batch, out, logits, workspace);
}

}  // namespace metrale
