// Embedding gather: out[t] = table[ids[t]].
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// ids [T] i32; table [V, H] f32|bf16|f16; out [T, H] f32|bf16. Throws kInvalidArgument for an id
// outside [0, V).
// CUDA: the same (out rows may be strided); a kernel cannot throw, so an id outside [0, V) gets a row of
// zeros. The engine validates token ids before they reach the GPU (Engine::add_request).
METRALE_DECLARE_OP_IMPLS(embedding, (const Tensor& ids, const Tensor& table, const Tensor& out))

inline void embedding(const Tensor& ids, const Tensor& table, const Tensor& out) {
  METRALE_KERNEL_DISPATCH(embedding, out.device(), ids, table, out);
}

}  // namespace metrale::kernels
