// The logger's level and its sink, without fmt: what code that cannot include fmt (CUDA sources)
// needs to log a prebuilt message. core/log.h adds the formatting front end.
#pragma once

#include <string_view>

namespace metrale {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

LogLevel log_level();
void set_log_level(LogLevel level);
void log_write(LogLevel level, std::string_view message);

}  // namespace metrale
