// Scalar conversions between fp32 and bf16 / fp16 / fp8 e4m3. Every expected value comes from an
// independent double-precision definition of the format written here (never from the code under test).
#include "core/dtype.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "core/error.h"

namespace metrale {
namespace {

bool is_f16_nan(uint16_t bits) {
  return (bits & 0x7c00u) == 0x7c00u && (bits & 0x03ffu) != 0;
}
bool is_bf16_nan(uint16_t bits) {
  return (bits & 0x7f80u) == 0x7f80u && (bits & 0x007fu) != 0;
}

// The value of an IEEE binary16 bit pattern, from the definition of the format.
double f16_reference_value(uint16_t bits) {
  const int sign = (bits & 0x8000u) ? -1 : 1;
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  if (exponent == 31) return mantissa == 0 ? sign * std::numeric_limits<double>::infinity() : std::nan("");
  if (exponent == 0) return sign * std::ldexp(static_cast<double>(mantissa), -24);
  return sign * std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
}

// The value of a bf16 bit pattern, from the definition (8 exponent bits, bias 127, 7 mantissa bits).
double bf16_reference_value(uint16_t bits) {
  const int sign = (bits & 0x8000u) ? -1 : 1;
  const int exponent = (bits >> 7) & 0xff;
  const int mantissa = bits & 0x7f;
  if (exponent == 255) return mantissa == 0 ? sign * std::numeric_limits<double>::infinity() : std::nan("");
  if (exponent == 0) return sign * std::ldexp(static_cast<double>(mantissa), -133);  // 2^-126 * m / 2^7
  return sign * std::ldexp(1.0 + mantissa / 128.0, exponent - 127);
}

// Rounds |x| to the nearest representable magnitude of a format whose magnitudes, in increasing
// order, are the values of the bit patterns 0 .. max_finite (sign excluded). Ties go to the even
// pattern; anything at or beyond (max_finite + half an ulp) overflows to the pattern max_finite + 1
// (infinity). Works by bisection over the monotone pattern -> value map, so it does not share any
// bit tricks with the implementation.
template <typename ValueOf>
uint32_t round_magnitude_reference(double magnitude, uint32_t max_finite, ValueOf value_of) {
  uint32_t low = 0, high = max_finite;
  if (magnitude >= value_of(max_finite)) {
    const double ulp = value_of(max_finite) - value_of(max_finite - 1);
    const double halfway = value_of(max_finite) + ulp / 2;
    if (magnitude < halfway) return max_finite;
    if (magnitude > halfway) return max_finite + 1;
    return (max_finite % 2 == 0) ? max_finite : max_finite + 1;
  }
  // Find the largest pattern with value <= magnitude.
  while (low < high) {
    const uint32_t mid = (low + high + 1) / 2;
    if (value_of(mid) <= magnitude)
      low = mid;
    else
      high = mid - 1;
  }
  const double below = value_of(low), above = value_of(low + 1);
  const double to_below = magnitude - below, to_above = above - magnitude;  // exact in double
  if (to_below < to_above) return low;
  if (to_above < to_below) return low + 1;
  return (low % 2 == 0) ? low : low + 1;
}

uint16_t f16_reference_bits(float value) {
  if (std::isnan(value)) return 0x7e00;
  const uint32_t sign = std::signbit(value) ? 0x8000u : 0u;
  if (std::isinf(value)) return static_cast<uint16_t>(sign | 0x7c00u);
  const uint32_t magnitude = round_magnitude_reference(std::fabs(static_cast<double>(value)), 0x7bffu, [](uint32_t b) {
    return f16_reference_value(static_cast<uint16_t>(b));
  });
  return static_cast<uint16_t>(sign | magnitude);
}

uint16_t bf16_reference_bits(float value) {
  if (std::isnan(value)) return 0x7fc0;
  const uint32_t sign = std::signbit(value) ? 0x8000u : 0u;
  if (std::isinf(value)) return static_cast<uint16_t>(sign | 0x7f80u);
  const uint32_t magnitude = round_magnitude_reference(std::fabs(static_cast<double>(value)), 0x7f7fu, [](uint32_t b) {
    return bf16_reference_value(static_cast<uint16_t>(b));
  });
  return static_cast<uint16_t>(sign | magnitude);
}

// Random floats spread over every binade the 16-bit formats care about, plus raw bit patterns.
std::vector<float> interesting_random_floats(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<uint32_t> bits_dist;
  std::uniform_int_distribution<int> exponent_dist(-30, 20);  // f16 subnormals .. past the f16 max
  std::uniform_real_distribution<double> mantissa_dist(1.0, 2.0);
  std::vector<float> values;
  values.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    if (i % 4 == 0) {
      values.push_back(std::bit_cast<float>(bits_dist(rng)));
    } else {
      const double sign = (bits_dist(rng) & 1u) ? -1.0 : 1.0;
      values.push_back(static_cast<float>(sign * std::ldexp(mantissa_dist(rng), exponent_dist(rng))));
    }
  }
  return values;
}

// ---------------------------------------------------------------------------------------------
// bf16

TEST(Bf16, DecodeMatchesFormatDefinitionForAllPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const float decoded = bf16_bits_to_f32(bits);
    if (is_bf16_nan(bits)) {
      EXPECT_TRUE(std::isnan(decoded)) << std::hex << b;
    } else {
      ASSERT_EQ(static_cast<double>(decoded), bf16_reference_value(bits)) << std::hex << b;
    }
  }
}

