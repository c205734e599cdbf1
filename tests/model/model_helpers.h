// The double-precision reference forwards of the tiny checkpoints (tests/common/tiny_checkpoint.h),
// written from the spec (shared/arch/qwen.md §3, §5, §6): qwen3 and qwen3_moe here, the hybrids in
// hybrid_helpers.cpp, the math both use in reference_math_helpers.h. The model tests run the models
// through the mini-runner of tests/common/step_runner.h (floors 1-4 only, no CacheManager).
#pragma once

#include <cstdint>
#include <vector>

#include "common/step_runner.h"
#include "common/tiny_checkpoint.h"

namespace metrale::testing {

// Reference logits [T][V] of one sequence whose tokens sit at positions 0..T-1.
std::vector<std::vector<double>> reference_logits(const TinySpec& spec, const TinyWeights& weights,
                                                  const std::vector<int32_t>& tokens);
std::vector<std::vector<double>> hybrid_reference_logits(const TinySpec& spec, const TinyWeights& weights,
                                                         const std::vector<int32_t>& tokens);

}  // namespace metrale::testing
