// The stop-string matcher against the plain definition: the output is the full text up to the
// earliest occurrence of any stop string, however the text is split into pieces, and nothing that
// is later taken back is ever released.
#include "server/stop_strings.h"

#include <gtest/gtest.h>

#include <random>

namespace metrale::server {
namespace {

struct StopRun {
  std::string text;
  bool matched = false;
};

// Feeds `pieces` one by one; checks that every release is final (a prefix of the expected output).
StopRun feed_all(const std::vector<std::string>& stops, const std::vector<std::string>& pieces) {
  StopStringMatcher matcher(stops);
  StopRun run;
  for (const std::string& piece : pieces) {
    const StopStringMatcher::Result result = matcher.feed(piece);
    run.text += result.text;
    if (result.matched) {
      run.matched = true;
      EXPECT_TRUE(matcher.matched());
    }
  }
  if (!run.matched) {
    const StopStringMatcher::Result rest = matcher.flush();
    run.text += rest.text;
    run.matched = rest.matched;
  }
  return run;
}

// The definition: cut at the earliest occurrence of any stop string.
StopRun reference(const std::vector<std::string>& stops, const std::string& full) {
  size_t cut = std::string::npos;
  for (const std::string& stop : stops) {
    if (!stop.empty()) cut = std::min(cut, full.find(stop));
  }
  if (cut == std::string::npos) return {full, false};
  return {full.substr(0, cut), true};
}

TEST(StopStrings, MatchAcrossPieces) {
  const StopRun run = feed_all({"STOP"}, {"abc S", "T", "OP and more"});
  EXPECT_TRUE(run.matched);
  EXPECT_EQ(run.text, "abc ");
}

TEST(StopStrings, HoldsBackOnlyPossibleStarts) {
  StopStringMatcher matcher({"world"});
  EXPECT_EQ(matcher.feed("hello wor").text, "hello ");  // "wor" may start "world"
  EXPECT_EQ(matcher.feed("k").text, "work");            // it did not
  EXPECT_EQ(matcher.feed("s w").text, "s ");
  EXPECT_EQ(matcher.flush().text, "w");  // the end: nothing can complete any more
  EXPECT_FALSE(matcher.matched());
}

TEST(StopStrings, EarliestStopWins) {
  const StopRun run = feed_all({"cd", "b"}, {"abcd"});
  EXPECT_TRUE(run.matched);
  EXPECT_EQ(run.text, "a");
  const StopRun overlapping = feed_all({"aab", "ab"}, {"xaa", "b"});
  EXPECT_EQ(overlapping.text, "x");
}

TEST(StopStrings, AnEarlierStopMayStillComplete) {
  // "a" is complete at 2, but "bab" started at 1 and may complete first.
  StopStringMatcher matcher({"bab", "a"});
  const StopStringMatcher::Result waiting = matcher.feed("xba");
  EXPECT_FALSE(waiting.matched);
  EXPECT_EQ(waiting.text, "x");
  const StopStringMatcher::Result done = matcher.feed("b");
  EXPECT_TRUE(done.matched);
  EXPECT_EQ(done.text, "");
  StopStringMatcher ends({"bab", "a"});
  EXPECT_EQ(ends.feed("xba").text, "x");
  const StopStringMatcher::Result flushed = ends.flush();  // "bab" never completed: "a" decides
  EXPECT_TRUE(flushed.matched);
  EXPECT_EQ(flushed.text, "b");
}

TEST(StopStrings, NothingAfterAMatch) {
  StopStringMatcher matcher({"."});
  EXPECT_TRUE(matcher.feed("end. more").matched);
  const StopStringMatcher::Result after = matcher.feed("text");
  EXPECT_TRUE(after.text.empty());
  EXPECT_FALSE(after.matched);
  EXPECT_TRUE(matcher.flush().text.empty());
}

TEST(StopStrings, NoStopsPassesThrough) {
  StopStringMatcher matcher({"", ""});
  EXPECT_TRUE(matcher.empty());
  EXPECT_EQ(matcher.feed("abc").text, "abc");
  EXPECT_EQ(matcher.flush().text, "");
}

TEST(StopStrings, Utf8StaysWhole) {
  // "é" is C3 A9; the stop "éa" shares its first bytes with "éb".
  StopStringMatcher matcher({"\xC3\xA9" "a"});
  EXPECT_EQ(matcher.feed("x\xC3\xA9").text, "x");
  EXPECT_EQ(matcher.feed("b").text, "\xC3\xA9" "b");
  const StopRun run = feed_all({"\xE2\x82\xAC"}, {"price: 5\xE2\x82", "\xAC"});
  EXPECT_TRUE(run.matched);
  EXPECT_EQ(run.text, "price: 5");
}

TEST(StopStrings, RandomSplitsAgreeWithTheDefinition) {
  std::mt19937 generator(2024);
  const std::string alphabet = "abc ";
  const auto random_text = [&](size_t max_length) {
    std::string text(std::uniform_int_distribution<size_t>(0, max_length)(generator), ' ');
    for (char& c : text) c = alphabet[std::uniform_int_distribution<size_t>(0, alphabet.size() - 1)(generator)];
    return text;
  };
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<std::string> stops;
    const int count = std::uniform_int_distribution<int>(1, 3)(generator);
    for (int i = 0; i < count; ++i) stops.push_back(random_text(4));
    const std::string full = random_text(30);
    std::vector<std::string> pieces;
    for (size_t at = 0; at < full.size();) {
      const size_t length = std::min(full.size() - at, std::uniform_int_distribution<size_t>(0, 5)(generator));
      pieces.push_back(full.substr(at, length));
      at += length;
    }
    const StopRun expected = reference(stops, full);
    const StopRun got = feed_all(stops, pieces);
    ASSERT_EQ(got.text, expected.text) << "trial " << trial << " text '" << full << "'";
    ASSERT_EQ(got.matched, expected.matched) << "trial " << trial;
  }
}

}  // namespace
}  // namespace metrale::server
