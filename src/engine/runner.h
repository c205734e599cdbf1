// Runner: turns a schedule into the model's ForwardBatch (through the BatchBuilder), runs the
// forward and hands back the logits of the requested rows.
//
// Step inputs live in the builder's persistent buffers sized for the engine's limits: host arrays
// (pinned when a GPU is used) are filled once per step and uploaded once into device buffers at
// fixed addresses, so that CUDA graphs captured for decode batch sizes can be replayed with new
// inputs. Decode steps whose batch fits a captured size are padded to it (padding rows write no KV
// and their logits are ignored); other steps run eagerly.
//
// Speculative decoding (runner_speculative.cpp): verify steps where every sequence decodes run in
// a fixed layout, 1 + k rows per sequence (padding rows after a sequence's own drafts, padding
// sequences up to a captured size), with every row's greedy token sampled in the same step; the
// commit of the kept rows and the MTP draft chain (catch-up over the kept rows, then k - 1 chained
// drafts, greedy on the device) follow in fixed buffers. Each of the three replays a CUDA graph per
// (batch size, k) on the GPU, and runs the same code eagerly on the CPU. The runner keeps no
// bookkeeping between them: a verify's StepResult carries what its commit and its MTP chain need,
// and the SpeculativeDecoder (engine/speculative_decoder.h) holds it until they run.
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
#include "engine/batch_builder.h"
#include "engine/scheduler.h"
#include "model/model.h"

namespace metrale {

// The cache specs the engine's CacheManager is built from: the model's layers', then with MTP
// drafting its MTP layers' (same block numbering).
// The runner hands them to the model as ModelCaches{blocks, mtp}, two subspans of the manager's
// block caches.
std::vector<CacheSpec> engine_cache_specs(const Model& model, bool mtp);

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

// A step in the fixed layout that the MTP chain continues from: a fixed-layout verify (k drafts),
// or with MTP a decode step (k = 0), whose hidden states sit in the runner's fixed buffer.
struct FixedStep {
  int64_t seqs = 0;       // padded sequences
  int64_t k = 0;          // rows per sequence - 1
  int64_t real_seqs = 0;  // the plan's sequences, first
  bool graph = false;     // the step replayed a graph: its commit and MTP chain replay theirs
  std::vector<int64_t> seq_ids;          // the plan's sequences, in order
  std::vector<int64_t> first_positions;  // the position of each one's known (first) row
  bool empty() const { return seqs == 0; }
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
  // [T, H] activation dtype: every row's hidden state (Runner::set_keep_hidden; empty otherwise).
  Tensor hidden;
  // A verify step's batch (verify.verify set): its commit (Runner::commit_verified) reads it, and the
  // step buffer it views must not be rebuilt before then.
  ForwardBatch verify;
  FixedStep fixed;  // what the fixed-layout MTP chain continues from (empty: it cannot)
};

// One sequence of a fixed-layout MTP step (Runner::launch_mtp_fixed) after a fixed-layout verify or a
// decode step.
struct MtpFixedRow {
  bool drafting = false;             // false: the sequence finished (its rows write nothing)
  int32_t accepted = 0;              // a: drafts the verify accepted (rows 0..a are kept)
  std::vector<int32_t> next_tokens;  // a + 1 tokens: the accepted drafts, then the emitted token
  int64_t chain_positions = 0;       // chained draft rows whose positions have cache blocks (< drafts)
};

// An MTP chain queued by Runner::launch_mtp_fixed, until Runner::collect_mtp_fixed.
struct MtpChain {
  int64_t seqs = 0, drafts = 0;          // drafts = 0: none
  std::vector<int64_t> chain_positions;  // per real sequence; -1: not drafting
  bool empty() const { return drafts == 0; }
};

class Runner {
 public:
  Runner(Model& model, const RunnerLimits& limits);
  ~Runner();

  void set_cache(CacheManager* cache) { cache_ = cache; }
  const RunnerLimits& limits() const { return limits_; }
  // The memory planner may lower the sequence limit after the workspace was sized for a larger one.
  void lower_max_num_seqs(int64_t max_num_seqs);
  BatchBuilder& batch_builder() { return builder_; }

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

  // After a failed step: waits for whatever it left queued (a commit beside the MTP chain
  // included), so that nothing still reads the buffers the next step refills. Throws when the
  // device itself failed.
  void abandon();

