// PLE lookup (qwen.md §7.2 e): E[t] = concat_h table[ids[t, h]] for the NH heads of a token, from a
// table of R_pad rows of d_head = ple_embed_dim / NH values (16 heads x 160 bf16 = 5120 bytes per
// token for the released model; its table is ~3.2e8 rows, ~100 GB).
//
// Two ways to feed a step, both gathering only the rows the step needs:
//  * staged (CPU op): the host computes the ids (cpu::ple_ngram_ids in the prestage hook) and copies
//    the rows of a memory-mapped table into a pinned staging buffer with the worker pool; the model
//    then copies the buffer to the device (5 KB per token per PLE layer) on a side stream, overlapped
//    with the layers before the first PLE layer. Works when the table does not fit in host RAM (page
//    faults from disk hit the worker threads, not the GPU) but needs the step's tokens on the host.
//  * zero-copy (CUDA op): the kernel reads the rows straight from host memory the device can
//    address (a table registered with cudaHostRegister, or allocated pinned), or from a device
//    tensor (a table that fits in GPU memory). Ids computed on the device, no host round trip:
//    the decode step stays a CUDA-graph replay. Each row is one 320-byte read over the host link;
//    at batch 128 that is 655 KB per PLE layer, tens of microseconds over PCIe 5, and it can run on a
//    forked stream while the earlier layers compute. Needs the whole table resident and pinned.
#pragma once

#include "kernels/dispatch.h"

namespace metrale::kernels {

// table [rows, d_head] f32|bf16|f16 (contiguous); ids [T, NH] i64 contiguous, on out's device;
// out [T, NH * d_head] (rows may be strided, the last dim contiguous): out[t, h*d_head:(h+1)*d_head] =
// table[ids[t, h]], converted to out's dtype (a plain copy when the dtypes match).
// CPU: table, ids and out in host memory; an id outside [0, rows) raises kInvalidArgument.
// CUDA: out and ids on the GPU; table either on the GPU or in host memory the GPU can read (pinned
// or registered, through unified addressing). A kernel cannot throw: an id outside [0, rows) gets a
// row of zeros.
METRALE_DECLARE_OP_IMPLS(ple_gather, (const Tensor& table, const Tensor& ids, const Tensor& out))

inline void ple_gather(const Tensor& table, const Tensor& ids, const Tensor& out) {
  METRALE_KERNEL_DISPATCH(ple_gather, out.device(), table, ids, out);
}

}  // namespace metrale::kernels
