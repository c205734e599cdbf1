// Engine: the step loop. Callers add requests; each step() schedules a ragged batch (decode rows
// and prefill chunks together), runs it, samples, applies stop conditions and reports the new
// tokens. The engine is single-threaded: one thread owns it (and the device).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/request.h"
#include "engine/runner.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/speculator.h"
#include "model/model.h"

namespace metrale {

struct EngineConfig {
  int32_t block_size = 16;
  int32_t num_kv_blocks = 0;            // 0: planned from kv_cache_bytes and the limits below
  uint64_t kv_cache_bytes = 2ull << 30; // budget for the KV cache when num_kv_blocks is 0
  int64_t max_model_len = 0;            // 0: the model's max_position_embeddings
  SchedulerConfig scheduler;
  // GPU: the fraction of device memory the engine may use (weights, workspace, graphs, KV cache).
  double gpu_memory_utilization = 0.90;
  bool cuda_graphs = true;               // capture decode steps as CUDA graphs
  std::vector<int64_t> graph_batch_sizes = {1, 2, 4, 8, 16, 32, 64, 128, 256};
  // Reuse the KV blocks (and on hybrid models the recurrent state) of cached prompt prefixes.
  bool enable_prefix_caching = true;
  // Hybrid models with prefix caching: a state checkpoint every this many prefill tokens (rounded
  // up to a multiple of block_size) and at the end of each prompt's last full block.
  int64_t state_checkpoint_interval = 512;
  int32_t state_checkpoint_slots = -1;   // checkpoint slots; -1: as many as max_num_seqs
  // Speculative decoding (engine/speculator.h): method none|ngram|mtp, num_drafts, ngram_min/max.
  SpeculativeConfig speculative;
};

struct TokenEvent {
  int64_t request_id = 0;
  SampledToken sampled;              // token, logprob, top logprobs
  FinishReason finish_reason = FinishReason::kNone;  // set on the event that finishes the request
  bool finished() const { return finish_reason != FinishReason::kNone; }
};

// What the planner chose, for logs and tests.
struct EnginePlan {
  int32_t num_kv_blocks = 0;
  int32_t block_size = 0;
  int64_t max_model_len = 0;
  uint64_t kv_cache_bytes = 0;
  int32_t max_num_seqs = 0;          // may be below the configured one when memory is short
  bool prefix_caching = false;
  // Recurrent layers: state slots for running sequences and for prefix-cache checkpoints.
  int32_t num_state_slots = 0;
  int32_t num_checkpoint_slots = 0;
  uint64_t state_bytes_per_slot = 0;
  uint64_t state_bytes = 0;          // all slots, the padding slot included
  uint64_t workspace_bytes = 0;      // GPU step workspace
  uint64_t device_total_bytes = 0;   // GPU memory
  uint64_t used_before_cache = 0;    // weights + workspace + runtime, measured before the KV cache
  std::vector<int64_t> graph_batch_sizes;
  std::string describe() const;      // one line for logs and `bench`
};

// Counters since start-up, for /metrics and logs. Read on the engine thread (the async wrapper
// copies them out after each step).
struct EngineStats {
  int64_t num_steps = 0;
  int64_t num_preemptions = 0;
  int64_t prompt_tokens = 0;           // prompt tokens of admitted requests
  int64_t computed_prompt_tokens = 0;  // prompt tokens actually run through the model
  int64_t generated_tokens = 0;
  // Prefix cache: tokens looked up at admission and tokens found cached (hits / queries is the
  // token hit rate); hybrid models count a hit only when the recurrent state was restored as well.
  int64_t prefix_cache_queries = 0;
  int64_t prefix_cache_hits = 0;
  int64_t hybrid_state_restores = 0;   // prefix hits that restored a recurrent-state checkpoint
  int32_t kv_blocks_total = 0;
  int32_t kv_blocks_used = 0;          // held by running sequences
  int32_t kv_blocks_cached = 0;        // free but holding reusable prefix blocks
  int32_t state_slots_total = 0;
  int32_t state_slots_used = 0;
  // Speculative decoding: draft tokens verified, those accepted, and verify steps (steps with at
  // least one draft row). accepted / drafted is the acceptance rate; a verify emits accepted + 1.
  int64_t drafted_tokens = 0;
  int64_t accepted_tokens = 0;
  int64_t verify_steps = 0;
};

class Engine {
 public:
  Engine(std::unique_ptr<Model> model, const EngineConfig& config);
  ~Engine();

  const Model& model() const { return *model_; }
  const EnginePlan& plan() const { return plan_; }
  EngineStats stats() const;
  const CacheManager& cache() const { return *cache_; }
  CacheManager& mutable_cache() { return *cache_; }
  Runner& runner() { return *runner_; }

  // Validates and queues a request; returns its id. Throws kInvalidArgument for bad requests
  // (empty prompt, ids outside the vocabulary, bad sampling parameters, too long for the context
  // or for the whole KV cache).
  int64_t add_request(Request request);
  // Cancels a request: it finishes with kAbort and its blocks are freed at once.
  void abort_request(int64_t request_id);

  bool has_unfinished() const { return !running_.empty() || !waiting_.empty(); }
  size_t num_running() const { return running_.size(); }
  size_t num_waiting() const { return waiting_.size(); }

  // Runs one step; returns one event per token generated (and one for each request that finished
  // without a token, e.g. scoring or abort).
  std::vector<TokenEvent> step();

  // A request's state (finished ones stay until release()).
  const Sequence& sequence(int64_t request_id) const;
  void release(int64_t request_id);

