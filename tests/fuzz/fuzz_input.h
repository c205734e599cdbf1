// Helpers for the libFuzzer targets of tests/fuzz: a reader that splits one fuzz input into the
// pieces a target needs (choices, lengths, strings), deterministically.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace metrale::fuzz {

class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(reinterpret_cast<const char*>(data), size) {}

  bool empty() const { return data_.empty(); }
  // One byte (0 once exhausted).
  uint8_t byte() {
    if (data_.empty()) return 0;
    const auto value = static_cast<uint8_t>(data_.front());
    data_.remove_prefix(1);
    return value;
  }
  // Up to `n` bytes.
  std::string_view take(size_t n) {
    const std::string_view piece = data_.substr(0, std::min(n, data_.size()));
    data_.remove_prefix(piece.size());
    return piece;
  }
  // The text up to the next `separator` (dropped), or the rest.
  std::string_view until(char separator) {
    const size_t at = data_.find(separator);
    const std::string_view piece = data_.substr(0, at);
    data_.remove_prefix(at == std::string_view::npos ? data_.size() : at + 1);
    return piece;
  }
  std::string_view rest() {
    const std::string_view piece = data_;
    data_ = {};
    return piece;
  }

 private:
  std::string_view data_;
};

// A failed invariant: abort, so that libFuzzer (and the corpus replay test) report the input.
[[noreturn]] void invariant_failed(const char* what, std::string_view detail = {});

}  // namespace metrale::fuzz

#define FUZZ_CHECK(cond, ...)                                          \
  do {                                                                 \
    if (!(cond)) ::metrale::fuzz::invariant_failed(#cond __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)
