#include "kernels/gated_delta_rule.h"

#if !METRALE_WITH_CUDA
namespace metrale::kernels {

// Builds without CUDA run the delta rule on the CPU only, which needs no scratch. (CUDA builds define
// this next to the kernels.)
size_t gated_delta_rule_workspace_bytes(Device /*device*/, int64_t /*num_tokens*/, int64_t /*num_seqs*/,
                                        int64_t /*num_v_heads*/, int64_t /*key_head_dim*/,
                                        int64_t /*value_head_dim*/) {
  return 0;
}

}  // namespace metrale::kernels
#endif
