// The CPU twin of the token-bitmask kernel (kernels/token_bitmask.h): the reference the CUDA kernel
// is tested against, and the masking of the engine's host sampling path.
#include "kernels/token_bitmask.h"

#include <algorithm>
#include <bit>
#include <limits>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {

void apply_token_bitmask_row(std::span<float> logits, std::span<const uint32_t> bitmask) {
  const size_t vocab = logits.size();
  METRALE_CHECK(bitmask.size() * 32 >= vocab, "apply_token_bitmask: {} mask words for {} logits", bitmask.size(),
                vocab);
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  constexpr uint32_t kMaskedBits = std::bit_cast<uint32_t>(kMasked);
  // A constrained row is mostly words with every token out (plain fills) or every token in (skipped).
  for (size_t word = 0; word * 32 < vocab; ++word) {
    const uint32_t bits = bitmask[word];
    if (bits == ~0u) continue;
    const size_t begin = word * 32;
    const size_t end = std::min(vocab, begin + 32);
    if (bits == 0u) {
      std::fill(logits.begin() + static_cast<std::ptrdiff_t>(begin), logits.begin() + static_cast<std::ptrdiff_t>(end),
                kMasked);
      continue;
    }
    // Branch-free select on the bit patterns, so that the loop vectorises.
    for (size_t t = begin; t < end; ++t) {
      const uint32_t keep = 0u - ((bits >> (t - begin)) & 1u);
      const uint32_t value = std::bit_cast<uint32_t>(logits[t]);
      logits[t] = std::bit_cast<float>((value & keep) | (kMaskedBits & ~keep));
    }
  }
}

void apply_token_bitmask(const Tensor& logits, const Tensor& bitmask, const Tensor& rows) {
  METRALE_CHECK(logits.device().is_cpu() && bitmask.device().is_cpu() && rows.device().is_cpu(),
                "apply_token_bitmask: tensors must be on the CPU");
  METRALE_CHECK(logits.dtype() == DType::kF32 && logits.ndim() == 2 && logits.stride(1) == 1 &&
                    logits.stride(0) >= logits.size(1),
                "apply_token_bitmask: logits must be [R, V] f32 with a contiguous last dim, got {}", logits.describe());
  METRALE_CHECK(bitmask.dtype() == DType::kI32 && bitmask.ndim() == 2 && bitmask.is_contiguous(),
                "apply_token_bitmask: bitmask must be [K, W] i32 and contiguous, got {}", bitmask.describe());
  METRALE_CHECK(rows.dtype() == DType::kI32 && rows.ndim() == 1 && rows.size(0) == bitmask.size(0),
                "apply_token_bitmask: rows must be [K] i32 for a bitmask {}, got {}", bitmask.describe(),
                rows.describe());
  const int64_t num_rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  METRALE_CHECK(words * 32 >= vocab, "apply_token_bitmask: {} mask words for {} logits", words, vocab);
  const auto* row_ids = rows.data_as<const int32_t>();
  const auto* masks = bitmask.data_as<const uint32_t>();
  for (int64_t k = 0; k < rows.size(0); ++k) {
    const int64_t row = row_ids[k];
    if (row < 0) continue;
    if (row >= num_rows) {
      raise(ErrorCode::kInvalidArgument, "apply_token_bitmask: mask {} names row {} of {} logits rows", k, row,
            num_rows);
    }
    apply_token_bitmask_row(std::span<float>(static_cast<float*>(row_ptr_mut(logits, row)), static_cast<size_t>(vocab)),
                            std::span<const uint32_t>(masks + k * words, static_cast<size_t>(words)));
  }
}

}  // namespace metrale::kernels::cpu
