// The chunk index of the chunked linear-attention kernels (GDN, KDA): every chunk of kChunk rows of
// every sequence of a ragged batch gets one index c, computed on the device from cu_q, so that a
// grid over all chunks can be launched (and captured) without the host knowing the lengths. A CTA
// finds the sequence of its chunk c with sequence_of(offsets, num_seqs, c) (common.cuh).
#pragma once

#include <cstddef>
#include <cstdint>

namespace metrale::kernels::cuda::chunks {

// Upper bound of sum_s ceil(q_len_s / kChunk) for T tokens in S sequences.
inline int64_t max_chunks(int64_t tokens, int64_t num_seqs, int64_t chunk) {
  return (tokens + (chunk - 1) * num_seqs) / chunk;
}

// Bytes of the [S + 1] i32 offsets in a workspace, rounded up so that what follows stays aligned.
inline size_t offsets_bytes(int64_t num_seqs) {
  return (static_cast<size_t>(num_seqs + 1) * 4 + 255) / 256 * 256;
}

// offsets[0..S]: exclusive prefix sum of ceil(q_len / kChunk). One CTA of 1024 threads. A template,
// so that every translation unit that launches it has its own instance.
template <int kChunk>
__global__ void __launch_bounds__(1024) offsets_kernel(const int32_t* cu_q, int num_seqs, int32_t* offsets) {
  __shared__ int warp_totals[32];
  __shared__ int carry;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    carry = 0;
    offsets[0] = 0;
  }
  __syncthreads();
  for (int base = 0; base < num_seqs; base += 1024) {
    const int s = base + static_cast<int>(threadIdx.x);
    int x = s < num_seqs ? (cu_q[s + 1] - cu_q[s] + kChunk - 1) / kChunk : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, offset);
      if (lane >= offset) x += y;
    }
    if (lane == 31) warp_totals[warp] = x;
    __syncthreads();
    if (warp == 0) {
      int t = warp_totals[lane];
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, t, offset);
        if (lane >= offset) t += y;
      }
      warp_totals[lane] = t;
    }
    __syncthreads();
    const int inclusive = carry + (warp > 0 ? warp_totals[warp - 1] : 0) + x;
    if (s < num_seqs) offsets[s + 1] = inclusive;
    __syncthreads();
    if (threadIdx.x == 1023) carry = inclusive;
    __syncthreads();
  }
}

}  // namespace metrale::kernels::cuda::chunks
