// The row-block GEMM shared by the CPU linear ops: out [M, N] = x [M, K] @ W^T with W's rows
// produced in fp32 by a loader, kRowBlock rows at a time, and fp32 accumulation.
#pragma once

#include <algorithm>
#include <vector>

#include "kernels/cpu/common.h"

namespace metrale::kernels::cpu {
namespace linear_rows_detail {

constexpr int64_t kRowBlock = 8;  // weight rows converted to fp32 and reused across all input rows


// Four dot products against one input row at once: the input is loaded once per 16 lanes.
inline void dot4(const float* x, const float* w0, const float* w1, const float* w2, const float* w3, int64_t n,
                 float* out) {
  float a0[8] = {}, a1[8] = {}, a2[8] = {}, a3[8] = {};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int j = 0; j < 8; ++j) {
      const float xv = x[k + j];
      a0[j] += xv * w0[k + j];
      a1[j] += xv * w1[k + j];
      a2[j] += xv * w2[k + j];
      a3[j] += xv * w3[k + j];
    }
  }
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int j = 0; j < 8; ++j) {
    s0 += a0[j];
    s1 += a1[j];
    s2 += a2[j];
    s3 += a3[j];
  }
  for (; k < n; ++k) {
    s0 += x[k] * w0[k];
    s1 += x[k] * w1[k];
    s2 += x[k] * w2[k];
    s3 += x[k] * w3[k];
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

}  // namespace linear_rows_detail

// load_rows(n0, rows, scratch) returns `rows` weight rows from row n0 as fp32 [rows, k]: a pointer
// into the weight itself, or into `scratch` (room for kRowBlock * k floats) after converting them.
template <typename LoadRows>
void linear_rows(const Tensor& x, const Tensor& out, int64_t n, bool accumulate, LoadRows&& load_rows) {
  using linear_rows_detail::dot4;
  using linear_rows_detail::kRowBlock;
  const int64_t m = x.size(0), k = x.size(1);
  // Inputs in fp32, converted once for the whole call.
  std::vector<float> x_converted;
  const float* x_f32;
  int64_t x_stride;
  if (x.dtype() == DType::kF32) {
    x_f32 = x.data_as<const float>();
    x_stride = x.stride(0);
  } else {
    x_converted.resize(static_cast<size_t>(m * k));
    for (int64_t r = 0; r < m; ++r) convert_to_f32(x.dtype(), row_ptr(x, r), x_converted.data() + r * k, static_cast<size_t>(k));
    x_f32 = x_converted.data();
    x_stride = k;
  }
  const bool out_f32 = out.dtype() == DType::kF32;

  cpu_pool().parallel_for((n + kRowBlock - 1) / kRowBlock, 1, [&](int64_t block_begin, int64_t block_end) {
    float* w_block = scratch_a(kRowBlock * k);
    float* out_row = scratch_b(kRowBlock);
    for (int64_t block = block_begin; block < block_end; ++block) {
      const int64_t n0 = block * kRowBlock;
      const int64_t rows = std::min(kRowBlock, n - n0);
      const float* w = load_rows(n0, rows, w_block);
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x_f32 + r * x_stride;
        int64_t j = 0;
        for (; j + 4 <= rows; j += 4) dot4(xr, w + j * k, w + (j + 1) * k, w + (j + 2) * k, w + (j + 3) * k, k, out_row + j);
        for (; j < rows; ++j) out_row[j] = dot_f32(xr, w + j * k, k);
        if (out_f32) {
          float* dst = static_cast<float*>(row_ptr_mut(out, r)) + n0;
          if (accumulate) {
            for (int64_t i = 0; i < rows; ++i) dst[i] += out_row[i];
          } else {
            std::copy(out_row, out_row + rows, dst);
          }
        } else {
          void* dst = static_cast<char*>(row_ptr_mut(out, r)) + n0 * static_cast<int64_t>(out.element_size());
          if (accumulate) {
            float previous[kRowBlock];
            convert_to_f32(out.dtype(), dst, previous, static_cast<size_t>(rows));
            for (int64_t i = 0; i < rows; ++i) out_row[i] += previous[i];
          }
          store_f32(out.dtype(), out_row, dst, rows);
        }
      }
    }
  });
}

}  // namespace metrale::kernels::cpu
