// Engine: the step loop. Callers add requests; each step() schedules a ragged batch (decode rows
// and prefill chunks together), runs it, samples, applies stop conditions and reports the new
// tokens. The engine is single-threaded: one thread owns it (and the device).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/fault_injection.h"
#include "engine/prefill_budget.h"
#include "engine/request.h"
#include "engine/runner.h"
#include "engine/scheduler.h"
#include "engine/speculative_decoder.h"
#include "engine/step_sampler.h"
#include "model/model.h"

namespace metrale {

class TensorParallelModel;

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
  // Host tier (--swap-space): host memory (pinned on a GPU) for the KV blocks and state slots of
  // preempted sequences, which are swapped out and back in instead of recomputed; 0: none.
  uint64_t swap_space_bytes = 0;
  // Disk tier (--high-speed-swap DIR, --swap-disk-space): files under this directory for the blocks
  // and state slots the host tier spills (LRU), bounded by swap_disk_bytes; empty: none.
  std::filesystem::path swap_disk_dir{};
  uint64_t swap_disk_bytes = 0;
  // Sequences at the head of the waiting queue whose disk reads are queued after each step, ahead
  // of their admission (their bytes then wait in host memory): a swapped-to-disk one's contents, a
  // new one's prefix-cache disk hits. 0: read at admission, inside the step.
  int32_t swap_prefetch = 2;
  // Speculative decoding (engine/speculator.h): method none|ngram|mtp, num_drafts, ngram_min/max.
  SpeculativeConfig speculative;
  // A step that carries decode rows takes at most this many times a decode-only step of its batch
  // (measured), its prefill chunks cut to fit (engine/prefill_budget.h); 0: no bound beyond the
  // token budget. Bounds the inter-token latency of decoding sequences while prompts prefill.
  double max_mixed_step_ratio = 0.0;
  // Tests: the fault-injection switch (engine/fault_injection.h); unset: METRALE_FAULT_INJECT,
  // read once when the engine is built; "": none.
  std::optional<std::string> fault_injection;
};

struct TokenEvent {
  int64_t request_id = 0;
  SampledToken sampled;              // token, logprob, top logprobs (token -1: an event without one)
  std::vector<SampledToken> prompt_logprobs;  // the first token's event: Sequence::prompt_logprobs
  FinishReason finish_reason = FinishReason::kNone;  // set on the event that finishes the request
  std::string error;                 // kError: why the request failed
  bool finished() const { return finish_reason != FinishReason::kNone; }
};

// Whether the engine can serve. A failed step fails its own requests and the engine keeps
// serving; only when the recovery from a failure fails (the device or the cache's books are
// broken) does the engine stop serving for good, failing every request with `reason`.
struct EngineHealth {
  bool serving = true;
  std::string reason;  // why not
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
  // Host tier: blocks and state slots it holds, and its bytes.
  int32_t num_host_blocks = 0;
  int32_t num_host_slots = 0;
  uint64_t host_tier_bytes = 0;
  // Device blocks that stage copies into the host tier (they overlap the forward), and their bytes.
  int32_t num_host_staging_blocks = 0;
  uint64_t host_staging_bytes = 0;
  // Disk tier: blocks and state slots it holds, its bytes, and its directory.
  int32_t num_disk_blocks = 0;
  int32_t num_disk_slots = 0;
  uint64_t disk_tier_bytes = 0;
  std::string disk_tier_dir;
  // Host <-> device copy bandwidth measured at start-up (bytes/s; 0 without a host tier).
  double copy_bytes_per_second = 0.0;
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
  // Host tier: preemptions that swapped a sequence out (the rest recompute), sequences brought
  // back, the device blocks and state slots copied each way, and the gauges of what it holds now.
  int64_t swapped_out_sequences = 0;
  int64_t swapped_in_sequences = 0;
  int64_t swapped_out_blocks = 0;
  int64_t swapped_in_blocks = 0;
  int64_t swapped_out_slots = 0;
  int64_t swapped_in_slots = 0;
  // Prefix-cache blocks evicted from the device into the host tier, and host hits brought back.
  int64_t prefix_blocks_to_host = 0;
  int64_t prefix_blocks_from_host = 0;
  int32_t host_blocks_total = 0;
  int32_t host_blocks_used = 0;
  int32_t host_slots_total = 0;
  int32_t host_slots_used = 0;  // held by swapped-out sequences (the rest: free or checkpoints)
  // Disk tier: swapped sequences moved there from the host tier, prefix blocks spilled there and
  // brought back; state checkpoints kept below the device and restored; tier entries lost to an
  // integrity failure (recomputed).
  int64_t swapped_to_disk_sequences = 0;
  int64_t prefix_blocks_to_disk = 0;
  int64_t prefix_blocks_from_disk = 0;
  int64_t prefix_blocks_written_ahead = 0;  // of those, written by a disk worker before their eviction
  int64_t disk_hits_declined = 0;  // disk hits recomputed instead: reading them was slower
  int64_t prefix_prefetches = 0;   // waiting requests whose prefix's disk reads began before admission
  int64_t checkpoints_to_host = 0;
  int64_t checkpoints_restored_from_tiers = 0;
  int64_t tier_entries_lost = 0;
  // Speculative decoding: draft tokens verified, those accepted, and verify steps (steps with at
  // least one draft row). accepted / drafted is the acceptance rate; a verify emits accepted + 1.
  int64_t drafted_tokens = 0;
  int64_t accepted_tokens = 0;
  int64_t verify_steps = 0;
  // Failure containment: steps abandoned after a failure, and the requests they failed.
  int64_t failed_steps = 0;
  int64_t failed_requests = 0;
};

