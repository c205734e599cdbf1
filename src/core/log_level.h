// The logger's level, format and sink, without fmt: what code that cannot include fmt (CUDA
// sources) needs to log a prebuilt message. core/log.h adds the formatting front end.
#pragma once

#include <string_view>

namespace metrale {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

// kText: "[metrale info] message". kJson: one JSON object a line, {"ts", "level", "msg"} (and, for
// start-up events, "event" and the event's fields: core/startup.h), for log collectors.
enum class LogFormat { kText = 0, kJson = 1 };

LogLevel log_level();
void set_log_level(LogLevel level);
LogFormat log_format();
void set_log_format(LogFormat format);
void log_write(LogLevel level, std::string_view message);
// Writes one whole line (the newline included) to stderr under the log's lock, so that lines of
// different threads never interleave.
void log_write_raw(std::string_view line);

}  // namespace metrale
