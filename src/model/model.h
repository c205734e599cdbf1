// Model: a loaded architecture ready to run ragged batches.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "core/error.h"
#include "model/cache_spec.h"
#include "model/config.h"
#include "model/forward_batch.h"
#include "runtime/arena.h"

namespace metrale {

// What the engine may do with a model, from its blocks' declarations (the engine reads these
// instead of probing).
struct ModelCapabilities {
  bool graph_safe = true;        // every step (forward, commit, MTP) may be captured and replayed
  bool needs_prestage = false;   // some block reads per-row step inputs prepared on the host
  bool supports_verify = true;   // every stateful block can run a verify step and commit it
};

// The caches of one step, by owner: blocks[i] is cache_specs()[i] (the model's i-th stateful block,
// in forward order); mtp[i] is mtp_cache_specs()[i] (empty unless the engine drafts with MTP).
struct ModelCaches {
  std::span<const BlockCache> blocks;
  std::span<const BlockCache> mtp;
};

// The caches of one CacheManager built from cache_specs() followed (when drafting with MTP) by
// mtp_cache_specs(): the first `num_block_caches` are the blocks', the rest the MTP layers'.
inline ModelCaches split_model_caches(std::span<const BlockCache> caches, size_t num_block_caches) {
  METRALE_CHECK(caches.size() >= num_block_caches, "{} caches for {} stateful blocks", caches.size(), num_block_caches);
  return {caches.first(num_block_caches), caches.subspan(num_block_caches)};
}

class Model {
 public:
  virtual ~Model() = default;

  virtual const ModelConfig& config() const = 0;
  virtual Device device() const = 0;
  // The dtype of the activations between blocks (hidden states, the MTP head's input) and of the cache
  // tensors whose spec names none: f32 on the CPU; bf16 on the GPU unless the model was loaded with
  // f32 activations (LoadOptions::compute_dtype).
  virtual DType activation_dtype() const { return device().is_cpu() ? DType::kF32 : DType::kBF16; }
  virtual ModelCapabilities capabilities() const { return {}; }
  // One spec per stateful block, in forward order (ModelCaches::blocks).
  virtual std::vector<CacheSpec> cache_specs() const = 0;

  // --- Step inputs prepared on the host ------------------------------------------------------
  virtual std::vector<StepInputSpec> step_input_specs() const { return {}; }
  // Fills host_inputs[i] ([T, per_row] of step_input_specs()[i], host memory) for the step, after the
  // batch's host arrays are built and before they are uploaded (ForwardBatch::step_inputs).
  virtual void prestage(const PrestageRows& /*rows*/, std::span<const Tensor> /*host_inputs*/) const {}

  // Runs one step: writes this step's cache entries into `caches.blocks` and the logits of the
  // batch's logit rows into `logits` [R, vocab] f32, and, when batch.hidden_out is given, the final
  // hidden state of every row. `workspace` holds the step's temporaries.
  virtual void forward(const ForwardBatch& batch, const ModelCaches& caches, const Tensor& logits,
                       Arena& workspace) = 0;

  // --- Step cost ---------------------------------------------------------------------------------
  // Expected bytes of weights a step of `rows` rows reads only because some row selected them (the
  // sum of FeedForward::routed_weight_bytes over the layers): 0 for a model whose steps read all its
  // weights whatever the rows. The speculation controller's cost feature: verify rows that select
  // more weights cost more than their compute.
  virtual double routed_weight_bytes(int64_t /*rows*/) const { return 0.0; }

  // --- Speculative decoding: verify and commit -------------------------------------------------
  // Bytes of ForwardBatch::verify_scratch a verify step of `num_tokens` rows over `num_seqs`
  // sequences needs (0: the model's caches need no commit, e.g. attention only).
  virtual size_t verify_scratch_bytes(int64_t /*num_tokens*/, int64_t /*num_seqs*/) const { return 0; }
  // After a forward with batch.verify set (the same `batch`, its verify_scratch untouched since):
  // sequence s keeps its first kept_rows[s] rows (1 <= kept_rows[s] <= q_len_s: the row it was
  // verified from plus its accepted drafts). Leaves in every per-slot cache tensor exactly the state
  // of plainly running those rows; the engine truncates the sequence to kv_lens[s] - q_len_s +
  // kept_rows[s] tokens for the paged ones. Must run before any other step uses the slots.
  // The default suits models without per-slot state.
  virtual void commit_verified(const ForwardBatch& /*batch*/, std::span<const int32_t> /*kept_rows*/,
                               const ModelCaches& /*caches*/, Arena& /*workspace*/) {}
  // The same commit with the kept rows already laid out on the device (no host work, no copies:
  // CUDA graphs capture it with `kept` in fixed buffers).
  virtual void commit_kept_rows(const ForwardBatch& /*batch*/, const VerifyCommit& /*kept*/,
                                const ModelCaches& /*caches*/, Arena& /*workspace*/) {}

  // --- Speculative decoding: the MTP draft head ------------------------------------------------
  virtual bool has_mtp() const { return false; }
  virtual int64_t num_mtp_layers() const { return 0; }
  // Cache specs of the MTP layers, one per layer (ModelCaches::mtp; paged tensors share the trunk's
  // block numbering).
  virtual std::vector<CacheSpec> mtp_cache_specs() const { return {}; }
  // One MTP step over a ragged batch. Row r sits at trunk position t = positions[r] and drafts the
  // token at t + 2: token_ids[r] = x_{t+1} (the token after t), hidden[r] [T, H] activation dtype =
  // h_t (the trunk's ForwardBatch::hidden_out row of position t, or for a chained draft the previous
  // MTP step's o_t). kv_lens, block tables and slot_mapping are the trunk's for those positions: the
  // MTP layer writes its K/V of position t where the trunk writes its own. Writes the draft logits of
  // the logit rows to `logits` [R, vocab] f32 and, when batch.hidden_out is given, o_t of every row.
  // `mtp_layer` picks the layer (chained draft j uses j % num_mtp_layers()), which reads caches.mtp.
  virtual void mtp_forward(const ForwardBatch& /*batch*/, const ModelCaches& /*caches*/, const Tensor& /*hidden*/,
                           const Tensor& /*logits*/, Arena& /*workspace*/, int64_t /*mtp_layer*/) {
    raise(ErrorCode::kUnsupported, "model '{}' has no MTP head", config().model_type);
  }
  // Only the MTP keys mtp_forward would write for the batch's rows (token_ids, positions and
  // slot_mapping are read; hidden [T, H] as there): the catch-up of positions whose draft nobody
  // needs, at the cost of the head's input and its K/V projection.
  virtual void mtp_write_keys(const ForwardBatch& /*batch*/, const ModelCaches& /*caches*/, const Tensor& /*hidden*/,
                              Arena& /*workspace*/, int64_t /*mtp_layer*/) {
    raise(ErrorCode::kUnsupported, "model '{}' has no MTP head", config().model_type);
  }
};

}  // namespace metrale