TEST(Bf16, RoundTripOfAllPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const uint16_t again = f32_to_bf16_bits(bf16_bits_to_f32(bits));
    if (is_bf16_nan(bits)) {
      EXPECT_TRUE(is_bf16_nan(again)) << std::hex << b << " -> " << again;
      EXPECT_EQ(again & 0x8000u, bits & 0x8000u) << "NaN keeps its sign";
    } else {
      ASSERT_EQ(again, bits) << std::hex << b;
    }
  }
}

TEST(Bf16, TiesRoundToEven) {
  // 1.0 = 0x3f80_0000; one bf16 ulp at 1.0 is 0x1_0000 in fp32 bits.
  EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0x3f808000u)), 0x3f80u);  // tie, even below
  EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0x3f818000u)), 0x3f82u);  // tie, even above
  EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0x3f807fffu)), 0x3f80u);  // just below the tie
  EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0x3f808001u)), 0x3f81u);  // just above the tie
  EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0xbf818000u)), 0xbf82u);  // negative tie
  // Subnormal ties.
  EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0x00008000u)), 0x0000u);
  EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0x00018000u)), 0x0002u);
  // The largest finite fp32 rounds up to infinity; a value just under the tie stays finite.
  EXPECT_EQ(f32_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80u);
  EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0x7f7f7fffu)), 0x7f7fu);
}

TEST(Bf16, SpecialValues) {
  EXPECT_EQ(f32_to_bf16_bits(0.0f), 0x0000u);
  EXPECT_EQ(f32_to_bf16_bits(-0.0f), 0x8000u);
  EXPECT_EQ(f32_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80u);
  EXPECT_EQ(f32_to_bf16_bits(-std::numeric_limits<float>::infinity()), 0xff80u);
  EXPECT_TRUE(is_bf16_nan(f32_to_bf16_bits(std::numeric_limits<float>::quiet_NaN())));
  // A NaN whose payload lives only in the low 16 bits must not become infinity.
  EXPECT_TRUE(is_bf16_nan(f32_to_bf16_bits(std::bit_cast<float>(0x7f800001u))));
  EXPECT_TRUE(is_bf16_nan(f32_to_bf16_bits(std::bit_cast<float>(0xff800001u))));
  EXPECT_TRUE(std::isinf(bf16_bits_to_f32(0x7f80u)));
  EXPECT_EQ(round_to_bf16(1.0f), 1.0f);
}

TEST(Bf16, RandomValuesMatchReferenceRounding) {
  for (const float value : interesting_random_floats(200000, 11)) {
    const uint16_t expected = bf16_reference_bits(value);
    const uint16_t actual = f32_to_bf16_bits(value);
    if (std::isnan(value)) {
      EXPECT_TRUE(is_bf16_nan(actual));
    } else {
      ASSERT_EQ(actual, expected) << "value " << value << " bits 0x" << std::hex << std::bit_cast<uint32_t>(value);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// f16

TEST(F16, DecodeMatchesFormatDefinitionForAllPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const float decoded = f16_bits_to_f32(bits);
    if (is_f16_nan(bits)) {
      EXPECT_TRUE(std::isnan(decoded)) << std::hex << b;
    } else {
      ASSERT_EQ(static_cast<double>(decoded), f16_reference_value(bits)) << std::hex << b;
      EXPECT_EQ(std::signbit(decoded), (bits & 0x8000u) != 0) << std::hex << b;
    }
  }
}

TEST(F16, RoundTripOfAllPatterns) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const uint16_t again = f32_to_f16_bits(f16_bits_to_f32(bits));
    if (is_f16_nan(bits)) {
      EXPECT_TRUE(is_f16_nan(again)) << std::hex << b;
      EXPECT_EQ(again & 0x8000u, bits & 0x8000u) << "NaN keeps its sign";
    } else {
      ASSERT_EQ(again, bits) << std::hex << b;
    }
  }
}

