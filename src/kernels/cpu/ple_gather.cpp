// CPU PLE row gather: the worker pool copies table rows into the output (a pinned staging buffer
// in the staged feeding path), so that page faults of a memory-mapped table overlap.
#include "kernels/ple_gather.h"

#include <cstring>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {

void ple_gather(const Tensor& table, const Tensor& ids, const Tensor& out) {
  METRALE_CHECK(table.ndim() == 2 && table.is_contiguous() && ids.ndim() == 2 && ids.dtype() == DType::kI64 &&
                    ids.is_contiguous() && out.ndim() == 2 && out.stride(1) == 1,
                "ple_gather: table {} ids {} out {}", table.describe(), ids.describe(), out.describe());
  const int64_t rows = table.size(0), width = table.size(1), tokens = ids.size(0), heads = ids.size(1);
  METRALE_CHECK(out.size(0) == tokens && out.size(1) == heads * width, "ple_gather: out {} for ids {} of width {}",
                out.describe(), ids.describe(), width);
  const auto* id = ids.data_as<const int64_t>();
  for (int64_t i = 0; i < tokens * heads; ++i) {
    if (id[i] < 0 || id[i] >= rows) {
      raise(ErrorCode::kInvalidArgument, "ple_gather: row id {} is outside the table's {} rows", id[i], rows);
    }
  }
  const size_t row_bytes = static_cast<size_t>(width) * table.element_size();
  const bool same = table.dtype() == out.dtype();
  // Items are (token, head) rows; a range of 32 rows amortises the pool's dispatch.
  cpu_pool().parallel_for(tokens * heads, 32, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads;
      const char* src = static_cast<const char*>(table.data()) + id[item] * static_cast<int64_t>(row_bytes);
      char* dst = static_cast<char*>(row_ptr_mut(out, t)) + h * width * static_cast<int64_t>(out.element_size());
      if (same) {
        std::memcpy(dst, src, row_bytes);
      } else {
        float* row = scratch_a(width);
        convert_to_f32(table.dtype(), src, row, static_cast<size_t>(width));
        store_f32(out.dtype(), row, dst, width);
      }
    }
  });
}

}  // namespace metrale::kernels::cpu
