// Start-up reporting and --log-format json: the JSON records parse whatever the text holds, a
// counted stage writes one line when it begins and one when it ends when stderr is not a terminal
// (gtest's capture is a file), and nothing is written while reporting is off.
#include "core/startup.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/json_line.h"
#include "core/log.h"

namespace metrale {
namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < text.size()) {
    const size_t end = text.find('\n', start);
    EXPECT_NE(end, std::string::npos) << "every line ends in a newline: " << text;
    if (end == std::string::npos) break;
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

// Restores the global reporting state whatever a test does.
class StartupTest : public ::testing::Test {
 protected:
  void TearDown() override {
    set_startup_reporting(false);
    set_log_format(LogFormat::kText);
  }
};

TEST(JsonLine, QuotesAndEscapes) {
  EXPECT_EQ(json_quote("plain"), "\"plain\"");
  EXPECT_EQ(json_quote("a\"b\\c\nd\te\x01"), "\"a\\\"b\\\\c\\nd\\te\\u0001\"");
  EXPECT_EQ(json_quote("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"");
  // Bytes that are not UTF-8: a lone continuation byte, a truncated sequence, an overlong form, a surrogate.
  EXPECT_EQ(json_quote("a\x80z"), "\"a\\ufffdz\"");
  EXPECT_EQ(json_quote("a\xe2\x82"), "\"a\\ufffd\\ufffd\"");
  EXPECT_EQ(json_quote("\xc0\xaf"), "\"\\ufffd\\ufffd\"");
  EXPECT_EQ(json_quote("\xed\xa0\x80"), "\"\\ufffd\\ufffd\\ufffd\"");
}

TEST(JsonLine, RecordShape) {
  const auto time = std::chrono::system_clock::time_point(std::chrono::milliseconds(1764653467123));
  EXPECT_EQ(utc_timestamp(time), "2025-12-02T05:31:07.123Z");
  JsonLine line(LogLevel::kWarn, time);
  line.add("msg", "hi").add_int("n", -3).add_number("x", 0.5).add_number("bad", 0.0 / 0.0).add_bool("ok", true);
  EXPECT_EQ(line.finish(),
            "{\"ts\":\"2025-12-02T05:31:07.123Z\",\"level\":\"warn\",\"msg\":\"hi\",\"n\":-3,\"x\":0.5,\"bad\":null,"
            "\"ok\":true}\n");
}

TEST_F(StartupTest, LinesInBothFormats) {
  EXPECT_EQ(startup_line(false, "ready", "serving on http://h:1", {{"url", std::string("http://h:1")}}),
            "[metrale] serving on http://h:1\n");
  const std::string json =
      startup_line(true, "ready", "serving \"m\"",
                   {{"url", std::string("http://h:1")}, {"port", int64_t{1}}, {"chat_template", true}});
  EXPECT_NE(json.find("\"level\":\"info\",\"event\":\"ready\",\"msg\":\"serving \\\"m\\\"\",\"url\":\"http://h:1\","
                      "\"port\":1,\"chat_template\":true}\n"),
            std::string::npos)
      << json;
}

TEST_F(StartupTest, NothingWhileReportingIsOff) {
  ::testing::internal::CaptureStderr();
  report_startup("x", "hidden");
  {
    StageProgress progress("weights", "loading weights", "loaded weights", "tensors", 2, 100);
    progress.advance(2, 100);
  }
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST_F(StartupTest, CountedStageWritesABeginAndAnEndLineOffATerminal) {
  set_startup_reporting(true);
  ::testing::internal::CaptureStderr();
  {
    StageProgress progress("weights", "loading weights from d", "loaded weights", "tensors", 3, 3u << 20);
    for (int i = 0; i < 3; ++i) progress.advance(1, 1u << 20);
    EXPECT_EQ(progress.items(), 3);
    EXPECT_EQ(progress.bytes(), 3u << 20);
  }
  const std::vector<std::string> lines = lines_of(::testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], "[metrale] loading weights from d: 3 tensors, 3.00 MiB");
  EXPECT_EQ(lines[1].rfind("[metrale] loaded weights: 3 tensors, 3.00 MiB in ", 0), 0u) << lines[1];
  EXPECT_EQ(lines[1].find('\r'), std::string::npos);
}

TEST_F(StartupTest, CountedStageInJson) {
  set_startup_reporting(true);
  set_log_format(LogFormat::kJson);
  ::testing::internal::CaptureStderr();
  {
    StageProgress progress("weights", "loading weights", "loaded weights", "tensors", 2, 10);
    progress.advance(1, 4);
    progress.finish();
    progress.advance(1, 6);  // after the end: counted, not shown
  }
  const std::vector<std::string> lines = lines_of(::testing::internal::GetCapturedStderr());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("\"event\":\"weights_start\""), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("\"tensors_total\":2,\"bytes_total\":10}"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("\"event\":\"weights_done\""), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("\"tensors\":1,\"bytes\":4,\"seconds\":"), std::string::npos) << lines[1];
}

TEST_F(StartupTest, ProgressTexts) {
  StageProgress progress("weights", "loading weights", "loaded weights", "tensors", 4, uint64_t{4} << 30);
  progress.advance(1, uint64_t{1} << 30);
  EXPECT_EQ(progress.progress_text(2.0), "loading weights: 1/4 tensors, 1.00 GiB/4.00 GiB, 512.00 MiB/s");
  EXPECT_EQ(progress.done_text(0.5), "loaded weights: 1 tensors, 1.00 GiB in 0.5 s (2.00 GiB/s)");
}

TEST_F(StartupTest, JsonLogFormatAppliesToLogLines) {
  set_log_format(LogFormat::kJson);
  ::testing::internal::CaptureStderr();
  METRALE_LOG_ERROR("disk {} is \"full\"", 3);
  const std::string text = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(text.rfind("{\"ts\":\"", 0), 0u) << text;
  EXPECT_NE(text.find("\"level\":\"error\",\"msg\":\"disk 3 is \\\"full\\\"\"}\n"), std::string::npos) << text;
}

}  // namespace
}  // namespace metrale
