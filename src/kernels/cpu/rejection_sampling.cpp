// The CPU twin of the rejection-sampling kernel (kernels/rejection_sampling.h): the same decision,
// row by row, with the residual summed in 128-bit fixed point in id order.
#include "kernels/rejection_sampling.h"

#include <span>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

using sampling_detail::Fixed128;

void check_row_tensor(const Tensor& t, DType dtype, int64_t rows, const char* what) {
  METRALE_CHECK(t.device().is_cpu() && t.ndim() == 1 && t.dtype() == dtype && t.numel() == rows &&
                    (rows <= 1 || t.stride(0) == 1),
                "rejection_sample_rows {}: {} for {} rows", what, t.describe(), rows);
}

void check_probs(const Tensor& t, const char* what) {
  METRALE_CHECK(
      t.device().is_cpu() && t.ndim() == 2 && t.dtype() == DType::kF32 && t.stride(1) == 1 && t.stride(0) >= t.size(1),
      "rejection_sample_rows {}: {}", what, t.describe());
}

// One row: p [V], q [V] (empty: one-hot at `draft`).
void sample_row(std::span<const float> p, std::span<const float> q, int32_t draft, float accept_uniform,
                float residual_uniform, int64_t row, int32_t& token, int32_t& accepted) {
  using namespace rejection_detail;
  const auto vocab = static_cast<int64_t>(p.size());
  if (draft < 0 || draft >= vocab) {
    raise(ErrorCode::kInternal, "rejection_sample_rows row {}: draft {} outside the vocabulary of {}", row, draft,
          vocab);
  }
  const auto d = static_cast<size_t>(draft);
  const float q_draft = q.empty() ? 1.0f : q[d];
  if (accepts(accept_uniform, q_draft, p[d])) {
    token = draft;
    accepted = 1;
    return;
  }
  const auto residual = [&](size_t i) {
    const float qi = q.empty() ? (i == d ? 1.0f : 0.0f) : q[i];
    return residual_fixed(p[i], qi);
  };
  Fixed128 mass = 0;
  for (size_t i = 0; i < p.size(); ++i) mass += residual(i);
  if (mass == 0) {
    // p <= q everywhere: p == q up to rounding, and the draft stands.
    token = draft;
    accepted = 1;
    return;
  }
  const Fixed128 target = sampling_detail::draw_target(residual_uniform, mass);
  Fixed128 running = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    running += residual(i);
    if (running >= target) {
      token = static_cast<int32_t>(i);
      accepted = 0;
      return;
    }
  }
  raise(ErrorCode::kInternal, "rejection_sample_rows row {}: no token reaches the residual's target mass", row);
}

}  // namespace

void rejection_sample_rows(const RejectionRows& rows, const Tensor& tokens, const Tensor& accepted) {
  check_probs(rows.target, "target");
  const int64_t count = rows.target.size(0), vocab = rows.target.size(1);
  METRALE_CHECK(vocab >= 1 && vocab < (int64_t{1} << 27), "rejection_sample_rows: vocabulary of {}", vocab);
  const bool one_hot = rows.draft_probs.empty();
  if (!one_hot) {
    check_probs(rows.draft_probs, "draft_probs");
    METRALE_CHECK(rows.draft_probs.size(0) == count && rows.draft_probs.size(1) == vocab,
                  "rejection_sample_rows: draft_probs {} for target {}", rows.draft_probs.describe(),
                  rows.target.describe());
  }
  check_row_tensor(rows.drafts, DType::kI32, count, "drafts");
  check_row_tensor(rows.accept_uniform, DType::kF32, count, "accept_uniform");
  check_row_tensor(rows.residual_uniform, DType::kF32, count, "residual_uniform");
  check_row_tensor(tokens, DType::kI32, count, "tokens");
  check_row_tensor(accepted, DType::kI32, count, "accepted");
  for (int64_t r = 0; r < count; ++r) {
    const std::span<const float> p(rows.target.data_as<const float>() + r * rows.target.stride(0),
                                   static_cast<size_t>(vocab));
    std::span<const float> q;
    if (!one_hot) {
      q = std::span<const float>(rows.draft_probs.data_as<const float>() + r * rows.draft_probs.stride(0),
                                 static_cast<size_t>(vocab));
    }
    sample_row(p, q, rows.drafts.data_as<const int32_t>()[r], rows.accept_uniform.data_as<const float>()[r],
               rows.residual_uniform.data_as<const float>()[r], r, tokens.data_as<int32_t>()[r],
               accepted.data_as<int32_t>()[r]);
  }
}

}  // namespace metrale::kernels::cpu
