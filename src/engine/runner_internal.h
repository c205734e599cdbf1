// Runner internals shared by runner.cpp (plain steps, decode graphs) and runner_speculative.cpp
// (verify, commit and MTP steps and their graphs).
#pragma once

#include <cstdint>
#include <map>

#include "core/checked_math.h"
#include "engine/runner.h"
#include "runtime/buffer.h"
#if METRALE_WITH_CUDA
#include "runtime/cuda/cuda_graph.h"
#endif

namespace metrale {

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
  return checked_ceil_div<int64_t>(limits.max_model_len, limits.block_size, "blocks per sequence");
}

}  // namespace metrale
