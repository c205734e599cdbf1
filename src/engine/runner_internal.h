// Runner internals shared by runner.cpp (plain steps, decode graphs) and runner_speculative.cpp
// (verify, commit and MTP steps and their graphs).
#pragma once

#include <cstdint>
#include <map>
#include <span>

#include "engine/runner.h"
#include "runtime/buffer.h"
#if METRALE_WITH_CUDA
#include "runtime/cuda/cuda_graph.h"
#endif

namespace metrale {

// Host arrays of one step, each sized for the limits (pinned when a GPU is used).
struct Runner::HostStep {
  PinnedBuffer token_ids, positions, cu_q, kv_lens, block_tables, slot_mapping, logit_rows, state_slots;
  int64_t num_tokens = 0, num_seqs = 0, num_rows = 0;
  int64_t block_stride = 0;  // columns of the block table
  int64_t max_q_len = 0, max_kv_len = 0;
  bool has_state_slots = false;  // the model has recurrent layers

  static int32_t* ints(const PinnedBuffer& buffer) { return static_cast<int32_t*>(buffer.data()); }
};

struct Runner::Graph {
#if METRALE_WITH_CUDA
  CudaGraph graph;
#endif
  int64_t batch_size = 0;
};

// The fixed-layout commit's own stream (CUDA): it runs beside the MTP chain, which reads none of
// what it writes (recurrent state slots) and writes none of what it reads (verify scratch, its own
// workspace); the model's stream waits for `done` before anything else runs after the chain.
struct Runner::CommitStream {
#if METRALE_WITH_CUDA
  CudaStream stream;
  CudaEvent inputs_ready{false}, done{false};
#endif
};

// The graphs of one fixed verify shape (padded sequences S, drafts k): the verify forward with its
// greedy sampling, the commit of the kept rows, and (MTP) the catch-up plus n - 1 chained drafts for
// each captured draft count n.
struct Runner::VerifyGraphs {
#if METRALE_WITH_CUDA
  CudaGraph verify, commit;
  std::map<int64_t, CudaGraph> mtp;  // by the number of drafts the chain makes
#endif
};

inline int64_t max_blocks_per_seq(const RunnerLimits& limits) {
  return (limits.max_model_len + limits.block_size - 1) / limits.block_size;
}

// The paged-cache slot (block * block_size + offset) of `position` in a sequence's block table.
inline int32_t cache_slot_of(std::span<const int32_t> table, int64_t position, int64_t block_size) {
  return table[static_cast<size_t>(position / block_size)] * static_cast<int32_t>(block_size) +
         static_cast<int32_t>(position % block_size);
}

}  // namespace metrale
