// Runner: turns a schedule into the model's ForwardBatch, runs the forward and hands back the
// logits of the requested rows.
//
// Step inputs live in persistent buffers sized for the engine's limits: host arrays (pinned when a
// GPU is used) are filled once per step and uploaded once into device buffers at fixed addresses,
// so that CUDA graphs captured for decode batch sizes can be replayed with new inputs. Decode steps
// whose batch fits a captured size are padded to it (padding rows write no KV and their logits are
// ignored); other steps run eagerly.
//
// Models with recurrent layers also get each sequence's state slot (ForwardBatch::state_slots),
// uploaded like the other arrays, so graph replays read the slots of the step they replay. Padding
// rows use the cache's padding slot, which no sequence reads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/scheduler.h"
#include "model/model.h"

namespace metrale {

struct RunnerLimits {
  int64_t max_num_tokens = 2048;  // tokens per step
  int64_t max_num_seqs = 64;      // sequences per step
  int64_t max_model_len = 4096;   // longest sequence
  int64_t block_size = 16;
  int64_t max_logit_rows = 0;     // logits rows of one step at most (0: max_num_seqs); GPU buffer size
};

// Which logits row belongs to what.
struct LogitRowUse {
  ScheduledChunk chunk;
  int64_t first_row = 0;        // index in the step's logits of the chunk's first requested row
  int64_t first_position = 0;   // token position that row belongs to
  int64_t num_rows = 0;         // consecutive requested rows (positions first_position, +1, ...)
  int64_t first_batch_row = 0;  // row of the step's batch holding the chunk's first token
};

// One sequence's rows of an MTP draft step (Model::mtp_forward): rows at trunk positions
// first_position + i, each with the token after it and a hidden state taken from consecutive rows
// of the step's hidden source, starting at first_hidden_row.
struct MtpRows {
  int64_t seq_id = 0;
  int64_t first_position = 0;
  std::vector<int32_t> next_tokens;  // x_{t+1} of each row
  int64_t first_hidden_row = 0;
  bool wants_logits = false;         // the draft logits of the last row are needed
};

struct StepResult {
  Tensor logits;                    // [R, vocab] f32 on the model's device
  std::vector<LogitRowUse> uses;    // one per scheduled chunk
  bool used_graph = false;
};

class Runner {
 public:
  Runner(Model& model, const RunnerLimits& limits);
  ~Runner();

  void set_cache(CacheManager* cache) { cache_ = cache; }
  const RunnerLimits& limits() const { return limits_; }
  // The memory planner may lower the sequence limit after the workspace was sized for a larger one.
  void lower_max_num_seqs(int64_t max_num_seqs);

  // GPU only: runs the largest step the limits allow (with a scratch cache) and sizes the
  // workspace arena to its high-water mark; afterwards the arena never grows.
  size_t plan_workspace();
  // GPU only: captures one decode graph per batch size (those above max_num_seqs are skipped).
  void capture_decode_graphs(const std::vector<int64_t>& batch_sizes);
  std::vector<int64_t> graph_batch_sizes() const;

  // Runs one step. Every chunk's blocks must already be reserved. A plan with draft rows runs as a
  // verify step (ForwardBatch::verify, eagerly); commit_verified must follow before the next step.
  StepResult execute(const SchedulePlan& plan);

  // ---- Speculative decoding
  // Ask every step for the final hidden state of each row (the MTP drafter's h_t); steps then run
  // eagerly (decode graphs are captured without that output).
  void set_keep_hidden(bool keep) { keep_hidden_ = keep; }
  // [T, H] activation dtype: the last step's hidden states (empty unless set_keep_hidden).
  const Tensor& last_hidden() const { return last_hidden_; }
  // After a verify step: sequence s of the plan keeps kept_rows[s] of its rows (Model::commit_verified).
  void commit_verified(std::span<const int32_t> kept_rows);
  // One MTP step (Model::mtp_forward with layer `mtp_layer`) over `rows`, hidden states gathered
  // from `hidden_source` [*, H]. Returns the draft logits [R, vocab] f32 of the rows that want them
  // (in order); `out_hidden` receives o_t of every row [T, H] (a runner-owned buffer, valid until
  // the second next call).
  Tensor run_mtp(std::span<const MtpRows> rows, const Tensor& hidden_source, int64_t mtp_layer, Tensor& out_hidden);

  size_t workspace_bytes() const { return workspace_.capacity_bytes(); }

 private:
  struct HostStep;  // the step's host arrays
  // Fills the host arrays for `plan`, padded to `padded_seqs` decode rows when > 0.
  void build_host_step(const SchedulePlan& plan, int64_t padded_seqs, StepResult& result);
  ForwardBatch upload(bool fixed_block_stride);
  void run_forward(const ForwardBatch& batch, const Tensor& logits);
  // Sets hidden_out (set_keep_hidden) and, for a verify step, the verify scratch and index.
  void attach_speculative_outputs(ForwardBatch& batch, bool verify);

  Model& model_;
  RunnerLimits limits_;
  CacheManager* cache_ = nullptr;
  Arena workspace_;
  std::unique_ptr<HostStep> host_;

  // Device copies of the step inputs at fixed addresses (GPU), each sized for the limits.
  OwnedTensor token_ids_, positions_, cu_q_, kv_lens_, block_tables_, slot_mapping_, logit_rows_, state_slots_;
  // Speculative decoding.
  bool keep_hidden_ = false;
  OwnedTensor hidden_;          // [>= T, H] activation dtype: the trunk step's hidden_out
  Tensor last_hidden_;          // hidden_ sliced to the last step's rows
  OwnedTensor verify_scratch_;  // Model::verify_scratch_bytes of the largest verify step so far
  OwnedTensor verify_seq_index_;  // [max_num_seqs] i32: 0, 1, ..., S-1
  ForwardBatch last_verify_;    // the last verify step's batch, until its commit
  bool commit_pending_ = false;
  OwnedTensor mtp_hidden_in_, mtp_out_[2], mtp_gather_, mtp_logits_;
  int mtp_flip_ = 0;
  OwnedTensor logits_;        // [max_num_seqs, vocab] f32 (GPU); this step's logits (CPU)
  OwnedTensor score_logits_;  // one-off buffer for steps with more rows than logits_ holds

  struct Graph;
  std::map<int64_t, std::unique_ptr<Graph>> graphs_;  // by padded batch size
};

}  // namespace metrale