TEST(F16, TiesRoundToEven) {
  const float ulp_at_one = std::ldexp(1.0f, -10);
  EXPECT_EQ(f32_to_f16_bits(1.0f + ulp_at_one / 2), 0x3c00u);      // tie, even below
  EXPECT_EQ(f32_to_f16_bits(1.0f + 3 * ulp_at_one / 2), 0x3c02u);  // tie, even above
  EXPECT_EQ(f32_to_f16_bits(std::nextafter(1.0f + ulp_at_one / 2, 2.0f)), 0x3c01u);
  EXPECT_EQ(f32_to_f16_bits(std::nextafter(1.0f + ulp_at_one / 2, 0.0f)), 0x3c00u);
  EXPECT_EQ(f32_to_f16_bits(-(1.0f + 3 * ulp_at_one / 2)), 0xbc02u);
  // Subnormal ties: the spacing is 2^-24.
  const float tiny = std::ldexp(1.0f, -24);
  EXPECT_EQ(f32_to_f16_bits(0.5f * tiny), 0x0000u);
  EXPECT_EQ(f32_to_f16_bits(1.5f * tiny), 0x0002u);
  EXPECT_EQ(f32_to_f16_bits(2.5f * tiny), 0x0002u);
  EXPECT_EQ(f32_to_f16_bits(std::nextafter(0.5f * tiny, 1.0f)), 0x0001u);
  // Largest subnormal + half a step ties between 0x03ff (odd) and the smallest normal 0x0400.
  EXPECT_EQ(f32_to_f16_bits(1023.5f * tiny), 0x0400u);
  EXPECT_EQ(f32_to_f16_bits(1022.5f * tiny), 0x03feu);
}

TEST(F16, SubnormalsAndUnderflow) {
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -24)), 0x0001u);  // smallest subnormal
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -14)), 0x0400u);  // smallest normal
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1023.0f, -24)), 0x03ffu);
  EXPECT_EQ(f32_to_f16_bits(std::ldexp(1.0f, -26)), 0x0000u);   // underflows to +0
  EXPECT_EQ(f32_to_f16_bits(-std::ldexp(1.0f, -26)), 0x8000u);  // and keeps the sign
  EXPECT_EQ(f32_to_f16_bits(std::numeric_limits<float>::denorm_min()), 0x0000u);
  EXPECT_EQ(f16_bits_to_f32(0x0001u), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_bits_to_f32(0x8001u), -std::ldexp(1.0f, -24));
}