 private:
  void finish(Sequence& sequence, FinishReason reason);
  std::optional<FinishReason> stop_reason(const Sequence& sequence, int32_t token) const;

  // ---- Speculative decoding (engine/speculator.h, engine/engine_speculative.cpp)
  bool speculating() const { return config_.speculative.method != SpeculativeMethod::kNone; }
  // Validates the speculative config against the model (turning it off where the model cannot
  // verify) and appends the MTP layers' cache specs to `specs` for method mtp.
  void configure_speculation(std::vector<LayerCacheSpec>& specs);
  // Before scheduling: gives each decoding sequence its drafts for this step (n-gram lookup, or
  // the MTP drafts made after the last step), as many as the controller allows.
  void prepare_drafts();
  // The tokens one sampling chunk emits: for a verify chunk the accepted drafts then the
  // replacement or bonus token; otherwise the one sampled token. Sets `accepted` (drafts kept).
  std::vector<SampledToken> accept_chunk(const LogitRowUse& use, const Tensor& logits, int64_t& accepted);
  // Drafts the MTP head chains after this step: what the controller plans for the next one (at least one).
  int32_t mtp_chain_length() const;
  // After a step's bookkeeping: MTP catch-up over the step's kept rows and the next drafts.
  void run_mtp_drafter(const StepResult& result, std::span<const int64_t> kept_rows);
  // The same after a fixed-layout verify of greedy requests: catch-up and chained drafts in one
  // runner call (one CUDA graph), greedy drafts taken on the device. Launched right after the
  // commit, from the accepted counts and emitted tokens, so that the step's bookkeeping on the host
  // overlaps it; collected after the bookkeeping (drafts of sequences that finished are dropped).
  void launch_mtp_drafter_fixed(const StepResult& result, std::span<const int64_t> accepted,
                                const std::vector<std::vector<SampledToken>>& emitted);
  void collect_mtp_drafter_fixed(const StepResult& result);
  // After a step that ran no MTP head: the MTP keys of its kept rows, so that the head finds every
  // earlier position when it runs again (and a probe measures the head's true acceptance). A decode
  // step parks its hidden states in the runner's stash, written in one batch when the stash fills
  // or before the head runs; other steps write theirs at once.
  void write_mtp_keys(const StepResult& result, std::span<const int64_t> kept_rows);
  // Writes the keys of the stashed rows whose sequences still hold their positions; empties the stash.
  void flush_mtp_stash();
  // After the step's bookkeeping: the first `count` of the `kept` rows `use` kept, as MTP key rows
  // (position t, x_{t+1}, h_t's row of the step's batch).
  void append_mtp_key_rows(const LogitRowUse& use, int64_t kept, int64_t count, std::vector<MtpKeyRow>& rows) const;
  // The MTP head has seen the sequence up to `end`; positions from mtp_computed to `first_position`
  // it never saw count as missed.
  static void advance_mtp(Sequence& sequence, int64_t first_position, int64_t end);
  // Every sequence of the step samples greedily (or acceptance is replayed), without penalties, top
  // logprobs or prompt logits: its next token is the argmax, its MTP drafts the head's argmax, and a
  // verify step accepts from the argmax rows alone.
  bool all_greedy(const StepResult& result) const;
  // Greedy acceptance from StepResult::greedy_tokens (copied to the host, a few bytes per row).
  bool accept_greedy_rows(const StepResult& result, std::vector<std::vector<SampledToken>>& emitted,
                          std::vector<int64_t>& accepted);

  std::unique_ptr<Model> model_;
  EngineConfig config_;
  EnginePlan plan_;
  EngineStats stats_;  // counters kept by step(); stats() adds the cache's gauges
  std::unique_ptr<CacheManager> cache_;
  std::unique_ptr<Runner> runner_;
  Scheduler scheduler_;
  Sampler sampler_;
  std::mt19937_64 seed_source_;

  int64_t next_id_ = 1;
  int64_t next_arrival_ = 0;
  std::unordered_map<int64_t, std::unique_ptr<Sequence>> sequences_;
  std::vector<Sequence*> running_;
  std::deque<Sequence*> waiting_;
  std::vector<TokenEvent> pending_events_;  // events produced outside step() (aborts)
  std::vector<float> host_logits_;          // logits rows copied from the device for sampling
  SpeculationController spec_controller_;
  bool mtp_active_ = false;                 // this step runs the MTP head afterwards
  double spec_untimed_seconds_ = 0.0;       // this step's one-off work left out of its measured cost
  std::vector<MtpKeyRow> mtp_stash_rows_;   // rows waiting in Runner::mtp_stash() (hidden_row: stash row)
  MtpChain mtp_chain_;                      // launched by launch_mtp_drafter_fixed until collected
  // Tests (EngineTestAccess): the next this many steps run plain with the MTP head off, whatever
  // the controller chooses.
  int64_t forced_plain_steps_ = 0;
  friend class EngineTestAccess;
  int64_t mtp_stash_used_ = 0;              // stash rows taken (finished sequences' rows included)
  std::vector<float> spec_scratch_;         // [V] rows for acceptance
  std::vector<float> spec_probs_;           // [V] target distribution

  // Sampling on the device: per-row parameters and results, sized for max_num_seqs rows.
  struct DeviceSampling;
  std::unique_ptr<DeviceSampling> device_sampling_;
  // Samples rows [0, uses.size()) of a device logits tensor on the device when every row can be
  // (no penalties, no top logprobs) and rows line up with the chunks; returns false otherwise.
  bool sample_on_device(const StepResult& result, std::vector<SampledToken>& sampled);
};

}  // namespace metrale
