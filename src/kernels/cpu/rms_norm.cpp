#include "kernels/rms_norm.h"

#include <cmath>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace {

void normalize_row(const float* x, const float* weight, float* out, int64_t width, const RmsNormParams& params) {
  double sum_squares = 0.0;  // fp64 sum: the CPU path is the reference, keep its rounding small
  for (int64_t i = 0; i < width; ++i) sum_squares += static_cast<double>(x[i]) * x[i];
  const float mean = static_cast<float>(sum_squares / static_cast<double>(width));
  const float inv = 1.0f / std::sqrt(mean + params.eps);
  const float offset = params.kind == RmsNormKind::kZeroCentered ? 1.0f : 0.0f;
  for (int64_t i = 0; i < width; ++i) out[i] = x[i] * inv * (offset + weight[i]);
}

}  // namespace

void rms_norm(const Tensor& x, const Tensor& weight, const Tensor& out, const RmsNormParams& params) {
  const RowView in_rows = as_rows(x, "rms_norm x");
  const RowView out_rows = as_rows(out, "rms_norm out");
  METRALE_CHECK(in_rows.rows == out_rows.rows && in_rows.width == out_rows.width && weight.numel() == in_rows.width,
                "rms_norm shapes {} {} {}", x.describe(), weight.describe(), out.describe());
  std::vector<float> w(static_cast<size_t>(in_rows.width));
  convert_to_f32(weight.dtype(), weight.data(), w.data(), w.size());
  const size_t xs = x.element_size(), os = out.element_size();
  cpu_pool().parallel_for(in_rows.rows, 8, [&](int64_t begin, int64_t end) {
    float* row = scratch_a(in_rows.width);
    float* result = scratch_b(in_rows.width);
    for (int64_t r = begin; r < end; ++r) {
      const void* src = static_cast<const char*>(x.data()) + r * in_rows.row_stride * static_cast<int64_t>(xs);
      void* dst = static_cast<char*>(out.data()) + r * out_rows.row_stride * static_cast<int64_t>(os);
      const float* values = as_f32(x.dtype(), src, row, in_rows.width);
      normalize_row(values, w.data(), result, in_rows.width, params);
      store_f32(out.dtype(), result, dst, in_rows.width);
    }
  });
}

void add_rms_norm(const Tensor& residual, const Tensor& x, const Tensor& weight, const Tensor& out,
                  const RmsNormParams& params) {
  const RowView res_rows = as_rows(residual, "add_rms_norm residual");
  const RowView in_rows = as_rows(x, "add_rms_norm x");
  const RowView out_rows = as_rows(out, "add_rms_norm out");
  METRALE_CHECK(res_rows.rows == in_rows.rows && res_rows.rows == out_rows.rows && res_rows.width == in_rows.width &&
                    res_rows.width == out_rows.width && weight.numel() == res_rows.width,
                "add_rms_norm shapes");
  METRALE_CHECK(residual.dtype() == DType::kF32, "add_rms_norm: CPU residual stream is f32");
  std::vector<float> w(static_cast<size_t>(res_rows.width));
  convert_to_f32(weight.dtype(), weight.data(), w.data(), w.size());
  const int64_t width = res_rows.width;
  cpu_pool().parallel_for(res_rows.rows, 8, [&](int64_t begin, int64_t end) {
    float* row = scratch_a(width);
    float* result = scratch_b(width);
    for (int64_t r = begin; r < end; ++r) {
      float* res = static_cast<float*>(residual.data()) + r * res_rows.row_stride;
      const void* src = static_cast<const char*>(x.data()) + r * in_rows.row_stride * static_cast<int64_t>(x.element_size());
      const float* values = as_f32(x.dtype(), src, row, width);
      for (int64_t i = 0; i < width; ++i) res[i] += values[i];
      normalize_row(res, w.data(), result, width, params);
      void* dst = static_cast<char*>(out.data()) + r * out_rows.row_stride * static_cast<int64_t>(out.element_size());
      store_f32(out.dtype(), result, dst, width);
    }
  });
}

}  // namespace metrale::kernels::cpu
