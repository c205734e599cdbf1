#include "core/dtype.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "core/error.h"

namespace metrale {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kI64: return 8;
    case DType::kI32: return 4;
    case DType::kI16: return 2;
    case DType::kI8: return 1;
    case DType::kU8: return 1;
    case DType::kBool: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kF8E4M3: return "f8e4m3";
    case DType::kI64: return "i64";
    case DType::kI32: return "i32";
    case DType::kI16: return "i16";
    case DType::kI8: return "i8";
    case DType::kU8: return "u8";
    case DType::kBool: return "bool";
  }
  return "?";
}

bool is_floating(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16 || dtype == DType::kF8E4M3;
}

uint16_t f32_to_f16_bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u); // overflow (rounds past 65504) or inf
  if (abs < 0x38800000u) {
    // Result is subnormal or zero: value = m * 2^-24 with m < 1024. Round |value| * 2^24 to nearest even.
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;  // exact: power-of-two scaling
    const float rounded = std::nearbyint(scaled);                    // default rounding mode: ties to even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(rounded));
  }
  // Normal: rebias exponent (127 -> 15) and round the 23-bit mantissa to 10 bits, ties to even.
  uint32_t result = abs - 0x38000000u;
  result += 0x0fffu + ((result >> 13) & 1u);
  return static_cast<uint16_t>(sign | (result >> 13));
}

float f16_bits_to_f32(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

float f8e4m3_bits_to_f32(uint8_t bits) {
  const bool negative = bits & 0x80u;
  const uint32_t exponent = (bits >> 3) & 0xfu;
  const uint32_t mantissa = bits & 0x7u;
  float magnitude;
  if (exponent == 0xfu && mantissa == 0x7u) {
    magnitude = std::nanf("");
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m/8 * 2^-6
  } else {
    magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, static_cast<int>(exponent) - 7);
  }
  return negative ? -magnitude : magnitude;
}

uint8_t f32_to_f8e4m3_bits(float value) {
  if (std::isnan(value)) return 0x7f;
  // The 127 non-negative finite codes (0x00..0x7e) increase with their value: find the nearest.
  static const std::array<float, 127> kMagnitudes = [] {
    std::array<float, 127> table{};
    for (size_t code = 0; code < table.size(); ++code) table[code] = f8e4m3_bits_to_f32(static_cast<uint8_t>(code));
    return table;
  }();
  const uint8_t sign = std::signbit(value) ? 0x80u : 0x00u;
  const float magnitude = std::fabs(value);
  if (magnitude >= kMagnitudes.back()) return static_cast<uint8_t>(sign | 0x7eu);
  const auto upper = std::upper_bound(kMagnitudes.begin(), kMagnitudes.end(), magnitude);
  size_t code = static_cast<size_t>(upper - kMagnitudes.begin());  // kMagnitudes[code - 1] <= magnitude < [code]
  const float below = kMagnitudes[code - 1], above = kMagnitudes[code];
  if (magnitude - below < above - magnitude || (magnitude - below == above - magnitude && (code - 1) % 2 == 0)) --code;
  return static_cast<uint8_t>(sign | code);
}

void convert_to_f32(DType dtype, const void* src, float* dst, size_t count) {
  switch (dtype) {
    case DType::kF32: std::memcpy(dst, src, count * 4); return;
    case DType::kBF16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = bf16_bits_to_f32(in[i]);
      return;
    }
    case DType::kF16: {
      const auto* in = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = f16_bits_to_f32(in[i]);
      return;
    }
    case DType::kF8E4M3: {
      // A table: FP8 KV caches convert every key they read.
      static const std::array<float, 256> kValues = [] {
        std::array<float, 256> table{};
        for (size_t code = 0; code < table.size(); ++code) table[code] = f8e4m3_bits_to_f32(static_cast<uint8_t>(code));
        return table;
      }();
      const auto* in = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = kValues[in[i]];
      return;
    }
    case DType::kI32: {
      const auto* in = static_cast<const int32_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = static_cast<float>(in[i]);
      return;
    }
    case DType::kI64: {
      const auto* in = static_cast<const int64_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = static_cast<float>(in[i]);
      return;
    }
    default: raise(ErrorCode::kUnsupported, "cannot convert {} to f32", dtype_name(dtype));
  }
}

void convert_from_f32(DType dtype, const float* src, void* dst, size_t count) {
  switch (dtype) {
    case DType::kF32: std::memcpy(dst, src, count * 4); return;
    case DType::kBF16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) out[i] = f32_to_bf16_bits(src[i]);
      return;
    }
    case DType::kF16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) out[i] = f32_to_f16_bits(src[i]);
      return;
    }
    case DType::kF8E4M3: {
      auto* out = static_cast<uint8_t*>(dst);
      for (size_t i = 0; i < count; ++i) out[i] = f32_to_f8e4m3_bits(src[i]);
      return;
    }
    default: raise(ErrorCode::kUnsupported, "cannot convert f32 to {}", dtype_name(dtype));
  }
}

}  // namespace metrale
