#include "kernels/embedding.h"

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {

namespace {

// out[t] = table[ids[t] - first_id] where that row exists, else zeros.
void lookup_rows(const Tensor& ids, const Tensor& table, int64_t first_id, const Tensor& out) {
  const int64_t count = ids.numel();
  const int64_t rows = table.size(0);
  const int64_t hidden = table.size(1);
  METRALE_CHECK(out.size(0) == count && out.size(1) == hidden, "embedding out {}", out.describe());
  const auto* id_data = ids.data_as<const int32_t>();
  cpu_pool().parallel_for(count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = id_data[t] - first_id;
      void* dst = row_ptr_mut(out, t);
      if (row < 0 || row >= rows) {
        std::memset(dst, 0, static_cast<size_t>(hidden) * out.element_size());  // zero bits: 0.0 in every float dtype
        continue;
      }
      const void* src = row_ptr(table, row);
      if (table.dtype() == out.dtype()) {
        std::memcpy(dst, src, static_cast<size_t>(hidden) * table.element_size());
      } else {
        float* values = scratch_a(hidden);
        convert_to_f32(table.dtype(), src, values, static_cast<size_t>(hidden));
        store_f32(out.dtype(), values, dst, hidden);
      }
    }
  });
}

}  // namespace

void embedding(const Tensor& ids, const Tensor& table, const Tensor& out) {
  const int64_t vocab = table.size(0);
  const auto* id_data = ids.data_as<const int32_t>();
  for (int64_t t = 0; t < ids.numel(); ++t) {
    if (id_data[t] < 0 || id_data[t] >= vocab) {
      raise(ErrorCode::kInvalidArgument, "token id {} is outside the vocabulary [0, {})", id_data[t], vocab);
    }
  }
  lookup_rows(ids, table, 0, out);
}

void embedding_shard(const Tensor& ids, const Tensor& table, int64_t first_id, const Tensor& out) {
  lookup_rows(ids, table, first_id, out);
}

}  // namespace metrale::kernels::cpu
