// The error type and codes, without the formatting helpers of core/error.h. Code compiled by nvcc
// includes only this header (fmt's compile-time format checks do not build under nvcc).
#pragma once

#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>

namespace metrale {

enum class ErrorCode {
  kInvalidArgument,   // bad user input: flags, request fields, token ids
  kNotFound,          // a file, tensor or key that should exist does not
  kBadFormat,         // a file exists but is malformed (safetensors header, config.json, tokenizer.json)
  kUnsupported,       // well-formed but not supported (unknown model_type, dtype, feature)
  kOutOfMemory,       // an allocation or the cache budget cannot be satisfied
  kUnavailable,       // the system refuses a resource: an address in use, threads that cannot start
  kInternal,          // a broken invariant: a bug in metrale
};

std::string_view error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string message) : std::runtime_error(std::move(message)), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

[[noreturn]] void raise_message(ErrorCode code, const std::string& message);

[[noreturn]] void fail_check(const char* condition, const std::string& message,
                             const std::source_location& where);

}  // namespace metrale

// Internal invariant check with a plain message (no formatting), usable in nvcc-compiled code.
#define METRALE_EXPECT(cond, message)                                                           \
  do {                                                                                          \
    if (!(cond)) [[unlikely]]                                                                   \
      ::metrale::fail_check(#cond, (message), std::source_location::current());                 \
  } while (0)
