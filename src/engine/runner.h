// Runner: turns a schedule into the model's ForwardBatch, runs the forward and hands back the
// logits of the requested rows.
//
// Step inputs live in persistent buffers sized for the engine's limits: host arrays (pinned when a
// GPU is used) are filled once per step and uploaded once into device buffers at fixed addresses,
// so that CUDA graphs captured for decode batch sizes can be replayed with new inputs. Decode steps
// whose batch fits a captured size are padded to it (padding rows write no KV and their logits are
// ignored); other steps run eagerly.
//
// Speculative decoding (runner_speculative.cpp): verify steps where every sequence decodes run in
// a fixed layout, 1 + k rows per sequence (padding rows after a sequence's own drafts, padding
// sequences up to a captured size), with every row's greedy token sampled in the same step; the
// commit of the kept rows and the MTP draft chain (catch-up over the kept rows, then k - 1 chained
// drafts, greedy on the device) follow in fixed buffers. Each of the three replays a CUDA graph per
// (batch size, k) on the GPU, and runs the same code eagerly on the CPU.
//
// Models with recurrent layers also get each sequence's state slot (ForwardBatch::state_slots),
// uploaded like the other arrays, so graph replays read the slots of the step they replay. Padding
// rows use the cache's padding slot, which no sequence reads.
#pragma once

#include <algorithm>
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
  // Speculative decoding: drafts per sequence at most (0: none). With drafts, verify steps where
  // every sequence decodes run in the fixed layout (Runner::execute) and, on the GPU, as graphs.
  int64_t max_drafts = 0;
  bool mtp = false;  // the engine drafts with the model's MTP head
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

// One MTP catch-up row whose draft nobody reads (Model::mtp_write_keys): trunk position
// `position` of a sequence, the token after it (x_{t+1}) and the row of a hidden source holding h_t.
struct MtpKeyRow {
  int64_t seq_id = 0;
  int64_t position = 0;
  int32_t next_token = 0;
  int64_t hidden_row = 0;
};

struct StepResult {
  Tensor logits;                    // [R, vocab] f32 on the model's device
  std::vector<LogitRowUse> uses;    // one per scheduled chunk
  bool used_graph = false;
  // Fixed-layout verify steps (rows_per_seq > 0): sequence s of the plan owns batch rows and logits
  // rows [s * rows_per_seq, (s + 1) * rows_per_seq), its known token first, then its drafts, then
  // padding rows; greedy_tokens / greedy_logprobs [rows] (i32 / f32, on the model's device) hold
  // every row's argmax (lowest id on ties) and its raw log-softmax, computed with the step (or, for a
  // ragged verify, by Runner::greedy_rows).
  int64_t rows_per_seq = 0;
  Tensor greedy_tokens, greedy_logprobs;
};

// One sequence of a fixed-layout MTP step (Runner::launch_mtp_fixed) after a fixed-layout verify or a
// decode step.
struct MtpFixedRow {
  bool drafting = false;             // false: the sequence finished (its rows write nothing)
  int32_t accepted = 0;              // a: drafts the verify accepted (rows 0..a are kept)
  std::vector<int32_t> next_tokens;  // a + 1 tokens: the accepted drafts, then the emitted token
  int64_t chain_positions = 0;       // chained draft rows whose positions have cache blocks (< drafts)
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
  // GPU only: captures one decode graph per batch size (those above max_num_seqs are skipped) and,
  // with drafts, the verify, commit and MTP graphs of each (batch size, k).
  void capture_decode_graphs(const std::vector<int64_t>& batch_sizes);
  std::vector<int64_t> graph_batch_sizes() const;

  // Runs one step. Every chunk's blocks must already be reserved. A plan with draft rows runs as a
  // verify step (ForwardBatch::verify; the fixed layout when every sequence decodes, else ragged and
  // eager); commit_verified must follow before the next step.
  StepResult execute(const SchedulePlan& plan);

