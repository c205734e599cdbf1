// Programmatic dependent launch (sm_90+): a kernel launched through pdl::launch may be scheduled
// while the kernel before it on the stream still runs, once every block of that kernel has called
// allow_dependents() (or exited). It overlaps its launch and whatever it reads before
// wait_for_producer() with the tail of its predecessor.
//
// The contract of a kernel launched this way: before wait_for_producer() it only reads data that no
// kernel of a forward writes (weights and their scales) and writes nothing; after it, everything the
// earlier kernels of the stream wrote is visible. Every thread that touches activations calls
// wait_for_producer() first. allow_dependents() is a hint any kernel may give at any point; it is a
// no-op when the next kernel was launched without the attribute.
//
// METRALE_PDL=0 in the environment launches everything without the attribute (the A/B switch for
// benchmarks and a way out if a driver mishandles programmatic edges in captured graphs).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "runtime/cuda/cuda_check.h"

namespace metrale::kernels::cuda::pdl {

// Blocks until every kernel this one depends on has completed and its writes are visible.
__device__ __forceinline__ void wait_for_producer() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel (if launched through pdl::launch) be scheduled once every block has called this.
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The first statement of a kernel launched through pdl::launch that has nothing to stage: its launch
// overlaps the producer's tail, and its own dependent may be scheduled once it runs.
__device__ __forceinline__ void wait_then_allow_dependents() {
  wait_for_producer();
  allow_dependents();
}

// The before_inputs hook of the GEMV building blocks (gemm_gemv.cuh, fp8_gemv.cuh) in a kernel
// launched through pdl::launch: wait for the inputs, then let the next kernel be scheduled.
struct WaitForInputs {
  __device__ __forceinline__ void operator()() const { wait_then_allow_dependents(); }
};

// Whether launches carry the programmatic-serialization attribute: on unless METRALE_PDL=0, and only
// on devices of compute capability 9.0 and up (older ones would reject the attribute).
inline bool enabled() {
  static const bool on = [] {
    const char* setting = std::getenv("METRALE_PDL");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
    int device = 0, major = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
    return major >= 9;
  }();
  return on;
}

// kernel<<<grid, block, smem, stream>>>(args...), allowed to overlap its predecessor on `stream`.
// The legacy default stream keeps plain serialisation.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = enabled() && stream != nullptr ? 1 : 0;
  METRALE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace metrale::kernels::cuda::pdl
