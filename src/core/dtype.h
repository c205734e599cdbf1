// Element types and scalar conversions. Storage may be bf16, fp16, fp32 (weights, activations,
// caches) or integer (ids, tables); CPU arithmetic is always fp32.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace metrale {

enum class DType : uint8_t { kF32, kF16, kBF16, kF8E4M3, kI64, kI32, kI16, kI8, kU8, kBool };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);          // "f32", "bf16", ...
bool is_floating(DType dtype);

// bf16: the upper 16 bits of an IEEE binary32. Rounds to nearest even; NaN stays NaN.
inline uint16_t f32_to_bf16_bits(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
inline float bf16_bits_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
inline float round_to_bf16(float value) { return bf16_bits_to_f32(f32_to_bf16_bits(value)); }

// IEEE binary16, round to nearest even, with subnormals, infinities and NaN.
uint16_t f32_to_f16_bits(float value);
float f16_bits_to_f32(uint16_t bits);

// OCP FP8 E4M3 (the "fn" variant: no infinities, 0x7f/0xff are NaN, max 448).
float f8e4m3_bits_to_f32(uint8_t bits);
// Rounds to the nearest E4M3 value (ties to an even code), saturating to +-448; NaN -> 0x7f.
uint8_t f32_to_f8e4m3_bits(float value);

// Converts `count` elements of `dtype` at `src` to fp32.
void convert_to_f32(DType dtype, const void* src, float* dst, size_t count);
// Converts `count` fp32 values to `dtype` at `dst` (floating dtypes only; fp8 rounds to nearest and
// saturates, as f32_to_f8e4m3_bits).
void convert_from_f32(DType dtype, const float* src, void* dst, size_t count);

inline float load_as_f32(DType dtype, const void* base, size_t index) {
  switch (dtype) {
    case DType::kF32: {
      float value;
      std::memcpy(&value, static_cast<const char*>(base) + index * 4, 4);
      return value;
    }
    case DType::kBF16: return bf16_bits_to_f32(static_cast<const uint16_t*>(base)[index]);
    case DType::kF16: return f16_bits_to_f32(static_cast<const uint16_t*>(base)[index]);
    default: {
      float value = 0.0f;
      convert_to_f32(dtype, static_cast<const char*>(base) + index * dtype_size(dtype), &value, 1);
      return value;
    }
  }
}

}  // namespace metrale