  // ---- Speculative decoding
  // Ask every step for the final hidden state of each row (the MTP drafter's h_t). With
  // RunnerLimits::mtp the decode and verify graphs always write it (into a fixed buffer).
  void set_keep_hidden(bool keep) { keep_hidden_ = keep; }
  // After a verify step (its StepResult::verify and ::fixed): sequence s of its plan keeps
  // kept_rows[s] of its rows (Model::commit_verified). `mtp_follows`: launch_mtp_fixed comes next;
  // a graphed commit then runs on a stream of its own, beside the MTP chain (they share no data),
  // and the model's stream waits for it after the chain.
  void commit_verified(const ForwardBatch& verify, const FixedStep& fixed, std::span<const int32_t> kept_rows,
                       bool mtp_follows = false);
  // After a fixed-layout step (StepResult::fixed) and its commit: the MTP catch-up over each
  // sequence's kept rows (the step's hidden states, in place) and up to `drafts` - 1 chained drafts
  // (at least as many as asked for, at most max_drafts), greedy on the device, in one CUDA graph
  // when captured. `rows` follows the step's sequences. Queued without waiting: collect_mtp_fixed()
  // returns each drafting sequence's drafts (1 + chain_positions of them; none for the others) and
  // must come before the next step.
  MtpChain launch_mtp_fixed(const FixedStep& step, std::span<const MtpFixedRow> rows, int64_t drafts);
  std::vector<std::vector<int32_t>> collect_mtp_fixed(const MtpChain& chain);
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
  // Queues a copy of rows [first, first + count) of `hidden` (a step's StepResult::hidden) to stash
  // rows [at, at + count).
  void stash_hidden_rows(const Tensor& hidden, int64_t first, int64_t count, int64_t at);

  size_t workspace_bytes() const { return workspace_.capacity_bytes(); }

 private:
  // Rows a step's buffers hold: the token budget, or one row per sequence when that is more.
  int64_t max_step_rows() const { return std::max(limits_.max_num_tokens, limits_.max_num_seqs); }
  struct CommitStream;  // the graphed commit's own stream and events (CUDA)
  // A fixed-layout verify step of padding sequences only, ready to profile or capture.
  struct FixedShapeStep {
    ForwardBatch batch;
    FixedStep step;
  };
  // An MTP chain's arrays as staged (stage_fixed_mtp), what run_fixed_mtp runs.
  struct StagedMtp {
    FixedLayout layout;
    int64_t drafts = 0;
    int64_t max_kv_len = 0;      // the longest context of an eager chain (0: the graph's bound)
    std::vector<char> drafting;  // per padded sequence: 1 when it drafts
  };
  // Makes the model's stream wait for a commit running beside the MTP chain (no-op otherwise).
  void join_commit();
  // The row groups of `plan` (result.uses follows them), padded to `padded_seqs` sequences when
  // > 0, built and uploaded. rows_per_seq > 0 lays every sequence out in exactly that many rows
  // (decode graphs: 1; fixed-layout verify: 1 + k), each of them a logits row; padding rows write
  // no KV. Padded steps (graphs) take the fixed block-table stride and the longest context bound;
  // `max_kv_len` > 0 sets the bound of an unpadded step (the workspace profile).
  ForwardBatch build_step(const SchedulePlan& plan, int64_t padded_seqs, int64_t rows_per_seq, StepResult& result,
                          int64_t max_kv_len = 0);
  // The captured (or eager) shape a verify plan runs in the fixed layout: {padded sequences, k};
  // {0, 0} when it cannot (mixed step, too long, no such graph).
  std::pair<int64_t, int64_t> fixed_verify_shape(const SchedulePlan& plan) const;
  void execute_fixed_verify(const SchedulePlan& plan, int64_t padded_seqs, int64_t k, StepResult& result);
  // The plan's sequences as a fixed-layout step (k = 0: a decode step).
  static FixedStep fixed_step(const SchedulePlan& plan, int64_t padded_seqs, int64_t k, bool graph);
  // Verify, commit and MTP parts of the fixed layout, as run eagerly and captured into graphs.
  void run_fixed_verify(const ForwardBatch& batch, int64_t rows, std::span<const LogitRowUse> uses);
  void run_fixed_commit(const FixedLayout& layout, const ForwardBatch& verify);
  void run_fixed_mtp(const StagedMtp& staged);
  // Allocates the fixed buffers of speculative steps (before the KV cache is planned).
  void allocate_speculative_buffers();
  // Every row's argmax and logprob of `logits` [R, V] f32 into greedy_tokens_ / greedy_logprobs_.
  void sample_greedy(const Tensor& logits);
  // Runs the largest fixed-layout verify, commit and MTP steps; returns the workspace high-water mark.
  size_t profile_fixed_steps();
  void capture_verify_graphs(const std::vector<int64_t>& batch_sizes);
  FixedShapeStep prepare_fixed_shape(int64_t seqs, int64_t k);
  // Fills and uploads the MTP catch-up and chain arrays after fixed-layout step `step` (empty rows:
  // padding only).
  StagedMtp stage_fixed_mtp(const FixedStep& step, std::span<const MtpFixedRow> rows, int64_t drafts);
  // run_mtp_keys' batches: `rows` (at most `padded`) padded to `padded` rows.
  static constexpr int64_t kMinMtpKeyRows = 16;
  int64_t mtp_key_batch_rows(int64_t count) const;
  void run_mtp_key_batch(std::span<const MtpKeyRow> rows, int64_t padded, const Tensor& hidden_source);
  void run_forward(const ForwardBatch& batch, const Tensor& logits);
  // Sets hidden_out (set_keep_hidden: also result.hidden) and, for a verify step, the verify scratch.
  // `fixed`: the verify scratch is the fixed-layout one (graph-safe), not the growable one.
  void attach_speculative_outputs(ForwardBatch& batch, bool verify, bool fixed, StepResult& result);

