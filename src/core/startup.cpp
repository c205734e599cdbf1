#include "core/startup.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>

#include "core/json_line.h"
#include "core/log_level.h"
#include "core/strings.h"

namespace metrale {
namespace {

std::atomic<bool>& reporting() {
  static std::atomic<bool> on{false};
  return on;
}

constexpr std::chrono::milliseconds kTerminalRedraw{100};
constexpr std::chrono::milliseconds kJsonProgress{1000};

std::string rate_text(uint64_t bytes, double seconds) {
  if (seconds <= 0.0) return "-";
  return format_bytes(static_cast<uint64_t>(static_cast<double>(bytes) / seconds)) + "/s";
}

}  // namespace

void set_startup_reporting(bool on) {
  reporting().store(on, std::memory_order_relaxed);
}
bool startup_reporting() {
  return reporting().load(std::memory_order_relaxed);
}

std::string startup_line(bool json, std::string_view event, std::string_view message, const StartupFields& fields) {
  if (!json) return fmt::format("[metrale] {}\n", message);
  JsonLine line(LogLevel::kInfo);
  line.add("event", event);
  line.add("msg", message);
  for (const StartupField& field : fields) {
    std::visit(
        [&](const auto& value) {
          using Value = std::decay_t<decltype(value)>;
          if constexpr (std::is_same_v<Value, std::string>)
            line.add(field.key, value);
          else if constexpr (std::is_same_v<Value, int64_t>)
            line.add_int(field.key, value);
          else if constexpr (std::is_same_v<Value, double>)
            line.add_number(field.key, value);
          else
            line.add_bool(field.key, value);
        },
        field.value);
  }
  return line.finish();
}

void report_startup(std::string_view event, std::string_view message, const StartupFields& fields) {
  if (!startup_reporting()) return;
  log_write_raw(startup_line(log_format() == LogFormat::kJson, event, message, fields));
}

StageProgress::StageProgress(std::string event, std::string doing, std::string done, std::string item_name,
                             int64_t total_items, uint64_t total_bytes)
    : event_(std::move(event)),
      doing_(std::move(doing)),
      done_(std::move(done)),
      item_name_(std::move(item_name)),
      total_items_(total_items),
      total_bytes_(total_bytes),
      active_(startup_reporting()),
      start_(std::chrono::steady_clock::now()),
      last_shown_(start_) {
  if (!active_) return;
  const bool json = log_format() == LogFormat::kJson;
  terminal_ = !json && ::isatty(STDERR_FILENO) == 1;
  if (terminal_) {
    log_write_raw("[metrale] " + progress_text(0.0));
    return;
  }
  report_startup(event_ + "_start",
                 fmt::format("{}: {} {}, {}", doing_, total_items_, item_name_, format_bytes(total_bytes_)),
                 {{item_name_ + "_total", total_items_}, {"bytes_total", static_cast<int64_t>(total_bytes_)}});
}

StageProgress::~StageProgress() {
  finish();
}

double StageProgress::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

std::string StageProgress::progress_text(double seconds) const {
  return fmt::format("{}: {}/{} {}, {}/{}, {}", doing_, items_, total_items_, item_name_, format_bytes(bytes_),
                     format_bytes(total_bytes_), rate_text(bytes_, seconds));
}

std::string StageProgress::done_text(double seconds) const {
  return fmt::format("{}: {} {}, {} in {:.1f} s ({})", done_, items_, item_name_, format_bytes(bytes_), seconds,
                     rate_text(bytes_, seconds));
}

void StageProgress::advance(int64_t items, uint64_t bytes) {
  items_ += items;
  bytes_ += bytes;
  if (!active_ || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  if (terminal_) {
    if (now - last_shown_ < kTerminalRedraw) return;
    last_shown_ = now;
    // Back to the line's start, redraw, clear what a longer previous line left.
    log_write_raw("\r[metrale] " + progress_text(seconds()) + "\x1b[K");
  } else if (log_format() == LogFormat::kJson) {
    if (now - last_shown_ < kJsonProgress) return;
    last_shown_ = now;
    report_startup(event_ + "_progress", progress_text(seconds()),
                   {{item_name_, items_},
                    {item_name_ + "_total", total_items_},
                    {"bytes", static_cast<int64_t>(bytes_)},
                    {"bytes_total", static_cast<int64_t>(total_bytes_)}});
  }
}

void StageProgress::finish() {
  if (finished_) return;
  finished_ = true;
  if (!active_) return;
  const double elapsed = seconds();
  if (terminal_) {
    log_write_raw("\r[metrale] " + done_text(elapsed) + "\x1b[K\n");
    return;
  }
  report_startup(event_ + "_done", done_text(elapsed),
                 {{item_name_, items_},
                  {"bytes", static_cast<int64_t>(bytes_)},
                  {"seconds", elapsed},
                  {"bytes_per_second", elapsed > 0.0 ? static_cast<double>(bytes_) / elapsed : 0.0}});
}

}  // namespace metrale
