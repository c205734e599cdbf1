// Helpers for numerical tests (header-only so that the model tests can use them too): a seeded
// random source, random/poisoned tensors of any float dtype and any strides, reading tensors back
// as doubles in logical order, and the relative-L2 comparison used against double references.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "runtime/tensor.h"

namespace metrale::testing {

// A fixed-seed random source: every test builds its own, so tests do not depend on their order.
class Random {
 public:
  explicit Random(uint64_t seed) : engine_(seed) {}

  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(engine_); }
  // A value in [lo, hi] that is never exactly zero (inputs must not hide missing terms).
  float nonzero(float lo, float hi) {
    float value = 0.0f;
    while (value == 0.0f) value = uniform(lo, hi);
    return value;
  }
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(engine_); }
  std::vector<float> floats(size_t count, float lo = -1.0f, float hi = 1.0f) {
    std::vector<float> values(count);
    for (auto& v : values) v = nonzero(lo, hi);
    return values;
  }
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

// Calls fn(element_offset, logical_index) for every element of `shape` with `strides` (in
// elements), in row-major logical order.
inline void for_each_element(const Shape& shape, const Shape& strides,
                             const std::function<void(int64_t offset, int64_t logical)>& fn) {
  const int ndim = shape.ndim();
  const int64_t count = shape.numel();
  std::vector<int64_t> index(static_cast<size_t>(ndim), 0);
  for (int64_t logical = 0; logical < count; ++logical) {
    int64_t offset = 0;
    for (int d = 0; d < ndim; ++d) offset += index[static_cast<size_t>(d)] * strides[d];
    fn(offset, logical);
    for (int d = ndim - 1; d >= 0; --d) {
      if (++index[static_cast<size_t>(d)] < shape[d]) break;
      index[static_cast<size_t>(d)] = 0;
    }
  }
}

inline void store_element(DType dtype, void* base, int64_t offset, float value) {
  char* at = static_cast<char*>(base) + offset * static_cast<int64_t>(dtype_size(dtype));
  switch (dtype) {
    case DType::kF32:
      std::memcpy(at, &value, 4);
      return;
    case DType::kBF16: {
      const uint16_t bits = f32_to_bf16_bits(value);
      std::memcpy(at, &bits, 2);
      return;
    }
    case DType::kF16: {
      const uint16_t bits = f32_to_f16_bits(value);
      std::memcpy(at, &bits, 2);
      return;
    }
    case DType::kI32: {
      const auto v = static_cast<int32_t>(value);
      std::memcpy(at, &v, 4);
      return;
    }
    default:
      FAIL() << "store_element: unsupported dtype " << dtype_name(dtype);
  }
}

inline double load_element(DType dtype, const void* base, int64_t offset) {
  return static_cast<double>(load_as_f32(dtype, base, static_cast<size_t>(offset)));
}

// Writes the given values (logical row-major order) into a tensor of any strides, rounding to its dtype.
inline void fill(const Tensor& t, std::span<const float> values) {
  ASSERT_EQ(static_cast<int64_t>(values.size()), t.numel());
  for_each_element(t.shape(), t.strides(), [&](int64_t offset, int64_t logical) {
    store_element(t.dtype(), t.data(), offset, values[static_cast<size_t>(logical)]);
  });
}

inline void fill_random(const Tensor& t, Random& rng, float lo = -1.0f, float hi = 1.0f) {
  const std::vector<float> values = rng.floats(static_cast<size_t>(t.numel()), lo, hi);
  fill(t, values);
}

// Every element set to NaN, so that an output element the kernel forgets to write is caught.
inline void poison(const Tensor& t) {
  const std::vector<float> nans(static_cast<size_t>(t.numel()), std::nanf(""));
  fill(t, nans);
}

inline OwnedTensor random_tensor(DType dtype, Shape shape, Random& rng, float lo = -1.0f, float hi = 1.0f) {
  OwnedTensor owned(dtype, shape);
  fill_random(*owned, rng, lo, hi);
  return owned;
}

// The tensor's values as doubles, in logical row-major order (any strides, any float dtype, i32).
inline std::vector<double> to_doubles(const Tensor& t) {
  std::vector<double> values(static_cast<size_t>(t.numel()));
  for_each_element(t.shape(), t.strides(), [&](int64_t offset, int64_t logical) {
    values[static_cast<size_t>(logical)] = load_element(t.dtype(), t.data(), offset);
  });
  return values;
}

// The raw bytes of every element, in logical order (to check that untouched memory stayed untouched).
inline std::vector<uint8_t> element_bytes(const Tensor& t) {
  const size_t size = t.element_size();
  std::vector<uint8_t> bytes;
  bytes.reserve(static_cast<size_t>(t.numel()) * size);
  for_each_element(t.shape(), t.strides(), [&](int64_t offset, int64_t) {
    const auto* at = static_cast<const uint8_t*>(t.data()) + offset * static_cast<int64_t>(size);
    bytes.insert(bytes.end(), at, at + size);
  });
  return bytes;
}

// ||actual - expected|| / ||expected||.
inline double relative_l2(std::span<const double> actual, std::span<const double> expected) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < expected.size(); ++i) {
    diff += (actual[i] - expected[i]) * (actual[i] - expected[i]);
    norm += expected[i] * expected[i];
  }
  return std::sqrt(diff / norm);
}

// Succeeds when every actual value is finite (a NaN means an unwritten output) and the relative L2
// error against the reference is at most `tolerance`.
inline ::testing::AssertionResult close_rel_l2(std::span<const double> actual, std::span<const double> expected,
                                               double tolerance) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << "size " << actual.size() << ", expected " << expected.size();
  }
  size_t worst = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i])) {
      return ::testing::AssertionFailure() << "element " << i << " is " << actual[i] << " (not written?)";
    }
    if (std::fabs(actual[i] - expected[i]) > std::fabs(actual[worst] - expected[worst])) worst = i;
  }
  const double error = relative_l2(actual, expected);
  if (!(error <= tolerance)) {
    return ::testing::AssertionFailure() << "relative L2 error " << error << " > " << tolerance << "; worst element "
                                         << worst << ": " << actual[worst] << " vs " << expected[worst];
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult close_rel_l2(const Tensor& actual, std::span<const double> expected,
                                               double tolerance) {
  const std::vector<double> values = to_doubles(actual);
  return close_rel_l2(values, expected, tolerance);
}

// Tolerances. fp32 arithmetic against a double reference: a few fp32 ulps of relative error.
// Outputs stored in bf16 carry its rounding (2^-9 relative per element at most).
inline constexpr double kF32Tolerance = 1e-6;
inline constexpr double kBf16OutputTolerance = 4e-3;

}  // namespace metrale::testing
