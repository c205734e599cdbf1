// Fills a tensor with pseudo-random normal values from a counter-based generator: element i gets
// the same value on every device for the same seed (used for random-weight benchmarks and tests).
#pragma once

#include <math.h>

#include <cstdint>

#include "kernels/dispatch.h"

namespace metrale::kernels {

struct RandomFillParams {
  uint64_t seed = 0;
  float mean = 0.0f;
  float stddev = 1.0f;
};

// out: any shape, contiguous, f32|bf16|f16|f8e4m3 (e4m3: rounded to nearest even, saturated at +-448).
METRALE_DECLARE_OP_IMPLS(random_fill, (const Tensor& out, const RandomFillParams& params))

inline void random_fill(const Tensor& out, const RandomFillParams& params) {
  METRALE_KERNEL_DISPATCH(random_fill, out.device(), out, params);
}

// The value of element `index`: a Box-Muller normal from two 24-bit uniforms of a splitmix64 hash
// of (seed, index). Shared by both implementations.
#ifdef __CUDACC__
__host__ __device__
#endif
inline float random_normal_at(uint64_t seed, uint64_t index, float mean, float stddev) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (index + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const float u1 = (static_cast<float>(z >> 40) + 1.0f) * (1.0f / 16777217.0f);  // (0, 1]
  const float u2 = static_cast<float>((z >> 16) & 0xFFFFFFull) * (1.0f / 16777216.0f);
  // sqrt(-2 ln u1) cos(2 pi u2): precision is irrelevant here, only determinism per device.
  const float radius = sqrtf(-2.0f * logf(u1));
  return mean + stddev * radius * cosf(6.2831853f * u2);
}

}  // namespace metrale::kernels
