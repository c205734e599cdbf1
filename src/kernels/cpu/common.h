// Helpers shared by the CPU kernels: row conversion to fp32 and a vectorisable dot product.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "runtime/tensor.h"
#include "core/error.h"
#include "runtime/thread_pool.h"

namespace metrale::kernels::cpu {

// Pointer to row `r` of a 2-D (or flattened) tensor with a row stride in elements.
inline const void* row_ptr(const Tensor& t, int64_t r) {
  return static_cast<const char*>(t.data()) + r * t.stride(0) * static_cast<int64_t>(t.element_size());
}
inline void* row_ptr_mut(const Tensor& t, int64_t r) {
  return static_cast<char*>(t.data()) + r * t.stride(0) * static_cast<int64_t>(t.element_size());
}

// Reads `count` elements of `dtype` at `src` as fp32 into `dst` (no copy for f32 when allowed).
inline const float* as_f32(DType dtype, const void* src, float* scratch, int64_t count) {
  if (dtype == DType::kF32) return static_cast<const float*>(src);
  convert_to_f32(dtype, src, scratch, static_cast<size_t>(count));
  return scratch;
}

inline void store_f32(DType dtype, const float* src, void* dst, int64_t count) {
  convert_from_f32(dtype, src, dst, static_cast<size_t>(count));
}

// D(value): `value` rounded to a float storage dtype (the identity for f32), for the rounding points
// of transformers' bf16 path that the CPU reproduces when given bf16 activations.
inline float round_as(DType dtype, float value) {
  switch (dtype) {
    case DType::kBF16: return round_to_bf16(value);
    case DType::kF16: return f16_bits_to_f32(f32_to_f16_bits(value));
    default: return value;
  }
}

// One head row of a [T, heads, dim] view as fp32: `dst` gets t[token, head, :].
inline void load_head(const Tensor& t, int64_t token, int64_t head, float* dst) {
  const char* at = static_cast<const char*>(t.data()) +
                   (token * t.stride(0) + head * t.stride(1)) * static_cast<int64_t>(t.element_size());
  convert_to_f32(t.dtype(), at, dst, static_cast<size_t>(t.size(2)));
}

// A whole (small) weight tensor as fp32, e.g. a norm's [dim] weight.
inline std::vector<float> weights_f32(const Tensor& weight) {
  std::vector<float> w(static_cast<size_t>(weight.numel()));
  convert_to_f32(weight.dtype(), weight.data(), w.data(), w.size());
  return w;
}

inline float sigmoid_f32(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Dot product with 16 independent fp32 accumulators: the compiler can keep them in SIMD lanes
// without reassociating (no -ffast-math needed), and the summation order is fixed.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  float acc[16] = {};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[k + j] * b[k + j];
  }
  float tail = 0.0f;
  for (; k < n; ++k) tail += a[k] * b[k];
  float sum = 0.0f;
  for (int j = 0; j < 16; ++j) sum += acc[j];
  return sum + tail;
}

// Rows of a tensor viewed as [rows, last_dim]; requires the last dim contiguous and rows evenly strided.
struct RowView {
  int64_t rows = 0;
  int64_t width = 0;
  int64_t row_stride = 0;  // elements
};
RowView as_rows(const Tensor& t, const char* what);

inline thread_local std::vector<float> tls_scratch_a;
inline thread_local std::vector<float> tls_scratch_b;
inline float* scratch_a(int64_t n) {
  if (static_cast<int64_t>(tls_scratch_a.size()) < n) tls_scratch_a.resize(static_cast<size_t>(n));
  return tls_scratch_a.data();
}
inline float* scratch_b(int64_t n) {
  if (static_cast<int64_t>(tls_scratch_b.size()) < n) tls_scratch_b.resize(static_cast<size_t>(n));
  return tls_scratch_b.data();
}

}  // namespace metrale::kernels::cpu
