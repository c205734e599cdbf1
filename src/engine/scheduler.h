// Scheduler: decides what each step computes. There are no prefill and decode phases: every
// sequence has tokens (prompt + generated) and num_computed of them are cached; a step gives each
// scheduled sequence a chunk of its uncomputed tokens, under one token budget shared by decode rows
// and prefill chunks (vLLM v1's rule). Running sequences come first, oldest first; waiting ones are
// admitted FCFS while the budget, --max-num-seqs and free KV blocks allow. When a running sequence
// cannot get a block, the newest running sequence is preempted (its blocks freed, its tokens kept,
// recomputed later); nothing it generated is lost or repeated.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "cache/cache_manager.h"
#include "engine/request.h"

namespace metrale {

struct SchedulerConfig {
  int32_t max_num_seqs = 64;              // running sequences at most
  int32_t max_num_batched_tokens = 2048;  // tokens per step at most
  int32_t max_prefill_chunk = 0;          // tokens per sequence per step at most (0: no limit)
};

struct ScheduledChunk {
  Sequence* sequence = nullptr;
  int64_t num_new = 0;     // tokens computed this step: [num_computed, num_computed + num_new)
  bool samples = false;    // the chunk reaches the end of the known tokens: its last row yields a token
};

struct SchedulePlan {
  std::vector<ScheduledChunk> chunks;
  int64_t num_tokens = 0;
  std::vector<Sequence*> preempted;  // moved back to waiting this step
  bool empty() const { return chunks.empty(); }
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& config) : config_(config) {}
  const SchedulerConfig& config() const { return config_; }

  // `running` and `waiting` are updated in place (admissions, preemptions). Blocks for every chunk
  // are reserved in `cache` before the plan is returned.
  SchedulePlan schedule(std::vector<Sequence*>& running, std::deque<Sequence*>& waiting, CacheManager& cache);

 private:
  SchedulerConfig config_;
};

}  // namespace metrale
