#include "core/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

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

}  // namespace

LogLevel log_level() { return level_storage().load(std::memory_order_relaxed); }
void set_log_level(LogLevel level) { level_storage().store(level, std::memory_order_relaxed); }

void log_write(LogLevel level, std::string_view message) {
  static std::mutex mutex;
  static constexpr const char* kNames[] = {"debug", "info", "warn", "error"};
  std::lock_guard lock(mutex);
  std::fprintf(stderr, "[metrale %s] %.*s\n", kNames[static_cast<int>(level)],
               static_cast<int>(message.size()), message.data());
}

}  // namespace metrale