TEST(F16, OverflowGoesToInfinity) {
  EXPECT_EQ(f32_to_f16_bits(65504.0f), 0x7bffu);                        // max finite
  EXPECT_EQ(f32_to_f16_bits(std::nextafter(65520.0f, 0.0f)), 0x7bffu);  // just below the tie
  EXPECT_EQ(f32_to_f16_bits(65520.0f), 0x7c00u);                        // tie with odd max -> inf
  EXPECT_EQ(f32_to_f16_bits(-65520.0f), 0xfc00u);
  EXPECT_EQ(f32_to_f16_bits(1e10f), 0x7c00u);
  EXPECT_EQ(f32_to_f16_bits(std::numeric_limits<float>::max()), 0x7c00u);
  EXPECT_EQ(f32_to_f16_bits(std::numeric_limits<float>::infinity()), 0x7c00u);
  EXPECT_EQ(f32_to_f16_bits(-std::numeric_limits<float>::infinity()), 0xfc00u);
  EXPECT_TRUE(is_f16_nan(f32_to_f16_bits(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(is_f16_nan(f32_to_f16_bits(std::bit_cast<float>(0x7f800001u))));  // low-payload NaN
  EXPECT_EQ(f32_to_f16_bits(-0.0f), 0x8000u);
}

TEST(F16, RandomValuesMatchReferenceRounding) {
  for (const float value : interesting_random_floats(200000, 12)) {
    const uint16_t expected = f16_reference_bits(value);
    const uint16_t actual = f32_to_f16_bits(value);
    if (std::isnan(value)) {
      EXPECT_TRUE(is_f16_nan(actual));
    } else {
      ASSERT_EQ(actual, expected) << "value " << value << " bits 0x" << std::hex << std::bit_cast<uint32_t>(value);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// fp8 e4m3 (fn): bias 7, no infinities, S.1111.111 is NaN, max 448.

double f8e4m3_reference_value(uint8_t bits) {
  const int sign = (bits & 0x80u) ? -1 : 1;
  const int exponent = (bits >> 3) & 0xf;
  const int mantissa = bits & 0x7;
  if (exponent == 15 && mantissa == 7) return std::nan("");
  if (exponent == 0) return sign * std::ldexp(mantissa / 8.0, -6);
  return sign * std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
}

TEST(F8E4M3, DecodeMatchesFormatDefinitionForAllPatterns) {
  for (uint32_t b = 0; b < 256; ++b) {
    const auto bits = static_cast<uint8_t>(b);
    const float decoded = f8e4m3_bits_to_f32(bits);
    const double expected = f8e4m3_reference_value(bits);
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(decoded)) << b;
    } else {
      EXPECT_EQ(static_cast<double>(decoded), expected) << b;
      EXPECT_EQ(std::signbit(decoded), (bits & 0x80u) != 0) << b;
    }
  }
  EXPECT_EQ(f8e4m3_bits_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f8e4m3_bits_to_f32(0xfe), -448.0f);
  EXPECT_EQ(f8e4m3_bits_to_f32(0x78), 256.0f);  // exponent 15 is finite except for mantissa 7
  EXPECT_EQ(f8e4m3_bits_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isnan(f8e4m3_bits_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(f8e4m3_bits_to_f32(0xff)));
}

// ---------------------------------------------------------------------------------------------
// Array conversions and helpers

TEST(DTypeConvert, ArraysMatchScalarConversions) {
  const std::vector<float> values = interesting_random_floats(1000, 13);
  std::vector<uint16_t> bf16(values.size()), f16(values.size());
  convert_from_f32(DType::kBF16, values.data(), bf16.data(), values.size());
  convert_from_f32(DType::kF16, values.data(), f16.data(), values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (std::isnan(values[i])) continue;
    ASSERT_EQ(bf16[i], bf16_reference_bits(values[i])) << i;
    ASSERT_EQ(f16[i], f16_reference_bits(values[i])) << i;
  }
  std::vector<float> back(values.size());
  convert_to_f32(DType::kBF16, bf16.data(), back.data(), bf16.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (!is_bf16_nan(bf16[i])) {
      ASSERT_EQ(static_cast<double>(back[i]), bf16_reference_value(bf16[i])) << i;
    }
  }
  convert_to_f32(DType::kF16, f16.data(), back.data(), f16.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (!is_f16_nan(f16[i])) {
      ASSERT_EQ(static_cast<double>(back[i]), f16_reference_value(f16[i])) << i;
    }
  }
  std::vector<float> copy(values.size());
  convert_from_f32(DType::kF32, values.data(), copy.data(), values.size());
  EXPECT_EQ(std::memcmp(copy.data(), values.data(), values.size() * 4), 0);
}

TEST(DTypeConvert, IntegersAndFp8ToF32) {
  const int32_t i32[] = {-7, 0, 123456, -2147483647};
  const int64_t i64[] = {-3, 1ll << 40};
  const uint8_t f8[] = {0x38, 0xb8, 0x7e, 0x01};
  float out[4];
  convert_to_f32(DType::kI32, i32, out, 4);
  EXPECT_EQ(out[0], -7.0f);
  EXPECT_EQ(out[2], 123456.0f);
  EXPECT_EQ(out[3], -2147483647.0f);
  convert_to_f32(DType::kI64, i64, out, 2);
  EXPECT_EQ(out[0], -3.0f);
  EXPECT_EQ(out[1], std::ldexp(1.0f, 40));
  convert_to_f32(DType::kF8E4M3, f8, out, 4);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -1.0f);
  EXPECT_EQ(out[2], 448.0f);
  EXPECT_EQ(out[3], std::ldexp(1.0f, -9));
}

// f32 -> f8e4m3 (FP8 KV-cache writes): round to nearest even, saturate at +-448, and every code
// reads back as the value it was written from.
TEST(DTypeConvert, F32ToF8E4M3RoundsAndSaturates) {
  const float values[6] = {1.0f, -1.0f, 1000.0f, -1000.0f, 1.0625f, std::ldexp(1.0f, -9)};
  uint8_t codes[6] = {};
  convert_from_f32(DType::kF8E4M3, values, codes, 6);
  float back[6] = {};
  convert_to_f32(DType::kF8E4M3, codes, back, 6);
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], -1.0f);
  EXPECT_EQ(back[2], 448.0f);
  EXPECT_EQ(back[3], -448.0f);
  EXPECT_EQ(back[4], 1.0f);  // halfway between 1 and 1.125: to the even code
  EXPECT_EQ(back[5], std::ldexp(1.0f, -9));
}

TEST(DTypeConvert, UnsupportedDirectionsThrow) {
  float value = 1.0f;
  uint8_t byte = 0;
  try {
    convert_from_f32(DType::kBool, &value, &byte, 1);
    FAIL() << "f32 -> bool must be rejected";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("bool"), std::string::npos) << e.what();
  }
  EXPECT_THROW(convert_to_f32(DType::kBool, &byte, &value, 1), Error);
  EXPECT_THROW(convert_from_f32(DType::kI32, &value, &byte, 1), Error);
}

TEST(DTypeConvert, LoadAsF32) {
  const float f32[] = {1.5f, -2.25f};
  const uint16_t bf16[] = {0x3fc0, 0xc010};  // 1.5, -2.25
  const uint16_t f16[] = {0x3e00, 0xc080};   // 1.5, -2.25
  const int32_t i32[] = {5, -9};
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(load_as_f32(DType::kF32, f32, i), f32[i]);
    EXPECT_EQ(load_as_f32(DType::kBF16, bf16, i), f32[i]);
    EXPECT_EQ(load_as_f32(DType::kF16, f16, i), f32[i]);
  }
  EXPECT_EQ(load_as_f32(DType::kI32, i32, 1), -9.0f);
}

