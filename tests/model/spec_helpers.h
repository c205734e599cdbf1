// A test driver for the model side of speculative decoding: the caches of a model's stateful blocks
// plus, optionally, its MTP layers' (ModelCaches::mtp), and hand-built ragged batches for
// Model::forward (plain or verify), Model::commit_verified and Model::mtp_forward, over a TestCache
// (tests/common/step_runner.h). Models with step inputs get Model::prestage with each sequence's kept
// tokens as its history (a commit drops the rejected ones).
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "model/model.h"
#include "model/model_helpers.h"
#include "runtime/arena.h"

namespace metrale::testing {

class SpecRunner {
 public:
  SpecRunner(Model& model, bool with_mtp, int32_t block_size = 4, int32_t num_blocks = 128, int32_t num_state_slots = 8,
             uint64_t seed = 11);

  using Chunk = SeqChunk;
  struct Rows {
    std::vector<std::vector<float>> logits;  // [T][V], every row
    std::vector<std::vector<float>> hidden;  // [T][H], every row (hidden_out)
  };

  // A trunk step: each chunk's tokens at the sequence's next positions. With `verify` the step is a
  // verify step; commit() must follow before the next trunk step.
  Rows step(const std::vector<Chunk>& chunks, bool verify = false);
  // After a verify step: sequence s (in that step's order) keeps kept_rows[s] rows.
  void commit(const std::vector<int32_t>& kept_rows);
  // An MTP step: chunk tokens x_{t+1} for the sequence's next MTP positions t (from mtp_cached),
  // `hidden` [T][H] the matching h_t rows.
  Rows mtp_step(const std::vector<Chunk>& chunks, const std::vector<std::vector<float>>& hidden, int64_t mtp_layer = 0);
  // The same rows through Model::mtp_write_keys: the MTP keys only, no output.
  void mtp_write_keys(const std::vector<Chunk>& chunks, const std::vector<std::vector<float>>& hidden,
                      int64_t mtp_layer = 0);

  int64_t cached(int64_t seq_id) { return cached_[seq_id]; }
  int64_t mtp_cached(int64_t seq_id) { return mtp_cached_[seq_id]; }
  // Sets how many tokens the MTP layer holds for the sequence (e.g. to redo drafted positions).
  void set_mtp_cached(int64_t seq_id, int64_t length) { mtp_cached_[seq_id] = length; }
  // A copy of the f32 per-slot tensor `which` of stateful block `block` in the sequence's slot.
  std::vector<float> state(int64_t seq_id, size_t block, size_t which);

 private:
  Model& model_;
  TestCache cache_;  // the trunk's blocks, then the MTP layers
  std::map<int64_t, int64_t> cached_, mtp_cached_;
  std::map<int64_t, std::vector<int32_t>> history_;  // each sequence's kept tokens (the history prestage sees)
  HostBatch pending_verify_;
  OwnedTensor verify_scratch_;
  Arena arena_;
};

}  // namespace metrale::testing