  // ---- Speculative decoding
  // Ask every step for the final hidden state of each row (the MTP drafter's h_t). With
  // RunnerLimits::mtp the decode and verify graphs always write it (into a fixed buffer).
  void set_keep_hidden(bool keep) { keep_hidden_ = keep; }
  // [T, H] activation dtype: the last step's hidden states (empty unless set_keep_hidden).
  const Tensor& last_hidden() const { return last_hidden_; }
  // After a verify step: sequence s of the plan keeps kept_rows[s] of its rows (Model::commit_verified).
  // `mtp_follows`: launch_mtp_fixed comes next; a graphed commit then runs on a stream of its own,
  // beside the MTP chain (they share no data), and the model's stream waits for it after the chain.
  void commit_verified(std::span<const int32_t> kept_rows, bool mtp_follows = false);
  // After a fixed-layout verify step and its commit: the MTP catch-up over each sequence's kept rows
  // (the verify's hidden states, in place) and up to `drafts` - 1 chained drafts (at least as many
  // as asked for, at most max_drafts), greedy on the device, in one CUDA graph when captured.
  // `rows` follows the verify plan's sequences. Queued without waiting: collect_mtp_fixed() returns
  // each drafting sequence's drafts (1 + chain_positions of them; none for the others) and must
  // come before the next step.
  void launch_mtp_fixed(std::span<const MtpFixedRow> rows, int64_t drafts);
  // Whether the last step can feed launch_mtp_fixed: a fixed-layout verify, or (MTP) a step where
  // every sequence decoded one token (k = 0: one catch-up row per sequence).
  bool fixed_mtp_ready() const { return limits_.mtp && last_fixed_.seqs > 0; }
  std::vector<std::vector<int32_t>> collect_mtp_fixed();
  // A verify step in the ragged layout (it had prefill rows, or no fixed shape fits): every logits
  // row's argmax and raw logprob on the device, into result.greedy_tokens / greedy_logprobs as a
  // fixed-layout verify computes them with the step.
  void greedy_rows(StepResult& result);
  // The greedy tokens and logprobs of the last verify's rows on the host (both copied in one
  // synchronisation); valid until the next step.
  std::pair<std::span<const int32_t>, std::span<const float>> fetch_greedy_rows(const StepResult& result);
  // The argmax (lowest id on ties) of each row of `logits` [R, V] f32 on the model's device, taken
  // there (speculative decoding only; R at most max_num_seqs (1 + max_drafts)).
  std::vector<int32_t> argmax_rows(const Tensor& logits);
  // One MTP step (Model::mtp_forward with layer `mtp_layer`) over `rows`, hidden states gathered
  // from `hidden_source` [*, H]. Returns the draft logits [R, vocab] f32 of the rows that want them
  // (in order); `out_hidden` receives o_t of every row [T, H] (a runner-owned buffer, valid until
  // the second next call).
  Tensor run_mtp(std::span<const MtpRows> rows, const Tensor& hidden_source, int64_t mtp_layer, Tensor& out_hidden);
  // The MTP keys of `rows` only (Model::mtp_write_keys, layer 0), h_t gathered from `hidden_source`
  // [*, H]; in batches of at most the step's token limit, each padded to a power of two rows. Each
  // row's sequence must hold a cache block for its position. Eager; the row arrays go up in one
  // synchronous copy per batch.
  void run_mtp_keys(std::span<const MtpKeyRow> rows, const Tensor& hidden_source);
  // GPU, with RunnerLimits::mtp and a cache: runs run_mtp_keys' batch shapes once (padding rows
  // only), so that libraries choose and load their kernels before the first step.
  void warm_up_mtp_keys();
  // RunnerLimits::mtp: [mtp_stash_rows(), H] activation dtype, where the engine parks the hidden
  // states of decode steps that ran no MTP head until it writes their keys in one batch.
  const Tensor& mtp_stash() const { return mtp_stash_.tensor; }
  int64_t mtp_stash_rows() const { return mtp_stash_.tensor.empty() ? 0 : mtp_stash_.tensor.size(0); }
  // Queues a copy of rows [first, first + count) of the last step's hidden states to stash rows
  // [at, at + count).
  void stash_hidden_rows(int64_t first, int64_t count, int64_t at);

