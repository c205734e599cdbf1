// Embedding gather: out[t] = table[ids[t]].
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// ids [T] i32; table [V, H] f32|bf16|f16; out [T, H] f32|bf16. Throws kInvalidArgument for an id
// outside [0, V).
// CUDA: the same (out rows may be strided); a kernel cannot throw, so an id outside [0, V) gets a row of
// zeros. The engine validates token ids before they reach the GPU (Engine::add_request).
METRALE_DECLARE_OP_IMPLS(embedding, (const Tensor& ids, const Tensor& table, const Tensor& out))
// A tensor-parallel rank's rows of the vocabulary: `table` [rows, H] holds the ids [first_id,
// first_id + rows); out[t] = table[ids[t] - first_id] for those ids and zeros for every other id (the
// ranks' outputs sum to the whole lookup). Both devices; no id is an error here.
METRALE_DECLARE_OP_IMPLS(embedding_shard, (const Tensor& ids, const Tensor& table, int64_t first_id, const Tensor& out))

inline void embedding(const Tensor& ids, const Tensor& table, const Tensor& out) {
  METRALE_KERNEL_DISPATCH(embedding, out.device(), ids, table, out);
}
inline void embedding_shard(const Tensor& ids, const Tensor& table, int64_t first_id, const Tensor& out) {
  METRALE_KERNEL_DISPATCH(embedding_shard, out.device(), ids, table, first_id, out);
}

}  // namespace metrale::kernels
