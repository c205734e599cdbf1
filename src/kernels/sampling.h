// Token sampling for many rows of logits at once, with per-row parameters in small device arrays,
// so that a decode step can sample on the GPU without copying the logits to the host.
//
// The decision is the engine's CPU Sampler's (engine/sampler.h) for the same row and parameters,
// without penalties (the engine applies those on its host path):
//   greedy    temperature <= 1e-5: argmax, ties -> lowest id
//   weights   w_i = exp_nonpositive((x_i - max) / temperature), the Sampler's float formula, bit for bit
//   top-k     (0 < k < V) keep the k most likely tokens
//   top-p     (p < 1) keep the shortest most-likely prefix whose mass reaches p x the kept mass
//   min-p     (min_p > 0) keep the tokens with w_i >= min_p
//   draw      u = rng::uniform_for(seed, step); the first kept token, in descending probability, whose
//             running mass exceeds u x the kept mass
// "Descending probability" is (logit desc, id asc): every tie is broken by the lower id.
//
// Exactness. Both implementations here (cpu:: and cuda::) sum weights in 128-bit fixed point
// (floor(w x 2^100), see fixed_weight below): integer sums do not depend on the order of summation, so
// the two always pick the same token, whatever the thread layout. The Sampler sums the same float
// weights in double; the two can differ only when a threshold falls within double rounding (~1e-16
// relative) of a running mass, or a token's weight is below 2^-100 of the maximum's.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "core/random.h"
#include "kernels/dispatch.h"

namespace metrale::kernels {

// Per-row parameters, each a [R] tensor on the device of the logits. Their values must satisfy
// SamplingParams::validate() (the engine validates requests on admission). The CPU implementation
// throws kInvalidArgument for values out of range; the CUDA one cannot throw and treats them as
// follows: temperature NaN or not above 1e-5: greedy; +inf temperature: greedy; top_k outside
// [1, V): off; top_p outside (0, 1): off; min_p NaN or <= 0: off, > 1: as 1.
struct SamplingRowParams {
  Tensor temperature;  // [R] f32
  Tensor top_k;        // [R] i32, 0 or -1: off
  Tensor top_p;        // [R] f32, 1: off
  Tensor min_p;        // [R] f32, 0: off
  Tensor seed;         // [R] i64, the bits of the request's u64 seed
  Tensor step;         // [R] i64, index of the token being sampled within the request's output
};

// logits [R, V] f32 (row stride >= V, last dim contiguous), V < 2^27; tokens [R] i32; logprobs [R] f32
// (log-softmax of the raw logits at the chosen token). A row holding NaN or +inf, or only -inf, is a
// bug upstream: the CPU throws kInternal, the CUDA kernel writes token -1 and a NaN logprob (the
// caller checks tokens when it reads them back).
//
// CUDA: one CTA of 512 threads per row, ~153 KB of shared memory, no workspace, graph-safe.
METRALE_DECLARE_OP_IMPLS(sample_tokens, (const Tensor& logits, const SamplingRowParams& params,
                                         const Tensor& tokens, const Tensor& logprobs))

inline void sample_tokens(const Tensor& logits, const SamplingRowParams& params, const Tensor& tokens,
                          const Tensor& logprobs) {
  METRALE_KERNEL_DISPATCH(sample_tokens, tokens.device(), logits, params, tokens, logprobs);
}

// Arithmetic shared by the CPU and CUDA implementations. Every float operation is written as an
// explicitly rounded operation, so that nvcc cannot fuse a multiply and an add into an FMA (which
// would change the bits); the host code is compiled without contraction (ISO C++ mode) on x86-64-v2,
// which has no FMA.
namespace sampling_detail {

// 128-bit unsigned integer (GCC/Clang and nvcc host and device code).
__extension__ typedef unsigned __int128 Fixed128;

inline constexpr float kGreedyTemperature = 1e-5f;  // SamplingParams::kGreedyTemperature
inline constexpr int kFixedPointBits = 100;         // weights in units of 2^-100

METRALE_HOST_DEVICE inline uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  return std::bit_cast<uint32_t>(x);
#endif
}
METRALE_HOST_DEVICE inline float bits_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  return std::bit_cast<float>(bits);
#endif
}
METRALE_HOST_DEVICE inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
METRALE_HOST_DEVICE inline float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
METRALE_HOST_DEVICE inline float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
METRALE_HOST_DEVICE inline float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The Sampler's exp_nonpositive (engine/sampler.cpp), operation for operation: e^x for x <= 0, with
// results below e^-87 flushed to 0. Not monotone to the last bit (a few thousand 1-ulp inversions
// for x in [-0.25, -0.12]), which is why min-p is applied per token, not as a logit threshold.
METRALE_HOST_DEVICE inline float exp_nonpositive(float x) {
  constexpr uint32_t kFlushBelowBits = 0xc2ae0000u;  // -87.0f
  constexpr float kLog2e = 1.44269502163f;
  constexpr float kLn2High = 0.693145751953125f;
  constexpr float kLn2Low = 1.428606765330187e-06f;
  constexpr float kRoundingShift = 12582912.0f;
  const uint32_t bits = float_bits(x);
  const uint32_t flush_mask = bits > kFlushBelowBits ? 0xffffffffu : 0u;
  const float clamped = bits_float((bits & ~flush_mask) | (kFlushBelowBits & flush_mask));
  const float n = sub_rn(add_rn(mul_rn(clamped, kLog2e), kRoundingShift), kRoundingShift);
  const float r = sub_rn(sub_rn(clamped, mul_rn(n, kLn2High)), mul_rn(n, kLn2Low));
  float p = 1.0f / 5040.0f;
  p = add_rn(mul_rn(p, r), 1.0f / 720.0f);
  p = add_rn(mul_rn(p, r), 1.0f / 120.0f);
  p = add_rn(mul_rn(p, r), 1.0f / 24.0f);
  p = add_rn(mul_rn(p, r), 1.0f / 6.0f);
  p = add_rn(mul_rn(p, r), 0.5f);
  p = add_rn(mul_rn(p, r), 1.0f);
  p = add_rn(mul_rn(p, r), 1.0f);
  const int32_t biased_exponent = static_cast<int32_t>(n) + 127;
  const float two_to_n = bits_float(static_cast<uint32_t>(biased_exponent) << 23);
  return bits_float(float_bits(mul_rn(p, two_to_n)) & ~flush_mask);
}

