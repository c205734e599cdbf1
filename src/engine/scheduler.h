// Scheduler: decides what each step computes. There are no prefill and decode phases: every
// sequence has tokens (prompt + generated) and num_computed of them are cached; a step gives each
// scheduled sequence a chunk of its uncomputed tokens, under one token budget shared by decode rows
// and prefill chunks (vLLM v1's rule). Running sequences come first, oldest first; waiting ones are
// admitted FCFS while the budget, --max-num-seqs and free KV blocks allow. When a running sequence
// cannot get a block, the newest running sequence is preempted: swapped out to the cache's host
// tier when it has room for the sequence's blocks and state slot and swapping is the cheaper way
// back (swapped back in, whole, when the sequence is admitted again, and it goes on where it
// stopped), otherwise its blocks freed and its tokens kept, recomputed later; nothing it generated
// is lost or repeated. The cost compares moving its cache bytes out and back at the measured
// host<->device bandwidth with prefilling its computed tokens again at the measured cost per token
// (PreemptionCosts; unmeasured: swap whenever the tier has room). A swapped sequence whose
// contents were lost in the tier (an integrity failure) is recomputed instead.
//
// Prefix cache: a sequence is admitted from the longest cached prefix of its tokens (shared blocks,
// and on hybrid models a restored state checkpoint) and computes only the rest; scoring requests
// (return_prompt_logits) need every row and skip the lookup. A preempted sequence drops its block
// references; blocks that are cached stay cached, so its recompute usually starts from a hit.
// Hybrid models: prefill chunks end at the cache's state checkpoint points, where the engine keeps
// a copy of the state. A step with decode rows carries at most the prefill limit's tokens of
// prefill chunks (set_prefill_limit), so that decoding sequences do not wait behind long chunks.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/request.h"

namespace metrale {

// How a preempted sequence gets back: by the cheaper way (kAuto: swap or recompute, PreemptionCosts),
// by a swap whenever the tier has room (kSwap), or always by recompute (kRecompute).
enum class PreemptionMode { kAuto, kSwap, kRecompute };

struct SchedulerConfig {
  int32_t max_num_seqs = 64;              // running sequences at most
  int32_t max_num_batched_tokens = 2048;  // tokens per step at most
  int32_t max_prefill_chunk = 0;          // tokens per sequence per step at most (0: no limit)
  PreemptionMode preemption_mode = PreemptionMode::kAuto;
};

struct ScheduledChunk {
  Sequence* sequence = nullptr;
  int64_t num_new = 0;     // tokens computed this step: [num_computed, num_computed + num_new)
  bool samples = false;    // the chunk reaches the end of the known tokens: its last row yields a token
  // Speculative verify: rows after the known tokens holding the sequence's first num_drafts
  // draft_tokens (positions [num_tokens, num_tokens + num_drafts)); only on chunks that sample.
  int64_t num_drafts = 0;
  int64_t num_rows() const { return num_new + num_drafts; }
  // One known row that yields a token (and its drafts, if any): not a prefill chunk, not scoring.
  bool decodes() const { return num_new == 1 && samples && !sequence->request.return_prompt_logits; }
};

struct SchedulePlan {
  std::vector<ScheduledChunk> chunks;
  int64_t num_tokens = 0;           // rows, draft rows included
  int64_t num_draft_rows = 0;
  // A verify step runs in the ragged layout even when every sequence decodes (the speculation
  // controller's choice: per-sequence drafts, no padding rows), not in the fixed one.
  bool ragged_verify = false;
  std::vector<Sequence*> preempted;  // moved back to waiting this step (swapped out or to recompute)
  int64_t swapped_in = 0;            // preempted sequences brought back from the host tier this step
  // Admissions of this step: tokens looked up in the prefix cache, tokens found there, and hits
  // that restored a recurrent-state checkpoint.
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t state_restores = 0;
  bool empty() const { return chunks.empty(); }
};

// What a preemption weighs (Engine measures both; 0: not measured yet).
struct PreemptionCosts {
  double copy_bytes_per_second = 0.0;      // host <-> device copies
  double prefill_seconds_per_token = 0.0;  // recomputing a token in a prefill chunk
  // Swap (out and back in) when it is cheaper than recomputing `tokens`; true while unmeasured.
  bool prefers_swap(uint64_t swap_bytes, int64_t tokens) const;
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config) : config_(config) {}
  const SchedulerConfig& config() const { return config_; }

  // `running` and `waiting` are updated in place (admissions, preemptions). Blocks for every chunk
  // are reserved in `cache` before the plan is returned; admitted sequences start at the length of
  // their cached prefix (num_computed).
  SchedulePlan schedule(std::vector<Sequence*>& running, std::deque<Sequence*>& waiting, CacheManager& cache);

  // Prefill tokens (chunks of sequences with more than one token to compute) a step may carry when
  // some running sequence decodes in it; 0: no limit beyond the token budget. The engine sets it
  // before each step (engine/prefill_budget.h). Steps without decode rows are not limited.
  void set_prefill_limit(int64_t tokens) { prefill_limit_ = tokens; }
  void set_preemption_costs(const PreemptionCosts& costs) { costs_ = costs; }
  const PreemptionCosts& preemption_costs() const { return costs_; }

 private:
  // Swaps the victim out when the tier has room and that is the cheaper way back, else frees its
  // cache to recompute it later.
  void preempt(Sequence* sequence, CacheManager& cache) const;

  SchedulerConfig config_;
  int64_t prefill_limit_ = 0;
  PreemptionCosts costs_;
};

}  // namespace metrale
