#include "core/error.h"

namespace metrale {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kNotFound: return "not_found";
    case ErrorCode::kBadFormat: return "bad_format";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kOutOfMemory: return "out_of_memory";
    case ErrorCode::kUnavailable: return "unavailable";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown";
}

void raise_message(ErrorCode code, const std::string& message) { throw Error(code, message); }

void fail_check(const char* condition, const std::string& message, const std::source_location& where) {
  std::string text = fmt::format("internal check failed: {} at {}:{}", condition, where.file_name(), where.line());
  if (!message.empty()) text += " (" + message + ")";
  throw Error(ErrorCode::kInternal, std::move(text));
}

}  // namespace metrale
