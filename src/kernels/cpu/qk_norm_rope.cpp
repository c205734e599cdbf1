// The CPU twin of the fused attention prologue: the existing CPU ops, composed (fp32 arithmetic).
#include "kernels/qk_norm_rope.h"

#include <cstring>

#include "kernels/attention.h"
#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

// rms_norm over the heads of x [T, heads, D] in place. cpu::rms_norm needs rows that collapse into one
// even stride; slices of a fused projection do not, so those are normalised token by token.
void norm_heads_in_place(const Tensor& x, const Tensor& weight, const RmsNormParams& params) {
  if (x.size(0) <= 1 || x.stride(0) == x.stride(1) * x.size(1)) {
    cpu::rms_norm(x, weight, x, params);
    return;
  }
  for (int64_t t = 0; t < x.size(0); ++t) cpu::rms_norm(x.row(t), weight, x.row(t), params);
}

}  // namespace

void qk_norm_rope_kv_write(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_norm_weight,
                           const Tensor& k_norm_weight, const Tensor& positions, const Tensor& inv_freq,
                           const Tensor& slot_mapping, const Tensor& k_cache, const Tensor& v_cache,
                           const QkNormRopeParams& params) {
  METRALE_CHECK(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3, "qk_norm_rope_kv_write: q, k, v must be 3-D");
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  METRALE_CHECK(k.size(0) == tokens && v.size(0) == tokens && k.size(2) == head_dim && v.size(2) == head_dim &&
                    v.size(1) == k.size(1) && q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
                "qk_norm_rope_kv_write shapes q {} k {} v {}", q.describe(), k.describe(), v.describe());
  if (tokens == 0) return;
  if (params.q_norm) norm_heads_in_place(q, q_norm_weight, params.norm);
  cpu::rope(q, positions, inv_freq, params.rope);

  // k is an input: normalise and rotate a copy, then cache it.
  OwnedTensor rotated_k(k.dtype(), {tokens, k.size(1), head_dim});
  const size_t row_bytes = static_cast<size_t>(head_dim) * k.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < k.size(1); ++h) {
      const int64_t index[] = {t, h, 0};
      std::memcpy(rotated_k->element_ptr(index), k.element_ptr(index), row_bytes);
    }
  }
  if (params.k_norm) norm_heads_in_place(*rotated_k, k_norm_weight, params.norm);
  cpu::rope(*rotated_k, positions, inv_freq, params.rope);
  cpu::kv_cache_write(*rotated_k, v, slot_mapping, k_cache, v_cache, params.kv_scales);
}

}  // namespace metrale::kernels::cpu
