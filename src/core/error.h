// Errors with context. Inside the engine every failure is an exception derived from metrale::Error;
// the CLI and the server turn them into a one-line message or an OpenAI-style error body.
#pragma once

#include <fmt/format.h>

#include <source_location>

#include "core/error_base.h"

namespace metrale {

template <typename... Args>
[[noreturn]] void raise(ErrorCode code, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(code, fmt::format(format, std::forward<Args>(args)...));
}

// Prefixes the message of an in-flight metrale::Error with context ("layer 3 (attention): ...").
// Usage: try { ... } catch (Error& e) { rethrow_with_context(e, "layer {}", i); }
template <typename... Args>
[[noreturn]] void rethrow_with_context(const Error& inner, fmt::format_string<Args...> format,
                                       Args&&... args) {
  throw Error(inner.code(), fmt::format(format, std::forward<Args>(args)...) + ": " + inner.what());
}

}  // namespace metrale

// Checks an internal invariant; a failure is a bug in metrale (ErrorCode::kInternal) and names the
// source location. User-facing validation uses raise() with a specific code instead.
#define METRALE_CHECK(cond, ...)                                                              \
  do {                                                                                        \
    if (!(cond)) [[unlikely]]                                                                 \
      ::metrale::fail_check(#cond, ::fmt::format("" __VA_ARGS__), std::source_location::current()); \
  } while (0)
