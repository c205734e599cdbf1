#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {

RowView as_rows(const Tensor& t, const char* what) {
  METRALE_CHECK(t.ndim() >= 1, "{}: scalar tensor", what);
  METRALE_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, "{}: last dim must be contiguous ({})", what, t.describe());
  RowView view;
  view.width = t.size(-1);
  view.rows = t.numel() / std::max<int64_t>(1, view.width);
  if (t.ndim() == 1) {
    view.row_stride = view.width;
    return view;
  }
  // Leading dims must collapse into one evenly strided row index.
  view.row_stride = t.stride(-2);
  int64_t expected = t.stride(-2) * t.size(-2);
  for (int d = t.ndim() - 3; d >= 0; --d) {
    METRALE_CHECK(t.size(d) == 1 || t.stride(d) == expected, "{}: rows not evenly strided ({})", what, t.describe());
    expected *= t.size(d);
  }
  return view;
}

}  // namespace metrale::kernels::cpu