  size_t workspace_bytes() const { return workspace_.capacity_bytes(); }

 private:
  // Rows a step's buffers hold: the token budget, or one row per sequence when that is more.
  int64_t max_step_rows() const { return std::max(limits_.max_num_tokens, limits_.max_num_seqs); }
  struct HostStep;      // the step's host arrays
  struct CommitStream;  // the graphed commit's own stream and events (CUDA)
  // Makes the model's stream wait for a commit running beside the MTP chain (no-op otherwise).
  void join_commit();
  // Fills the host arrays for `plan`, padded to `padded_seqs` sequences when > 0. rows_per_seq > 0
  // lays every sequence out in exactly that many rows (decode graphs: 1; fixed-layout verify: 1 + k),
  // each of them a logits row; padding rows write no KV.
  void build_host_step(const SchedulePlan& plan, int64_t padded_seqs, int64_t rows_per_seq, StepResult& result);
  // The captured (or eager) shape a verify plan runs in the fixed layout: {padded sequences, k};
  // {0, 0} when it cannot (mixed step, too long, no such graph).
  std::pair<int64_t, int64_t> fixed_verify_shape(const SchedulePlan& plan) const;
  void execute_fixed_verify(const SchedulePlan& plan, int64_t padded_seqs, int64_t k, StepResult& result);
  // Records the plan's sequences as the last fixed-layout step (k = 0: a decode step).
  void remember_fixed(const SchedulePlan& plan, int64_t padded_seqs, int64_t k, bool graph);
  // Verify, commit and MTP parts of the fixed layout, as run eagerly and captured into graphs.
  void run_fixed_verify(const ForwardBatch& batch, int64_t rows, std::span<const LogitRowUse> uses);
  void run_fixed_commit(int64_t seqs, int64_t k);
  void run_fixed_mtp(int64_t seqs, int64_t k, int64_t drafts);
  // Allocates the fixed buffers of speculative steps (before the KV cache is planned).
  void allocate_speculative_buffers();
  // Every row's argmax and logprob of `logits` [R, V] f32 into greedy_tokens_ / greedy_logprobs_.
  void sample_greedy(const Tensor& logits);
  // Runs the largest fixed-layout verify, commit and MTP steps; returns the workspace high-water mark.
  size_t profile_fixed_steps();
  void capture_verify_graphs(const std::vector<int64_t>& batch_sizes);
  // A fixed-layout verify step of padding sequences only, ready to profile or capture.
  void prepare_fixed_shape(int64_t seqs, int64_t k);
  // Fill and upload the commit / MTP arrays of the last fixed-layout verify (empty spans: padding).
  void stage_fixed_commit(std::span<const int32_t> kept_rows);
  void stage_fixed_mtp(std::span<const MtpFixedRow> rows, int64_t drafts);
  // run_mtp_keys' batches: `rows` (at most `padded`) padded to `padded` rows.
  static constexpr int64_t kMinMtpKeyRows = 16;
  int64_t mtp_key_batch_rows(int64_t count) const;
  void run_mtp_key_batch(std::span<const MtpKeyRow> rows, int64_t padded, const Tensor& hidden_source);
  // Device arrays of the fixed-layout commit and MTP steps, views into one i32 buffer per shape.
  struct FixedArrays;
  FixedArrays fixed_arrays(int64_t seqs, int64_t k) const;
  ForwardBatch upload(bool fixed_block_stride);
  void run_forward(const ForwardBatch& batch, const Tensor& logits);
  // Sets hidden_out (set_keep_hidden) and, for a verify step, the verify scratch.
  // `fixed`: the verify scratch is the fixed-layout one (graph-safe), not the growable one.
  void attach_speculative_outputs(ForwardBatch& batch, bool verify, bool fixed = false);

  Model& model_;
  RunnerLimits limits_;
  CacheManager* cache_ = nullptr;
  // seams: the caches by owner; the manager holds cache_specs() then (MTP) mtp_cache_specs().
  size_t num_block_caches_ = model_.cache_specs().size();
  ModelCaches model_caches() const { return split_model_caches(cache_->block_caches(), num_block_caches_); }
  Arena workspace_;
  std::unique_ptr<HostStep> host_;

