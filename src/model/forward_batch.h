// ForwardBatch: one step's ragged batch as the model sees it. S sequences; sequence s adds
// q_len_s = cu_q[s+1] - cu_q[s] tokens at positions [kv_lens[s] - q_len_s, kv_lens[s]).
// Decode, prefill, chunked prefill and mixed steps are all this one shape.
#pragma once

#include <cstdint>
#include <span>

#include "runtime/tensor.h"

namespace metrale {

struct ForwardBatch {
  int64_t num_tokens = 0;  // T
  int64_t num_seqs = 0;    // S
  int64_t block_size = 0;  // tokens per KV block
  // Upper bounds over the batch (exact for eager steps; CUDA graphs capture with the bounds of
  // the graph's shape), for kernels that plan on the host.
  int64_t max_q_len = 0;
  int64_t max_kv_len = 0;

  // On the model's device:
  Tensor token_ids;     // [T] i32
  Tensor positions;     // [T] i32
  Tensor cu_q;          // [S+1] i32, cu_q[0] = 0, cu_q[S] = T
  Tensor kv_lens;       // [S] i32, tokens in the cache after this step's write
  Tensor block_tables;  // [S, max_blocks] i32
  Tensor slot_mapping;  // [T] i32, cache slot of each new token (block * block_size + offset)
  Tensor logit_rows;    // [R] i32, rows of the batch whose logits the step returns
  // Recurrent layers: the state slot of each sequence ([S] i32; empty when the model has no
  // recurrent layer). A sequence whose cached length is 0 (kv_lens[s] == q_len_s) starts from zero
  // state whatever its slot holds; every forward leaves the state after the sequence's last row of
  // this step in its slot.
  Tensor state_slots;

  // Host copies of the same metadata, for planning and CPU kernels.
  std::span<const int32_t> host_cu_q;
  std::span<const int32_t> host_kv_lens;
  std::span<const int32_t> host_logit_rows;
  std::span<const int32_t> host_state_slots;

  bool all_decode() const { return num_tokens == num_seqs; }  // every sequence adds exactly one token
};

}  // namespace metrale
