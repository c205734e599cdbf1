// Overflow-checked size arithmetic, the JSON nesting-depth scan and the constant-time comparison.
#include "core/checked_math.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "core/json_depth.h"
#include "core/strings.h"
#include "core/test_support.h"

namespace metrale {
namespace {

using testing::throws_error;

constexpr int64_t kMax64 = std::numeric_limits<int64_t>::max();

TEST(CheckedMath, ExactResultsPassThrough) {
  EXPECT_EQ(checked_add<int64_t>(kMax64 - 1, 1, "sum"), kMax64);
  EXPECT_EQ(checked_sub<int64_t>(-kMax64, 1, "difference"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(checked_mul<int64_t>(int64_t{1} << 31, int64_t{1} << 31, "product"), int64_t{1} << 62);
  EXPECT_EQ(checked_mul<uint64_t>(0, ~uint64_t{0}, "product"), 0u);
  EXPECT_EQ(checked_product<uint64_t>("bytes", ErrorCode::kOutOfMemory, 1024, 16, 8, 128, 4), 1024u * 16 * 8 * 128 * 4);
  EXPECT_EQ(checked_ceil_div<int64_t>(kMax64, 16, "blocks"), kMax64 / 16 + 1);
  EXPECT_EQ(checked_ceil_div<int64_t>(32, 16, "blocks"), 2);
  EXPECT_EQ(checked_ceil_div<int64_t>(0, 16, "blocks"), 0);
  EXPECT_EQ(checked_cast<int32_t>(int64_t{2147483647}, "position"), 2147483647);
  EXPECT_EQ(checked_cast<size_t>(int64_t{5}, "count"), 5u);
}

TEST(CheckedMath, OverflowsNameTheQuantityAndUseTheCode) {
  EXPECT_TRUE(throws_error([] { checked_add<int64_t>(kMax64, 1, "tokens"); }, ErrorCode::kInvalidArgument,
                           {"tokens overflows", "9223372036854775807 + 1"}));
  EXPECT_TRUE(throws_error([] { checked_sub<uint64_t>(1, 2, "room"); }, ErrorCode::kInvalidArgument, {"room"}));
  EXPECT_TRUE(throws_error([] { checked_mul<int64_t>(int64_t{1} << 32, int64_t{1} << 32, "blocks x seqs"); },
                           ErrorCode::kInvalidArgument, {"blocks x seqs overflows", "4294967296 x 4294967296"}));
  EXPECT_TRUE(throws_error(
      [] { checked_product<uint64_t>("KV bytes", ErrorCode::kOutOfMemory, uint64_t{1} << 40, 1u << 20, 1u << 10); },
      ErrorCode::kOutOfMemory, {"KV bytes overflows"}));
  EXPECT_TRUE(throws_error([] { checked_cast<int32_t>(int64_t{1} << 32, "position"); }, ErrorCode::kInvalidArgument,
                           {"position is out of range", "4294967296"}));
  EXPECT_TRUE(throws_error([] { checked_cast<size_t>(int64_t{-1}, "count", ErrorCode::kBadFormat); },
                           ErrorCode::kBadFormat, {"count", "-1"}));
  EXPECT_TRUE(throws_error([] { checked_ceil_div<int64_t>(5, 0, "blocks"); }, ErrorCode::kInvalidArgument, {"blocks"}));
}

TEST(JsonDepth, CountsBracketsOutsideStrings) {
  EXPECT_EQ(json_nesting_depth("42"), 0u);
  EXPECT_EQ(json_nesting_depth("\"[[[\""), 0u);
  EXPECT_EQ(json_nesting_depth("[]"), 1u);
  EXPECT_EQ(json_nesting_depth(R"({"a": [1, {"b": [[]]}], "c": {}})"), 5u);
  // An escaped quote does not end the string, so the brackets after it are text.
  EXPECT_EQ(json_nesting_depth(R"(["a\"[[[", 1])"), 1u);
  EXPECT_EQ(json_nesting_depth(R"(["a\\", [2]])"), 2u);
  // Closing brackets without openers do not go below zero.
  EXPECT_EQ(json_nesting_depth("]]]][]"), 1u);
}

TEST(JsonDepth, StopsPastTheLimit) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_EQ(json_nesting_depth(deep), 100000u);
  EXPECT_EQ(json_nesting_depth(deep, 64), 65u);
  EXPECT_TRUE(json_nests_deeper_than(deep, 64));
  EXPECT_FALSE(json_nests_deeper_than(std::string(64, '{') + std::string(64, '}'), 64));
  EXPECT_TRUE(json_nests_deeper_than(std::string(65, '{'), 64));
}

TEST(ConstantTimeEquals, EqualsExactlyTheSecret) {
  EXPECT_TRUE(constant_time_equals("sk-key", "sk-key"));
  EXPECT_TRUE(constant_time_equals("", ""));
  EXPECT_FALSE(constant_time_equals("sk-kez", "sk-key"));
  EXPECT_FALSE(constant_time_equals("sk-ke", "sk-key"));
  EXPECT_FALSE(constant_time_equals("sk-keyy", "sk-key"));
  EXPECT_FALSE(constant_time_equals("", "sk-key"));
  EXPECT_FALSE(constant_time_equals("x", ""));
  // A prefix padded with the complement of the missing bytes still differs.
  EXPECT_FALSE(constant_time_equals(std::string("a\0", 2), "a"));
}

}  // namespace
}  // namespace metrale
