// The double-precision reference forward of the tiny qwen4_exp checkpoints
// (tests/common/tiny_qwen4_checkpoint.h), written from shared/arch/qwen.md §5.5 and §7 (hyper-connections,
// PLE, QSA), §6 (Gated DeltaNet, token by token), §3.6 (MoE with shared expert): one sequence at
// positions 0..T-1, activations in doubles. Until transformers goldens exist this is what the CPU
// forward is checked against.
#pragma once

#include <cstdint>
#include <vector>

#include "common/tiny_qwen4_checkpoint.h"

namespace metrale::testing {

std::vector<std::vector<double>> qwen4_reference_logits(const Qwen4Spec& spec, const Qwen4Weights& weights,
                                                        const std::vector<int32_t>& tokens);
// The PLE table row ids [T][NH] of PLE layer `ple_index` for one sequence from position 0 (§7.2 c-d).
std::vector<std::vector<int64_t>> qwen4_reference_ple_ids(const Qwen4Spec& spec, int64_t ple_index,
                                                          const std::vector<int32_t>& tokens);
// The QSA selection of query position p (qwen.md §7.3 step 7) from its block scores: the selected
// block indices, ascending (ties toward the lower index).
std::vector<int64_t> qwen4_reference_select(const std::vector<double>& scores, int64_t block_topk);

}  // namespace metrale::testing
