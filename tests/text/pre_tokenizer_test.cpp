// Split behaviours and the Oniguruma wrapper. Expected pieces come from HF tokenizers 0.23.2
// (splitPreTokenizer("-", behavior, invert) on "-a--b---c-").
#include "text/pre_tokenizer.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/regex.h"

namespace metrale::text {
namespace {

std::vector<std::string> split(const std::string& behavior, bool invert, const std::string& text) {
  const nlohmann::json spec = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"String", "-"}}}, {"behavior", behavior}, {"invert", invert}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}}}};
  const PreTokenizer pre_tokenizer = PreTokenizer::from_json(spec);
  PreTokenizeScratch scratch;
  std::vector<std::string_view> pieces;
  pre_tokenizer.split(text, scratch, pieces);
  return {pieces.begin(), pieces.end()};
}

using Pieces = std::vector<std::string>;

TEST(PreTokenizer, SplitBehaviorsMatchHf) {
  const std::string text = "-a--b---c-";
  EXPECT_EQ(split("Removed", false, text), (Pieces{"a", "b", "c"}));
  EXPECT_EQ(split("Isolated", false, text), (Pieces{"-", "a", "-", "-", "b", "-", "-", "-", "c", "-"}));
  EXPECT_EQ(split("MergedWithPrevious", false, text), (Pieces{"-", "a-", "-", "b-", "-", "-", "c-"}));
  EXPECT_EQ(split("MergedWithNext", false, text), (Pieces{"-a", "-", "-b", "-", "-", "-c", "-"}));
  EXPECT_EQ(split("Contiguous", false, text), (Pieces{"-", "a", "--", "b", "---", "c", "-"}));
  EXPECT_EQ(split("Removed", true, text), (Pieces{"-", "-", "-", "-", "-", "-", "-"}));
  EXPECT_EQ(split("Isolated", true, text), (Pieces{"-", "a", "-", "-", "b", "-", "-", "-", "c", "-"}));
  EXPECT_EQ(split("MergedWithPrevious", true, text), (Pieces{"-a", "-", "-b", "-", "-", "-c", "-"}));
  EXPECT_EQ(split("MergedWithNext", true, text), (Pieces{"-", "a-", "-", "b-", "-", "-", "c-"}));
  EXPECT_EQ(split("Contiguous", true, text), (Pieces{"-", "a", "--", "b", "---", "c", "-"}));
}

TEST(PreTokenizer, ByteLevelPrefixSpaceAndGpt2Regex) {
  const nlohmann::json spec = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  const PreTokenizer pre_tokenizer = PreTokenizer::from_json(spec);
  PreTokenizeScratch scratch;
  std::vector<std::string_view> pieces;
  pre_tokenizer.split("Hello world's  end", scratch, pieces);
  EXPECT_EQ(Pieces(pieces.begin(), pieces.end()), (Pieces{" Hello", " world", "'s", " ", " end"}));
}

TEST(PreTokenizer, RejectsWhatItCannotMirror) {
  EXPECT_THROW(PreTokenizer::from_json(nlohmann::json{{"type", "Whitespace"}}), Error);
  EXPECT_THROW(PreTokenizer::from_json(nlohmann::json(nullptr)), Error);
  const nlohmann::json split_only = {{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Isolated"},
                                     {"invert", false}};
  EXPECT_THROW(PreTokenizer::from_json(split_only), Error);  // no ByteLevel
}

std::vector<std::string> matches(const Regex& regex, std::string_view text) {
  std::vector<ByteRange> ranges;
  regex.find_all(text, ranges);
  std::vector<std::string> out;
  for (const ByteRange& range : ranges) out.emplace_back(text.substr(range.begin, range.end - range.begin));
  return out;
}

TEST(Regex, FindAllSkipsEmptyMatchesAfterAMatch) {
  // As the onig crate's find_iter: "a*" on "baab" matches "", "aa", "" (at 3 it would follow the
  // previous match: skipped), "" at the end.
  const Regex regex("a*");
  std::vector<ByteRange> ranges;
  regex.find_all("baab", ranges);
  ASSERT_EQ(ranges.size(), 3u);
  EXPECT_EQ(ranges[0].begin, 0u);
  EXPECT_EQ(ranges[0].end, 0u);
  EXPECT_EQ(ranges[1].begin, 1u);
  EXPECT_EQ(ranges[1].end, 3u);
  EXPECT_EQ(ranges[2].begin, 4u);
  EXPECT_EQ(ranges[2].end, 4u);
}

TEST(Regex, WhitespaceLookaheadSeesOnlyTheText) {
  const Regex regex(R"(\s+(?!\S)|\s+)");
  EXPECT_EQ(matches(regex, "a   b"), (std::vector<std::string>{"  ", " "}));
  EXPECT_EQ(matches(regex, "a   "), (std::vector<std::string>{"   "}));
}

TEST(Regex, GeneralCategoriesFollowUnicode16) {
  // U+2EBF0 (CJK Extension I, Unicode 15.1) is a letter; U+1FAE8 (shaking face, 15.0) a symbol;
  // U+1CCF0 (outlined digit zero, 16.0) a number. Debian's Oniguruma (Unicode 14) knows none.
  EXPECT_EQ(matches(Regex(R"(\p{L}+)"), "ab\U0002EBF0cd"), (std::vector<std::string>{"ab\U0002EBF0cd"}));
  EXPECT_EQ(matches(Regex(R"(\p{So})"), "x\U0001FAE8"), (std::vector<std::string>{"\U0001FAE8"}));
  EXPECT_EQ(matches(Regex(R"(\pN)"), "\U0001CCF0"), (std::vector<std::string>{"\U0001CCF0"}));
  EXPECT_EQ(matches(Regex(R"([^\s\p{L}]+)"), "ab\U0002EBF0!"), (std::vector<std::string>{"!"}));
  EXPECT_EQ(matches(Regex(R"(\P{L}+)"), "ab\U0002EBF0!?"), (std::vector<std::string>{"!?"}));
  EXPECT_EQ(matches(Regex(R"(\p{^L}+)"), "ab\U0002EBF0!?"), (std::vector<std::string>{"!?"}));
}

TEST(Regex, CategoryRewriteLeavesOtherEscapesAlone) {
  EXPECT_EQ(update_unicode_categories(R"(\\p{L})"), R"(\\p{L})");  // an escaped backslash, then "p{L}"
  EXPECT_EQ(update_unicode_categories(R"(\p{Han}\s\d)"), R"(\p{Han}\s\d)");
  EXPECT_EQ(update_unicode_categories(R"(\p{Lt})"), R"(\p{Lt})");  // unchanged since Unicode 14
  EXPECT_NE(update_unicode_categories(R"(\p{L})").find(R"(\x{2EBF0}-\x{2EE5D})"), std::string::npos);
}

TEST(Regex, BadPatternIsBadFormat) {
  try {
    Regex regex("(?<oops");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBadFormat);
  }
}

}  // namespace
}  // namespace metrale::text
