#include <cstdio>
#include <cstdlib>

#include "core/log_level.h"
#include "fuzz_input.h"

namespace metrale::fuzz {

void invariant_failed(const char* what, std::string_view detail) {
  std::fprintf(stderr, "fuzz invariant failed: %s %.*s\n", what, static_cast<int>(detail.size()), detail.data());
  std::abort();
}

}  // namespace metrale::fuzz

// libFuzzer calls this once before the first input: the loaders' warnings (an added token moved,
// a token missing from the vocabulary) would otherwise print on every run.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  metrale::set_log_level(metrale::LogLevel::kError);
  return 0;
}
