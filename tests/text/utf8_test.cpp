#include "text/utf8.h"

#include <gtest/gtest.h>

#include "text/byte_level.h"

namespace metrale::text {
namespace {

const std::string kFffd(kReplacementCharacter);

TEST(Utf8, ValidTextPassesThrough) {
  const std::string text = "plain ASCII, café, 漢字, 😀";
  EXPECT_TRUE(is_valid_utf8(text));
  EXPECT_EQ(to_valid_utf8_lossy(text), text);
}

TEST(Utf8, MaximalSubpartsBecomeOneReplacementEach) {
  // The example of the Unicode Standard, section 3.9 (U+FFFD substitution of maximal subparts),
  // which is also what Rust's String::from_utf8_lossy (used by HF's ByteLevel decoder) produces.
  const std::string input = "\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64";
  EXPECT_FALSE(is_valid_utf8(input));
  EXPECT_EQ(to_valid_utf8_lossy(input), "a" + kFffd + kFffd + kFffd + "b" + kFffd + "c" + kFffd + kFffd + "d");
}

TEST(Utf8, RejectsOverlongsSurrogatesAndOutOfRange) {
  EXPECT_EQ(to_valid_utf8_lossy("\xC0\xAF"), kFffd + kFffd);              // overlong '/'
  EXPECT_EQ(to_valid_utf8_lossy("\xE0\x80\xAF"), kFffd + kFffd + kFffd);  // overlong, E0 needs A0..BF
  EXPECT_EQ(to_valid_utf8_lossy("\xED\xA0\x80"), kFffd + kFffd + kFffd);  // a surrogate
  EXPECT_EQ(to_valid_utf8_lossy("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);  // > U+10FFFF
  EXPECT_EQ(to_valid_utf8_lossy("\xFF"), kFffd);
}

TEST(Utf8, TruncatedSequenceAtTheEndIsOneReplacement) {
  EXPECT_EQ(to_valid_utf8_lossy("ok\xF0\x9F\x98"), "ok" + kFffd);
  std::string out;
  EXPECT_EQ(append_complete_utf8("ok\xF0\x9F\x98", out), 2u);  // the incomplete emoji waits
  EXPECT_EQ(out, "ok");
}

TEST(Utf8, ScanClassifiesSequences) {
  EXPECT_EQ(scan_utf8("\xE2\x82\xAC").status, Utf8Status::kValid);
  EXPECT_EQ(scan_utf8("\xE2\x82\xAC").code_point, U'€');
  EXPECT_EQ(scan_utf8("\xE2\x82").status, Utf8Status::kIncomplete);
  const Utf8Sequence bad = scan_utf8("\xE2\x82x");
  EXPECT_EQ(bad.status, Utf8Status::kInvalid);
  EXPECT_EQ(bad.length, 2);
}

TEST(ByteLevel, AlphabetIsABijection) {
  for (int byte = 0; byte < 256; ++byte) {
    EXPECT_EQ(byte_level_byte(byte_level_char(static_cast<uint8_t>(byte))), byte);
  }
  EXPECT_EQ(byte_level_char(' '), U'Ġ');
  EXPECT_EQ(byte_level_char('\n'), U'Ċ');
  EXPECT_EQ(byte_level_char('a'), U'a');
  EXPECT_EQ(byte_level_byte(U'｜'), -1);
  const std::string raw = "a b\n\xF0\x9F\x98\x80";
  EXPECT_EQ(byte_level_encode(raw), "aĠbĊðŁĺĢ");
  EXPECT_EQ(byte_level_decode(byte_level_encode(raw)), raw);
  EXPECT_EQ(byte_level_decode("<｜x"), std::nullopt);
}

}  // namespace
}  // namespace metrale::text
