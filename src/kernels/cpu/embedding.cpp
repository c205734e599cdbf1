#include "kernels/embedding.h"

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {

void embedding(const Tensor& ids, const Tensor& table, const Tensor& out) {
  const int64_t count = ids.numel();
  const int64_t vocab = table.size(0);
  const int64_t hidden = table.size(1);
  METRALE_CHECK(out.size(0) == count && out.size(1) == hidden, "embedding out {}", out.describe());
  const auto* id_data = ids.data_as<const int32_t>();
  for (int64_t t = 0; t < count; ++t) {
    if (id_data[t] < 0 || id_data[t] >= vocab) {
      raise(ErrorCode::kInvalidArgument, "token id {} is outside the vocabulary [0, {})", id_data[t], vocab);
    }
  }
  cpu_pool().parallel_for(count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const void* src = row_ptr(table, id_data[t]);
      void* dst = row_ptr_mut(out, t);
      if (table.dtype() == out.dtype()) {
        std::memcpy(dst, src, static_cast<size_t>(hidden) * table.element_size());
      } else {
        float* row = scratch_a(hidden);
        convert_to_f32(table.dtype(), src, row, static_cast<size_t>(hidden));
        store_f32(out.dtype(), row, dst, hidden);
      }
    }
  });
}

}  // namespace metrale::kernels::cpu
