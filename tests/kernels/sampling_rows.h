// Per-row sampling settings shared by the CPU and CUDA sampling tests (header-only: each floor's
// test binary compiles only its own folder's sources).
#pragma once

#include <cstdint>

namespace metrale::testing {

struct RowSettings {
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  uint64_t seed = 0;
  uint64_t step = 0;
};

}  // namespace metrale::testing
