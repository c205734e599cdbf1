// Overflow-checked integer arithmetic for sizes that come from outside (flags, config.json, request
// fields, file headers): a product of counts that does not fit its type is an error naming the
// quantity, never a wrapped value that later indexes past a buffer. Each helper throws
// metrale::Error with `code` (kInvalidArgument by default; kBadFormat for file contents,
// kOutOfMemory for allocation sizes) and a message "<what> overflows: a x b".
#pragma once

#include <concepts>
#include <cstdint>
#include <limits>
#include <string_view>
#include <utility>

#include "core/error.h"

namespace metrale {

template <std::integral T>
T checked_add(T a, T b, std::string_view what, ErrorCode code = ErrorCode::kInvalidArgument) {
  T sum{};
  if (__builtin_add_overflow(a, b, &sum)) raise(code, "{} overflows: {} + {}", what, a, b);
  return sum;
}

template <std::integral T>
T checked_sub(T a, T b, std::string_view what, ErrorCode code = ErrorCode::kInvalidArgument) {
  T difference{};
  if (__builtin_sub_overflow(a, b, &difference)) raise(code, "{} overflows: {} - {}", what, a, b);
  return difference;
}

template <std::integral T>
T checked_mul(T a, T b, std::string_view what, ErrorCode code = ErrorCode::kInvalidArgument) {
  T product{};
  if (__builtin_mul_overflow(a, b, &product)) raise(code, "{} overflows: {} x {}", what, a, b);
  return product;
}

// The product of several factors, checked at every step ("bytes of the KV cache": blocks x
// block_size x heads x head_dim x dtype size).
template <std::integral T, std::integral... Rest>
T checked_product(std::string_view what, ErrorCode code, T first, Rest... rest) {
  T product = first;
  ((product = checked_mul(product, static_cast<T>(rest), what, code)), ...);
  return product;
}

// ceil(a / b) for a >= 0, b > 0, without the overflow of (a + b - 1) / b.
template <std::integral T>
T checked_ceil_div(T a, T b, std::string_view what, ErrorCode code = ErrorCode::kInvalidArgument) {
  if (b <= 0 || a < 0) raise(code, "{}: ceil({} / {}) needs a >= 0 and b > 0", what, a, b);
  return a / b + (a % b != 0 ? 1 : 0);
}

// `value` as a To, or an error when it does not fit (a negative count cast to size_t, an int64
// position narrowed to int32).
template <std::integral To, std::integral From>
To checked_cast(From value, std::string_view what, ErrorCode code = ErrorCode::kInvalidArgument) {
  if (!std::in_range<To>(value)) {
    raise(code, "{} is out of range: {} does not fit in [{}, {}]", what, value, std::numeric_limits<To>::min(),
          std::numeric_limits<To>::max());
  }
  return static_cast<To>(value);
}

}  // namespace metrale