// The sampling weight of a logit: 1 for the maximum, in [0, 1] for every other logit.
METRALE_HOST_DEVICE inline float weight_of(float logit, float max_logit, float temperature) {
  return exp_nonpositive(div_rn(sub_rn(logit, max_logit), temperature));
}

// Order-preserving map of a float's bits to uint32 (for non-NaN x < y: key(x) < key(y); -0 just below
// +0). The raw key orders the row for its maximum, as the Sampler's ordered_key does.
METRALE_HOST_DEVICE inline uint32_t raw_key(float x) {
  const uint32_t bits = float_bits(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
METRALE_HOST_DEVICE inline float from_raw_key(uint32_t key) {
  return bits_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}
// The rank key: like raw_key, with -0 merged into +0 so that logits that compare equal share a key. A
// higher key is strictly more likely; an equal key means "ask the id" (lower id first).
METRALE_HOST_DEVICE inline uint32_t sort_key(float x) { return raw_key(add_rn(x, 0.0f)); }

// floor(w x 2^100) for a weight w in [0, 1], exactly (w = mantissa x 2^(exponent - 150)).
METRALE_HOST_DEVICE inline Fixed128 fixed_weight(float w) {
  const uint32_t bits = float_bits(w);
  const int biased_exponent = static_cast<int>(bits >> 23);
  const Fixed128 mantissa = static_cast<Fixed128>((bits & 0x7fffffu) | (biased_exponent != 0 ? 0x800000u : 0u));
  const int shift = biased_exponent - 150 + kFixedPointBits;  // <= 77 for w <= 1
  if (shift >= 0) return mantissa << shift;
  return shift > -24 ? mantissa >> (-shift) : 0;
}

// A 128-bit mass as a double (both halves converted with round-to-nearest, then one rounded add):
// the same bits on host and device.
METRALE_HOST_DEVICE inline double fixed_to_double(Fixed128 value) {
  const uint64_t high = static_cast<uint64_t>(value >> 64), low = static_cast<uint64_t>(value);
#ifdef __CUDA_ARCH__
  return __dadd_rn(__dmul_rn(__ull2double_rn(high), 0x1p64), __ull2double_rn(low));
#else
  return static_cast<double>(high) * 0x1p64 + static_cast<double>(low);
#endif
}

// For a double x in [0, 2^127) that is integral or not: floor(x) and ceil(x) as 128-bit integers.
// x - high x 2^64 is exact (it keeps a subset of x's significand bits).
METRALE_HOST_DEVICE inline Fixed128 fixed_from_double(double x, bool round_up) {
#ifdef __CUDA_ARCH__
  const double high = floor(__dmul_rn(x, 0x1p-64));
  const double low = __dsub_rn(x, __dmul_rn(high, 0x1p64));
  const double low_rounded = round_up ? ceil(low) : floor(low);
  return (static_cast<Fixed128>(__double2ull_rz(high)) << 64) + __double2ull_rz(low_rounded);
#else
  const double high = std::floor(x * 0x1p-64);
  const double low = x - high * 0x1p64;
  const double low_rounded = round_up ? std::ceil(low) : std::floor(low);
  return (static_cast<Fixed128>(static_cast<uint64_t>(high)) << 64) + static_cast<uint64_t>(low_rounded);
#endif
}

// Thresholds in units of 2^-100. top-p: the cut is the first token whose running mass reaches
// (>=) top_p x kept mass; the draw: the first token whose running mass exceeds (>) u x kept mass, i.e.
// reaches floor(u x mass) + 1. Both are at least 1, so a crossing token always has a positive weight.
METRALE_HOST_DEVICE inline double dmul_rn(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
METRALE_HOST_DEVICE inline Fixed128 top_p_target(float top_p, Fixed128 kept_mass) {
  const Fixed128 target = fixed_from_double(dmul_rn(static_cast<double>(top_p), fixed_to_double(kept_mass)), true);
  return target > 0 ? target : 1;
}
METRALE_HOST_DEVICE inline Fixed128 draw_target(float uniform, Fixed128 kept_mass) {
  return fixed_from_double(dmul_rn(static_cast<double>(uniform), fixed_to_double(kept_mass)), false) + 1;
}

}  // namespace sampling_detail
}  // namespace metrale::kernels