class Engine {
 public:
  Engine(std::unique_ptr<Model> model, const EngineConfig& config);
  ~Engine();

  const Model& model() const { return *model_; }
  const EnginePlan& plan() const { return plan_; }
  EngineStats stats() const;
  const EngineHealth& health() const { return health_; }
  const CacheManager& cache() const { return *cache_; }
  CacheManager& mutable_cache() { return *cache_; }
  Runner& runner() { return *runner_; }

  // Validates and queues a request; returns its id. Throws kInvalidArgument for bad requests
  // (empty prompt, ids outside the vocabulary, bad sampling parameters, too long for the context
  // or for the whole KV cache), and kUnavailable once the engine can no longer serve.
  int64_t add_request(Request request);
  // Cancels a request: it finishes with kAbort and its blocks are freed at once.
  void abort_request(int64_t request_id);

  bool has_unfinished() const { return !running_.empty() || !waiting_.empty(); }
  size_t num_running() const { return running_.size(); }
  size_t num_waiting() const { return waiting_.size(); }

  // Runs one step; returns one event per token generated (and one for each request that finished
  // without a token, e.g. scoring or abort). A step that fails anywhere is abandoned: the requests
  // it scheduled end with a kError event (their other events of the step are dropped), nothing of
  // it stays pending, and the next step runs as if it had not happened.
  std::vector<TokenEvent> step();

  // A request's state (finished ones stay until release()).
  const Sequence& sequence(int64_t request_id) const;
  void release(int64_t request_id);

 private:
  // ---- Construction
  void validate_config() const;
  RunnerLimits runner_limits() const;
  // Divides the memory budget between KV blocks and recurrent-state slots and builds the cache.
  void plan_cache(const std::vector<CacheSpec>& specs);

  // ---- The step, in order (run_step); abandon_step when any of it throws.
  void run_step(std::vector<TokenEvent>& events);
  SchedulePlan schedule_step();
  // The step's decode and prefill shares and its wall time, for the prefill budget.
  // Queues the disk reads of the first swap_prefetch waiting sequences (CacheManager::prefetch,
  // prefetch_prefix): after each step and when a request arrives.
  void prefetch_waiting();
  void record_step_cost(const SchedulePlan& plan, std::chrono::steady_clock::time_point step_start);
  // Prefill steps' seconds per token, for the scheduler's swap-or-recompute choice.
  void record_prefill_cost(const SchedulePlan& plan, std::chrono::steady_clock::time_point step_start);
  StepResult forward(const SchedulePlan& plan);
  // The bookkeeping of one chunk: its kept rows become computed tokens (full blocks cached, state
  // checkpoints kept), then its emitted tokens become events until a stop condition.
  void advance(const LogitRowUse& use, int64_t kept_rows, int64_t accepted, const std::vector<SampledToken>& emitted);
  void emit(const LogitRowUse& use, std::vector<SampledToken>& emitted, std::vector<TokenEvent>& events);
  void abandon_step(const std::string& what, size_t first_step_event, std::vector<TokenEvent>& events);

  void finish(Sequence& sequence, FinishReason reason);
  // Ends `sequence` with kError and `message` (an event in `events`), wherever it is.
  void fail_request(Sequence& sequence, const std::string& message, std::vector<TokenEvent>& events);
  // Once the engine can no longer serve: fails every unfinished request with the reason.
  void fail_unfinished(std::vector<TokenEvent>& events);
  std::optional<FinishReason> stop_reason(const Sequence& sequence, int32_t token) const;

  std::unique_ptr<Model> model_;
  // model_ when it is a group of tensor-parallel ranks (its cache then holds every rank's tensors).
  TensorParallelModel* tensor_parallel_ = nullptr;
  EngineConfig config_;
  EnginePlan plan_;
  EngineStats stats_;  // counters kept by step(); stats() adds the cache's gauges
  EngineHealth health_;
  FaultInjector faults_;
  std::unique_ptr<CacheManager> cache_;
  std::unique_ptr<Runner> runner_;
  Scheduler scheduler_;
  std::optional<PrefillBudget> prefill_budget_;  // set with max_mixed_step_ratio
  std::unique_ptr<StepSampler> sampler_;
  std::unique_ptr<SpeculativeDecoder> speculative_;  // null without speculative decoding
  std::mt19937_64 seed_source_;

  int64_t next_id_ = 1;
  int64_t next_arrival_ = 0;
  std::unordered_map<int64_t, std::unique_ptr<Sequence>> sequences_;
  std::vector<Sequence*> running_;
  std::deque<Sequence*> waiting_;
  std::vector<TokenEvent> pending_events_;  // events produced outside step() (aborts)
  // The step in progress: whether it has its schedule yet, and the sequences it scheduled.
  bool step_scheduled_ = false;
  std::vector<Sequence*> step_sequences_;
  friend class EngineTestAccess;  // tests reach the speculative decoder (force_plain_steps, ...)
};

}  // namespace metrale
