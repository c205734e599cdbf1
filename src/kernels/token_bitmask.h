// Token bitmasks applied to logits (constrained decoding): logits[t] = -inf wherever the mask's bit
// for token t is clear, so that sampling can only pick allowed tokens.
//
// A mask is ceil(V / 32) uint32 words per row, bit t % 32 of word t / 32 set when token t is allowed
// (the layout of engine/token_constraint.h, and of xgrammar's bitmasks). Bits past V are ignored.
// Only the rows that have a mask are listed, so a step without constrained rows launches nothing and
// a batch with a few constrained rows touches only theirs.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/dispatch.h"

namespace metrale::kernels {

// logits [R, V] f32 (row stride >= V, last dim contiguous), modified in place; bitmask [K, W] i32
// (the bits of the uint32 words, rows contiguous, W >= ceil(V / 32)); rows [K] i32: mask k applies
// to logits row rows[k]. A negative entry skips its mask (padding); listed rows should be distinct
// (two masks of one row both apply). Logits of allowed tokens are left bit for bit; a mask that
// allows no token makes its row all -inf (callers that want "no allowed token: leave the row" check
// with token_bitmask_allows_any first, as the engine does).
// CPU: rows[k] >= R is kInvalidArgument. CUDA: such an entry is skipped (it cannot be reported);
// one thread per 4 tokens, grid [ceil(V / 1024), K], no workspace, graph-safe.
METRALE_DECLARE_OP_IMPLS(apply_token_bitmask, (const Tensor& logits, const Tensor& bitmask, const Tensor& rows))

inline void apply_token_bitmask(const Tensor& logits, const Tensor& bitmask, const Tensor& rows) {
  METRALE_KERNEL_DISPATCH(apply_token_bitmask, logits.device(), logits, bitmask, rows);
}

namespace cpu {
// The CPU twin for one row, on host memory: logits [V], bitmask >= ceil(V / 32) words. The engine's
// host sampling path masks its rows with this function.
void apply_token_bitmask_row(std::span<float> logits, std::span<const uint32_t> bitmask);
}  // namespace cpu

// Whether `bitmask` allows any of the tokens [0, vocab) (host memory).
inline bool token_bitmask_allows_any(std::span<const uint32_t> bitmask, int64_t vocab) {
  for (int64_t word = 0; word * 32 < vocab && static_cast<size_t>(word) < bitmask.size(); ++word) {
    const int64_t bits = vocab - word * 32;
    const uint32_t valid = bits >= 32 ? ~0u : ((1u << bits) - 1u);
    if ((bitmask[static_cast<size_t>(word)] & valid) != 0) return true;
  }
  return false;
}

}  // namespace metrale::kernels