  // Device copies of the step inputs at fixed addresses (GPU), each sized for the limits.
  OwnedTensor token_ids_, positions_, cu_q_, kv_lens_, block_tables_, slot_mapping_, logit_rows_, state_slots_;
  // Speculative decoding.
  bool keep_hidden_ = false;
  OwnedTensor hidden_;          // [>= T, H] activation dtype: the trunk step's hidden_out
  Tensor last_hidden_;          // hidden_ sliced to the last step's rows
  OwnedTensor verify_scratch_;  // Model::verify_scratch_bytes of the largest verify step so far
  ForwardBatch last_verify_;    // the last verify step's batch, until its commit
  bool commit_pending_ = false;
  // The fixed-layout commit's temporaries, apart from workspace_: it may run beside the MTP chain.
  Arena commit_workspace_;
  std::unique_ptr<CommitStream> commit_stream_;
  bool commit_in_flight_ = false;  // a commit runs on commit_stream_; join_commit() before reading state
  OwnedTensor mtp_hidden_in_, mtp_out_[2], mtp_gather_, mtp_logits_;
  OwnedTensor mtp_stash_;     // [rows, H] hidden states awaiting their MTP keys (see mtp_stash())
  OwnedTensor mtp_key_ints_;  // run_mtp_keys' arrays: token ids, positions, slots, gather index
  int mtp_flip_ = 0;
  OwnedTensor logits_;        // [max_num_seqs, vocab] f32 (GPU); this step's logits (CPU)
  OwnedTensor score_logits_;  // one-off buffer for steps with more rows than logits_ holds

  struct Graph;
  std::map<int64_t, std::unique_ptr<Graph>> graphs_;  // by padded batch size

  // ---- Fixed-layout speculative steps
  OwnedTensor greedy_temperature_, greedy_top_k_, greedy_top_p_, greedy_min_p_, greedy_seed_, greedy_step_;
  OwnedTensor greedy_tokens_, greedy_logprobs_;  // [max verify rows] argmax and logprob of each row
  OwnedTensor fixed_verify_scratch_;             // verify scratch of the largest fixed-layout verify
  OwnedTensor fixed_ints_;                       // commit and MTP step arrays (FixedArrays)
  PinnedBuffer fixed_host_;                      // their host staging
  PinnedBuffer greedy_host_;                     // fetch_greedy_rows: tokens, then logprobs
  OwnedTensor mtp_drafts_;                       // [k, S] i32 greedy drafts of the MTP chain
  OwnedTensor mtp_fixed_hidden_[3];              // [T, H] catch-up o_t; [S, H] gathered / chained
  OwnedTensor mtp_fixed_logits_;                 // [S, V] f32
  struct FixedShape {
    int64_t seqs = 0, k = 0;  // padded sequences, rows_per_seq - 1
    int64_t real_seqs = 0;
    bool graph = false;
  };
  FixedShape last_fixed_;                       // the last fixed-layout verify step, until its MTP step
  std::vector<int64_t> fixed_seq_ids_;          // its sequences, in plan order
  std::vector<int64_t> fixed_first_positions_;  // the position of each one's known (first) row
  struct MtpPlan {
    int64_t max_kv_len = 0;  // the longest context of an eager MTP chain (0: the graph's bound)
  } mtp_plan_;
  std::vector<char> mtp_drafting_;  // per padded sequence of the chain: 1 when it drafts
  struct PendingMtp {
    int64_t seqs = 0, drafts = 0;          // 0: none in flight
    std::vector<int64_t> chain_positions;  // per real sequence; -1: not drafting
  } pending_mtp_;
  PinnedBuffer mtp_drafts_host_;    // [max_drafts, S] i32
  OwnedTensor mtp_draft_logprobs_;  // [S] f32 sampler output for the drafts (not read)
  struct VerifyGraphs;              // verify, commit and MTP graphs of one (padded sequences, k)
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<VerifyGraphs>> verify_graphs_;
};

}  // namespace metrale
