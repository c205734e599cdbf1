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

class Model {
 public:
  virtual ~Model() = default;

  virtual const ModelConfig& config() const = 0;
  virtual Device device() const = 0;
  // One spec per decoder layer, in layer order.
  virtual std::vector<LayerCacheSpec> cache_specs() const = 0;
  // Runs one step: writes this step's keys/values (and states) into `caches` and the logits of the
  // batch's logit rows into `logits` [R, vocab] f32, and, when batch.hidden_out is given, the final
  // hidden state of every row. `caches` holds at least one entry per cache_specs() entry (extra
  // entries, such as the MTP layers', are ignored). `workspace` holds the step's temporaries.
  virtual void forward(const ForwardBatch& batch, std::span<const LayerCache> caches, const Tensor& logits,
                       Arena& workspace) = 0;

  // --- Speculative decoding: verify and commit -------------------------------------------------
  // Bytes of ForwardBatch::verify_scratch a verify step of `num_tokens` rows over `num_seqs`
  // sequences needs (0: the model's caches need no commit, e.g. attention only).
  virtual size_t verify_scratch_bytes(int64_t /*num_tokens*/, int64_t /*num_seqs*/) const { return 0; }
  // After a forward with batch.verify set (the same `batch`, its verify_scratch untouched since):
  // sequence s keeps its first kept_rows[s] rows (1 <= kept_rows[s] <= q_len_s: the row it was
  // verified from plus its accepted drafts). Leaves in every recurrent layer's slot exactly the state
  // of plainly running those rows; the engine truncates the sequence to kv_lens[s] - q_len_s +
  // kept_rows[s] tokens for the attention layers. Must run before any other step uses the slots.
  // The default suits models without recurrent state.
  virtual void commit_verified(const ForwardBatch& /*batch*/, std::span<const int32_t> /*kept_rows*/,
                               std::span<const LayerCache> /*caches*/, Arena& /*workspace*/) {}
  // The same commit with the kept rows already laid out on the device (no host work, no copies:
  // CUDA graphs capture it with `kept` in fixed buffers).
  virtual void commit_kept_rows(const ForwardBatch& /*batch*/, const VerifyCommit& /*kept*/,
                                std::span<const LayerCache> /*caches*/, Arena& /*workspace*/) {}

  // --- Speculative decoding: the MTP draft head ------------------------------------------------
  virtual bool has_mtp() const { return false; }
  virtual int64_t num_mtp_layers() const { return 0; }
  // Cache specs of the MTP layers (paged KV with the trunk's block numbering). An engine drafting
  // with MTP appends them after cache_specs(): MTP layer i reads caches[cache_specs().size() + i].
  virtual std::vector<LayerCacheSpec> mtp_cache_specs() const { return {}; }
  // One MTP step over a ragged batch. Row r sits at trunk position t = positions[r] and drafts the
  // token at t + 2: token_ids[r] = x_{t+1} (the token after t), hidden[r] [T, H] activation dtype =
  // h_t (the trunk's ForwardBatch::hidden_out row of position t, or for a chained draft the previous
  // MTP step's o_t). kv_lens, block tables and slot_mapping are the trunk's for those positions: the
  // MTP layer writes its K/V of position t where the trunk writes its own. Writes the draft logits of
  // the logit rows to `logits` [R, vocab] f32 and, when batch.hidden_out is given, o_t of every row.
  // `mtp_layer` picks the layer (chained draft j uses j % num_mtp_layers()).
  virtual void mtp_forward(const ForwardBatch& /*batch*/, std::span<const LayerCache> /*caches*/,
                           const Tensor& /*hidden*/, const Tensor& /*logits*/, Arena& /*workspace*/,
                           int64_t /*mtp_layer*/) {
    raise(ErrorCode::kUnsupported, "model '{}' has no MTP head", config().model_type);
  }
  // Only the MTP keys mtp_forward would write for the batch's rows (token_ids, positions and
  // slot_mapping are read; hidden [T, H] as there): the catch-up of positions whose draft nobody
  // needs, at the cost of the head's input and its K/V projection.
  virtual void mtp_write_keys(const ForwardBatch& /*batch*/, std::span<const LayerCache> /*caches*/,
                              const Tensor& /*hidden*/, Arena& /*workspace*/, int64_t /*mtp_layer*/) {
    raise(ErrorCode::kUnsupported, "model '{}' has no MTP head", config().model_type);
  }
};

}  // namespace metrale
