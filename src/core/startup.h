// What a long-running command (metrale serve) is doing while it starts, on stderr whatever the log
// level: one line per stage (the weights loading and loaded, the engine's plan, the address once it
// serves). On a terminal a counted stage redraws one progress line in place (tensors, bytes, rate);
// elsewhere (a pipe, a log file) it writes one line when it begins and one when it ends. With
// LogFormat::kJson every line is a JSON record ({"ts", "level", "event", "msg", the stage's
// fields}) and a counted stage adds a progress record at most once a second. Off unless enabled,
// so that commands whose output is the point (generate, tokenize, bench) stay quiet.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace metrale {

void set_startup_reporting(bool on);
bool startup_reporting();

struct StartupField {
  std::string key;
  std::variant<std::string, int64_t, double, bool> value;
};
using StartupFields = std::vector<StartupField>;

// One stage line: "[metrale] <message>", or the JSON record of `event`. Nothing when reporting is off.
void report_startup(std::string_view event, std::string_view message, const StartupFields& fields = {});
// The line report_startup writes (newline included), for the given format.
std::string startup_line(bool json, std::string_view event, std::string_view message, const StartupFields& fields);

// A counted stage: `total_items` items (`item_name`, plural: "tensors") of `total_bytes` bytes. One
// thread advances it. Events: <event>_start, <event>_progress (JSON only), <event>_done.
class StageProgress {
 public:
  // `doing` / `done`: the stage's words ("loading weights from DIR" / "loaded weights").
  StageProgress(std::string event, std::string doing, std::string done, std::string item_name, int64_t total_items,
                uint64_t total_bytes);
  ~StageProgress();
  StageProgress(const StageProgress&) = delete;
  StageProgress& operator=(const StageProgress&) = delete;

  void advance(int64_t items, uint64_t bytes);
  // Writes the end line (once; the destructor calls it too).
  void finish();

  int64_t items() const { return items_; }
  uint64_t bytes() const { return bytes_; }
  // "loading weights: 45/123 tensors, 0.5/1.2 GiB, 310 MiB/s": the terminal's progress line.
  std::string progress_text(double seconds) const;
  // "loaded weights: 120 tensors, 1.1 GiB in 3.4 s (330 MiB/s)"
  std::string done_text(double seconds) const;

 private:
  double seconds() const;

  std::string event_;
  std::string doing_;
  std::string done_;
  std::string item_name_;
  int64_t total_items_ = 0;
  uint64_t total_bytes_ = 0;
  int64_t items_ = 0;
  uint64_t bytes_ = 0;
  bool active_ = false;    // reporting was on when it began
  bool terminal_ = false;  // redraw in place (text format, stderr a terminal)
  bool finished_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_shown_;
};

}  // namespace metrale
