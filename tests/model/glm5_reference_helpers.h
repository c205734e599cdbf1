// An independent double-precision evaluation of glm5_next (glm_deepseek.md §2) on the tiny
// checkpoints of tests/common/tiny_glm5_checkpoint.h, written from the formulas: one sequence at
// positions 0..T-1, every token's quantities computed directly (the KDA recurrence token by token,
// every DSA pool key and score from scratch, the MoE router and mHC maps per token). Ties in the
// indexer's top-k go to the lower pool index, as the engine breaks them (§2.6.5).
#pragma once

#include <cstdint>
#include <vector>

#include "common/tiny_glm5_checkpoint.h"

namespace metrale::testing {

struct Glm5Reference {
  std::vector<std::vector<double>> logits;  // [T][V]
  std::vector<std::vector<double>> hidden;  // [T][D]: norm(mean_j X_j), the MTP head's h_t
  int64_t sparse_rows = 0;                  // rows of the first DSA layer whose attended set is a strict subset
};
Glm5Reference glm5_reference(const TinyGlm5Spec& spec, const TinyWeights& weights, const std::vector<int32_t>& tokens);

// The MTP head (layer num_layers, §2.10) over rows t = 0..R-1: token x_{t+1} = next[t] and the
// trunk's hidden[t]; its own DSA attends over its rows 0..t. Returns the draft logits [R][V].
std::vector<std::vector<double>> glm5_mtp_reference(const TinyGlm5Spec& spec, const TinyWeights& weights,
                                                    const std::vector<int32_t>& next,
                                                    const std::vector<std::vector<double>>& hidden);

}  // namespace metrale::testing
