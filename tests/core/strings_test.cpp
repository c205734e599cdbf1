// String helpers, file reading, MappedFile and the error machinery.
#include "core/strings.h"

#include <gtest/gtest.h>

#include <cstring>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/test_support.h"

namespace metrale {
namespace {

using testing::TempDir;
using testing::throws_error;
using testing::write_bytes;

TEST(ParseIntList, ParsesIntegersWithWhitespace) {
  EXPECT_EQ(parse_int_list("1,2,3", "ids"), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(parse_int_list("  4 , -5,\t6 ", "ids"), (std::vector<int64_t>{4, -5, 6}));
  EXPECT_EQ(parse_int_list("9223372036854775807", "ids"), (std::vector<int64_t>{9223372036854775807ll}));
  EXPECT_EQ(parse_int_list("-9223372036854775808", "ids"), (std::vector<int64_t>{INT64_MIN}));
  EXPECT_TRUE(parse_int_list("", "ids").empty());
  EXPECT_TRUE(parse_int_list("  \t ", "ids").empty());
}

TEST(ParseIntList, RejectsWhatIsNotAnIntegerAndNamesTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"1,,2", "''"},                                      // empty item
      {"1,2,", "''"},                                      // trailing comma
      {",1", "''"},                                        // leading comma
      {"1,a", "'a'"},                                      // not a number
      {"1.5", "'1.5'"},                                    // not an integer
      {"1 2", "'1 2'"},                                    // two numbers without a comma
      {"0x10", "'0x10'"},                                  // hex is not accepted
      {"12abc", "'12abc'"},                                // trailing garbage
      {"99999999999999999999", "'99999999999999999999'"},  // out of range
  };
  for (const auto& [text, quoted] : cases) {
    EXPECT_TRUE(throws_error([&] { parse_int_list(text, "--stop-ids"); }, ErrorCode::kInvalidArgument,
                             {"--stop-ids", quoted, "not an integer"}))
        << "input '" << text << "'";
  }
}

TEST(Strings, SplitTrimAffixes) {
  EXPECT_EQ(split("a,b,,c", ','), (std::vector<std::string>{"a", "b", "", "c"}));
  EXPECT_EQ(split("", ','), (std::vector<std::string>{""}));
  EXPECT_EQ(split(",", ','), (std::vector<std::string>{"", ""}));
  EXPECT_EQ(trim(" \t a b \r\n"), "a b");
  EXPECT_EQ(trim("   "), "");
  EXPECT_TRUE(starts_with("model.layers", "model."));
  EXPECT_FALSE(starts_with("mod", "model."));
  EXPECT_TRUE(ends_with("x.safetensors", ".safetensors"));
  EXPECT_FALSE(ends_with("s", ".safetensors"));
}

TEST(Strings, FormatBytes) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(3ull << 30), "3.00 GiB");
}

TEST(ReadFile, ReadsBinaryContentAndReportsMissingFiles) {
  TempDir dir;
  const std::string content("a\0b\nc\xff", 6);
  write_bytes(dir / "f.bin", content);
  EXPECT_EQ(read_file(dir / "f.bin"), content);
  const auto missing = dir / "missing.txt";
  EXPECT_TRUE(throws_error([&] { read_file(missing); }, ErrorCode::kNotFound, {missing.string()}));
}

TEST(MappedFile, MissingFileIsNotFoundAndNamesThePath) {
  TempDir dir;
  const auto missing = dir / "model.safetensors";
  EXPECT_TRUE(throws_error([&] { MappedFile file(missing); }, ErrorCode::kNotFound, {missing.string()}));
}

TEST(MappedFile, MapsContentAndMoves) {
  TempDir dir;
  const std::string content = "0123456789abcdef-metrale";
  write_bytes(dir / "f.bin", content);
  MappedFile file(dir / "f.bin");
  ASSERT_EQ(file.size(), content.size());
  EXPECT_EQ(std::memcmp(file.bytes().data(), content.data(), content.size()), 0);
  EXPECT_EQ(file.path(), dir / "f.bin");

  MappedFile moved(std::move(file));
  EXPECT_EQ(moved.size(), content.size());
  EXPECT_EQ(file.size(), 0u);  // NOLINT(bugprone-use-after-move): a moved-from mapping is empty
  EXPECT_TRUE(file.bytes().empty());
  MappedFile assigned;
  assigned = std::move(moved);
  EXPECT_EQ(std::memcmp(assigned.bytes().data(), content.data(), content.size()), 0);
}

TEST(MappedFile, EmptyFileHasNoBytes) {
  TempDir dir;
  write_bytes(dir / "empty", "");
  MappedFile file(dir / "empty");
  EXPECT_EQ(file.size(), 0u);
  EXPECT_TRUE(file.bytes().empty());
}

TEST(Errors, RaiseCheckAndContext) {
  EXPECT_TRUE(throws_error([] { raise(ErrorCode::kOutOfMemory, "need {} bytes", 42); }, ErrorCode::kOutOfMemory,
                           {"need 42 bytes"}));
  const int value = 3;
  EXPECT_TRUE(throws_error([&] { METRALE_CHECK(value == 4, "value is {}", value); }, ErrorCode::kInternal,
                           {"value == 4", "strings_test.cpp", "value is 3"}));
  EXPECT_NO_THROW(METRALE_CHECK(value == 3));
  try {
    try {
      raise(ErrorCode::kBadFormat, "inner problem");
    } catch (const Error& e) {
      rethrow_with_context(e, "layer {} ({})", 12, "gdn");
    }
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBadFormat);
    EXPECT_STREQ(e.what(), "layer 12 (gdn): inner problem");
  }
  EXPECT_EQ(error_code_name(ErrorCode::kNotFound), "not_found");
  EXPECT_EQ(error_code_name(ErrorCode::kUnsupported), "unsupported");
}

}  // namespace
}  // namespace metrale