TEST(DType, SizesNamesAndKinds) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  EXPECT_EQ(dtype_size(DType::kI32), 4u);
  EXPECT_EQ(dtype_size(DType::kBool), 1u);
  EXPECT_EQ(dtype_name(DType::kBF16), "bf16");
  EXPECT_EQ(dtype_name(DType::kF8E4M3), "f8e4m3");
  EXPECT_TRUE(is_floating(DType::kF16));
  EXPECT_TRUE(is_floating(DType::kF8E4M3));
  EXPECT_FALSE(is_floating(DType::kI32));
  EXPECT_FALSE(is_floating(DType::kBool));
}

TEST(DType, F8E4M3EncodingRoundsToNearestEvenAndSaturates) {
  // Every finite code encodes back to itself, both signs.
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;  // NaN
    const float value = f8e4m3_bits_to_f32(static_cast<uint8_t>(code));
    if (code == 0x80) {
      EXPECT_EQ(f32_to_f8e4m3_bits(value), 0x80);  // -0
      continue;
    }
    EXPECT_EQ(f32_to_f8e4m3_bits(value), code) << value;
  }
  // Between neighbours the nearer wins; a midpoint goes to the even code (1.0 = 0x38, 1.125 = 0x39).
  EXPECT_EQ(f32_to_f8e4m3_bits(1.06f), 0x38);
  EXPECT_EQ(f32_to_f8e4m3_bits(1.07f), 0x39);
  EXPECT_EQ(f32_to_f8e4m3_bits(1.0625f), 0x38);
  EXPECT_EQ(f32_to_f8e4m3_bits(1.1875f), 0x3a);  // between 0x39 and 0x3a: even
  EXPECT_EQ(f32_to_f8e4m3_bits(-1.07f), 0xb9);
  EXPECT_EQ(f32_to_f8e4m3_bits(1e-4f), 0x00);     // below half the smallest subnormal (2^-9)
  EXPECT_EQ(f32_to_f8e4m3_bits(0.0015f), 0x01);   // nearer 2^-9 than 0
  EXPECT_EQ(f32_to_f8e4m3_bits(1000.0f), 0x7e);   // saturates to 448
  EXPECT_EQ(f32_to_f8e4m3_bits(-1e30f), 0xfe);
  EXPECT_EQ(f32_to_f8e4m3_bits(std::numeric_limits<float>::quiet_NaN()), 0x7f);
}

}  // namespace
}  // namespace metrale
