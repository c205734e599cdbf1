// How an op header routes a call to its CPU or CUDA implementation. Every op lives in
// kernels/<op>.h with `cpu::` (kernels/cpu/<op>.cpp) and, in CUDA builds, `cuda::`
// (kernels/cuda/<op>.cu) implementations taking the same arguments.
#pragma once

#include <string>

#include "core/error_base.h"
#include "runtime/tensor.h"

namespace metrale::kernels {

[[noreturn]] inline void fail_no_cuda(const char* op) {
  raise_message(ErrorCode::kUnsupported, std::string("kernel ") + op + ": this build of metrale has no CUDA support");
}

}  // namespace metrale::kernels

#if METRALE_WITH_CUDA
#define METRALE_KERNEL_DISPATCH(op, device, ...) \
  do {                                          \
    if ((device).is_cpu()) {                    \
      ::metrale::kernels::cpu::op(__VA_ARGS__); \
    } else {                                    \
      ::metrale::kernels::cuda::op(__VA_ARGS__); \
    }                                           \
  } while (0)
#else
#define METRALE_KERNEL_DISPATCH(op, device, ...)     \
  do {                                               \
    if ((device).is_cpu()) {                         \
      ::metrale::kernels::cpu::op(__VA_ARGS__);      \
    } else {                                         \
      ::metrale::kernels::fail_no_cuda(#op);         \
    }                                                \
  } while (0)
#endif

// Declares an op's CPU and CUDA entry points and defines the dispatching wrapper. `first` is the
// tensor whose device decides where the op runs.
#define METRALE_DECLARE_OP_IMPLS(op, signature) \
  namespace cpu {                               \
  void op signature;                            \
  }                                             \
  namespace cuda {                              \
  void op signature;                            \
  }
