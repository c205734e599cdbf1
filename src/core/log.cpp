#include "core/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "core/json_line.h"

namespace metrale {
namespace {

LogLevel level_from_env() {
  const char* value = std::getenv("METRALE_LOG");
  if (value == nullptr) return LogLevel::kWarn;
  const std::string text(value);
  if (text == "debug") return LogLevel::kDebug;
  if (text == "info") return LogLevel::kInfo;
  if (text == "error") return LogLevel::kError;
  return LogLevel::kWarn;
}

std::atomic<LogLevel>& level_storage() {
  static std::atomic<LogLevel> level{level_from_env()};
  return level;
}

std::atomic<LogFormat>& format_storage() {
  static std::atomic<LogFormat> format{LogFormat::kText};
  return format;
}

std::mutex& sink_mutex() {
  static std::mutex mutex;
  return mutex;
}

}  // namespace

LogLevel log_level() { return level_storage().load(std::memory_order_relaxed); }
void set_log_level(LogLevel level) { level_storage().store(level, std::memory_order_relaxed); }
LogFormat log_format() { return format_storage().load(std::memory_order_relaxed); }
void set_log_format(LogFormat format) { format_storage().store(format, std::memory_order_relaxed); }

void log_write_raw(std::string_view line) {
  std::lock_guard lock(sink_mutex());
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

void log_write(LogLevel level, std::string_view message) {
  if (log_format() == LogFormat::kJson) {
    JsonLine line(level);
    line.add("msg", message);
    log_write_raw(line.finish());
    return;
  }
  static constexpr const char* kNames[] = {"debug", "info", "warn", "error"};
  std::string line = "[metrale ";
  line += kNames[static_cast<int>(level)];
  line += "] ";
  line += message;
  line += '\n';
  log_write_raw(line);
}

}  // namespace metrale