  Model& model_;
  RunnerLimits limits_;
  CacheManager* cache_ = nullptr;
  // The caches by owner; the manager holds cache_specs() then (MTP) mtp_cache_specs().
  size_t num_block_caches_ = model_.cache_specs().size();
  ModelCaches model_caches() const { return split_model_caches(cache_->block_caches(), num_block_caches_); }
  Arena workspace_;
  BatchBuilder builder_;
  std::vector<RowGroup> groups_, chain_groups_;  // the step's row groups (capacity reused)

  // Speculative decoding.
  bool keep_hidden_ = false;
  // The first step served runs eagerly with ForwardBatch::calibrate_kv_scales (blocks calibrating
  // their KV-cache scales see real tokens, never a graph replay).
  bool first_step_ = true;
  // From the first step until the second: the MTP head's forwards (catch-up keys, drafts) run
  // eagerly with ForwardBatch::calibrate_kv_scales too, so that its layers calibrate on their first
  // real keys.
  bool calibrate_mtp_ = false;
  OwnedTensor hidden_;          // [>= T, H] activation dtype: the trunk step's hidden_out
  OwnedTensor verify_scratch_;  // Model::verify_scratch_bytes of the largest verify step so far
  // The fixed-layout commit's temporaries, apart from workspace_: it may run beside the MTP chain.
  Arena commit_workspace_;
  std::unique_ptr<CommitStream> commit_stream_;
  bool commit_in_flight_ = false;  // a commit runs on commit_stream_; join_commit() before reading state
  OwnedTensor mtp_hidden_in_, mtp_out_[2], mtp_logits_;
  OwnedTensor mtp_stash_;     // [rows, H] hidden states awaiting their MTP keys (see mtp_stash())
  int mtp_flip_ = 0;
  OwnedTensor logits_;        // [max_num_seqs, vocab] f32 (GPU); this step's logits (CPU)
  OwnedTensor score_logits_;  // one-off buffer for steps with more rows than logits_ holds

  struct Graph;
  std::map<int64_t, std::unique_ptr<Graph>> graphs_;  // by padded batch size

  // ---- Fixed-layout speculative steps
  OwnedTensor greedy_temperature_, greedy_top_k_, greedy_top_p_, greedy_min_p_, greedy_seed_, greedy_step_;
  OwnedTensor greedy_tokens_, greedy_logprobs_;  // [max verify rows] argmax and logprob of each row
  OwnedTensor fixed_verify_scratch_;             // verify scratch of the largest fixed-layout verify
  PinnedBuffer greedy_host_;                     // fetch_greedy_rows: tokens, then logprobs
  OwnedTensor mtp_drafts_;                       // [k, S] i32 greedy drafts of the MTP chain
  OwnedTensor mtp_fixed_hidden_[3];              // [T, H] catch-up o_t; [S, H] gathered / chained
  OwnedTensor mtp_fixed_logits_;                 // [S, V] f32
  PinnedBuffer mtp_drafts_host_;                 // [max_drafts, S] i32
  OwnedTensor mtp_draft_logprobs_;               // [S] f32 sampler output for the drafts (not read)
  struct VerifyGraphs;                           // verify, commit and MTP graphs of one (padded sequences, k)
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<VerifyGraphs>> verify_graphs_;
};

}  // namespace metrale
