#include <cstdio>
#include <cstdlib>

#include "fuzz_input.h"

namespace metrale::fuzz {

void invariant_failed(const char* what, std::string_view detail) {
  std::fprintf(stderr, "fuzz invariant failed: %s %.*s\n", what, static_cast<int>(detail.size()), detail.data());
  std::abort();
}

}  // namespace metrale::fuzz
