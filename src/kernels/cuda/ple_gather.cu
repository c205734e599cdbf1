// PLE row gather on the GPU (semantics in kernels/ple_gather.h): one thread per 16-byte chunk of an
// output row when rows are 16-byte multiples and aligned (bf16 d_head 160: 20 chunks a row), else
// one thread per element with a dtype conversion. The table pointer is either device memory or host
// memory mapped into the device's address space; either way every chunk is read exactly once, and
// a warp's 32 chunks cover 1-2 consecutive rows, so a zero-copy read moves whole rows over the link.
#include <cstdint>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/ple_gather.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kThreads = 256;

struct GatherArgs {
  const void* table;  // [rows, width]
  const int64_t* ids;  // [T, NH]
  void* out;           // [T, NH * width], row stride out_row elements
  int64_t out_row;        // elements
  int64_t out_row_bytes;  // bytes
  int64_t rows;
  int64_t items;  // T * NH
  int heads;
  int width;
};

__global__ void __launch_bounds__(kThreads) gather_chunks_kernel(GatherArgs a, int chunks_per_row) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= a.items * chunks_per_row) return;
  const int64_t item = index / chunks_per_row;
  const int chunk = static_cast<int>(index % chunks_per_row);
  const int64_t id = __ldg(a.ids + item);
  const int64_t t = item / a.heads;
  const int h = static_cast<int>(item % a.heads);
  uint4 value = make_uint4(0u, 0u, 0u, 0u);
  if (id >= 0 && id < a.rows) value = reinterpret_cast<const uint4*>(a.table)[id * chunks_per_row + chunk];
  uint4* out_row = reinterpret_cast<uint4*>(static_cast<char*>(a.out) + t * a.out_row_bytes) +
                   static_cast<int64_t>(h) * chunks_per_row;
  out_row[chunk] = value;
}

template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads) gather_elements_kernel(GatherArgs a) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (index >= a.items * a.width) return;
  const int64_t item = index / a.width;
  const int e = static_cast<int>(index % a.width);
  const int64_t id = __ldg(a.ids + item);
  const int64_t t = item / a.heads;
  const int h = static_cast<int>(item % a.heads);
  const float value = id >= 0 && id < a.rows ? to_f32(static_cast<const In*>(a.table)[id * a.width + e]) : 0.0f;
  static_cast<Out*>(a.out)[t * a.out_row + static_cast<int64_t>(h) * a.width + e] = from_f32<Out>(value);
}

template <typename In>
void launch_elements(const GatherArgs& a, DType out_dtype, cudaStream_t stream) {
  const int blocks = ceil_div(a.items * a.width, kThreads);
  switch (out_dtype) {
    case DType::kF32: gather_elements_kernel<In, float><<<blocks, kThreads, 0, stream>>>(a); break;
    case DType::kBF16: gather_elements_kernel<In, __nv_bfloat16><<<blocks, kThreads, 0, stream>>>(a); break;
    case DType::kF16: gather_elements_kernel<In, __half><<<blocks, kThreads, 0, stream>>>(a); break;
    default: raise_message(ErrorCode::kUnsupported, "ple_gather (cuda): out dtype " + std::string(dtype_name(out_dtype)));
  }
}

}  // namespace

void ple_gather(const Tensor& table, const Tensor& ids, const Tensor& out) {
  METRALE_EXPECT(out.device().is_cuda() && ids.device().is_cuda(),
                 "ple_gather: out and ids must be on the GPU (" + out.describe() + ", " + ids.describe() + ")");
  METRALE_EXPECT(table.ndim() == 2 && table.is_contiguous() && ids.ndim() == 2 && ids.dtype() == DType::kI64 &&
                     ids.is_contiguous() && out.ndim() == 2 && out.stride(1) == 1,
                 "ple_gather: table " + table.describe() + " ids " + ids.describe() + " out " + out.describe());
  const int64_t rows = table.size(0), width = table.size(1), tokens = ids.size(0), heads = ids.size(1);
  METRALE_EXPECT(out.size(0) == tokens && out.size(1) == heads * width && width > 0 && heads > 0 &&
                     width <= INT32_MAX && heads <= INT32_MAX,
                 "ple_gather: out " + out.describe() + " for ids " + ids.describe() + " and table " + table.describe());
  if (tokens == 0) return;
  GatherArgs a{};
  a.table = table.data();
  a.ids = ids.data_as<const int64_t>();
  a.out = out.data();
  a.out_row = out.stride(0);
  a.out_row_bytes = out.stride(0) * static_cast<int64_t>(out.element_size());
  a.rows = rows;
  a.items = tokens * heads;
  a.heads = static_cast<int>(heads);
  a.width = static_cast<int>(width);
  const cudaStream_t stream = stream_of(out);
  const auto row_bytes = static_cast<int64_t>(width * static_cast<int64_t>(table.element_size()));
  const bool vectorised = table.dtype() == out.dtype() && row_bytes % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(table.data()) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(out.data()) % 16 == 0 &&
                          (out.stride(0) * static_cast<int64_t>(out.element_size())) % 16 == 0;
  if (vectorised) {
    const auto chunks = static_cast<int>(row_bytes / 16);
    gather_chunks_kernel<<<ceil_div(a.items * chunks, kThreads), kThreads, 0, stream>>>(a, chunks);
  } else {
    switch (table.dtype()) {
      case DType::kF32: launch_elements<float>(a, out.dtype(), stream); break;
      case DType::kBF16: launch_elements<__nv_bfloat16>(a, out.dtype(), stream); break;
      case DType::kF16: launch_elements<__half>(a, out.dtype(), stream); break;
      default:
        raise_message(ErrorCode::kUnsupported,
                      "ple_gather (cuda): table dtype " + std::string(dtype_name(table.dtype())));
    }
  }
  METRALE_CHECK_LAUNCH("ple_gather");
}

}  // namespace metrale::kernels::cuda
