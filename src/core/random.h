// Counter-based random numbers shared by host and device code: the sampler's uniform for
// (seed, step) must be the same bits on the CPU and in the CUDA sampling kernel, so both include
// this header. Everything here is integer arithmetic modulo 2^64 plus one exact float conversion,
// so host and device agree bit for bit.
#pragma once

#include <cstdint>

// Marks a function callable from host and device code when compiled by nvcc; plain inline otherwise.
#ifndef METRALE_HOST_DEVICE
#ifdef __CUDACC__
#define METRALE_HOST_DEVICE __host__ __device__
#else
#define METRALE_HOST_DEVICE
#endif
#endif

// In namespace rng; engine/sampler.h brings the two names into namespace metrale.
namespace metrale::rng {

// The stateless SplitMix64 step: output number `index` (0-based) of the SplitMix64 generator whose
// state starts at `state` (Steele, Lea and Flood 2014; Vigna's splitmix64.c). With state 0 the
// outputs are 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, ...
METRALE_HOST_DEVICE inline uint64_t splitmix64_at(uint64_t state, uint64_t index) {
  uint64_t z = state + (index + 1) * 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The sampler's uniform in [0, 1 - 2^-24] for (seed, step); it depends on nothing else, so a
// request's tokens do not depend on what else is in the batch:
//   key  = splitmix64_at(seed, 0)     // decorrelates neighbouring seeds
//   bits = splitmix64_at(key, step)   // output `step` of the stream started at key
//   u    = float(bits >> 40) * 2^-24  // 24 bits: the conversion and the scaling are exact
METRALE_HOST_DEVICE inline float uniform_for(uint64_t seed, uint64_t step) {
  const uint64_t key = splitmix64_at(seed, 0);
  const uint64_t bits = splitmix64_at(key, step);
  return static_cast<float>(static_cast<uint32_t>(bits >> 40)) * 0x1p-24f;
}

}  // namespace metrale::rng
