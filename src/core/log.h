// A minimal leveled logger to stderr. The level comes from METRALE_LOG (debug, info, warn, error;
// default warn) so that command output on stdout stays clean.
#pragma once

#include <fmt/format.h>

#include "core/log_level.h"

namespace metrale {

template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (level < log_level()) return;
  log_write(level, fmt::format(format, std::forward<Args>(args)...));
}

#define METRALE_LOG_DEBUG(...) ::metrale::log(::metrale::LogLevel::kDebug, __VA_ARGS__)
#define METRALE_LOG_INFO(...) ::metrale::log(::metrale::LogLevel::kInfo, __VA_ARGS__)
#define METRALE_LOG_WARN(...) ::metrale::log(::metrale::LogLevel::kWarn, __VA_ARGS__)
#define METRALE_LOG_ERROR(...) ::metrale::log(::metrale::LogLevel::kError, __VA_ARGS__)

}  // namespace metrale
