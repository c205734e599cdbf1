// FP8 (e4m3) KV-cache elements on the device: quantising a key or value with its head's scale
// (kernels/attention.h: KvScales) and widening cached codes back to bf16 for the tensor cores.
// Every e4m3 value is exactly representable in fp16 and in bf16, so the widening loses nothing; the
// scales are applied in fp32 by the kernels that read the cache.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace metrale::kernels::cuda {

// Rounds x / scale to the nearest e4m3 value (ties to even), saturating to +-448; NaN stays NaN.
// The same as the CPU's f32_to_f8e4m3_bits(x / scale) (IEEE division on both sides).
__device__ __forceinline__ uint8_t e4m3_quantize(float x, float scale) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float e4m3_to_float(uint8_t code) {
  const __half_raw raw = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(raw));
}

// Two e4m3 codes (the low and high byte of `pair`) as one packed bf16x2, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint16_t pair) {
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  const float2 values = __half22float2(__half2(raw));
  const __nv_bfloat162 packed = __floats2bfloat162_rn(values.x, values.y);
  return *reinterpret_cast<const uint32_t*>(&packed);
}

// 16 e4m3 codes (one 16-byte chunk) as 16 bf16 in two 16-byte chunks, in order.
__device__ __forceinline__ void e4m3x16_to_bf16(uint4 codes, uint4& low, uint4& high) {
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = e4m3x2_to_bf16x2(static_cast<uint16_t>(words[i] & 0xffffu));
    out[2 * i + 1] = e4m3x2_to_bf16x2(static_cast<uint16_t>(words[i] >> 16));
  }
  low = make_uint4(out[0], out[1], out[2], out[3]);
  high = make_uint4(out[4], out[5], out[6], out[7]);
}

}  // namespace metrale::kernels::cuda
