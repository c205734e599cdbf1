// Embedding gather on the GPU: one CTA per token copies its table row.
#include "kernels/cuda/common.cuh"
#include "kernels/embedding.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kThreads = 128;

// Same dtype, 16-byte aligned rows: a plain copy of uint4 vectors. table [V, row_vectors] with a row
// stride of table_stride vectors; out [T, row_vectors] with out_stride. An id outside [0, V) gets a
// row of zeros: the kernel cannot throw, and the engine validates ids before they reach the GPU
// (Engine::add_request), so such a row means a bug upstream, made visible rather than a wild read.
// A vocabulary shard (embedding_shard) passes the id of its first row: id - first_id indexes it.
__global__ void __launch_bounds__(kThreads) embedding_copy_kernel(const int32_t* __restrict__ ids,
                                                                  const uint4* __restrict__ table,
                                                                  int64_t table_stride, int64_t vocab,
                                                                  uint4* __restrict__ out, int64_t out_stride,
                                                                  int row_vectors, int64_t first_id) {
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t] - first_id;
  uint4* dst = out + t * out_stride;
  if (id < 0 || id >= vocab) {
    for (int i = threadIdx.x; i < row_vectors; i += kThreads) dst[i] = make_uint4(0, 0, 0, 0);
    return;
  }
  const uint4* src = table + id * table_stride;
  for (int i = threadIdx.x; i < row_vectors; i += kThreads) dst[i] = __ldg(src + i);
}

// Any float dtypes (or unaligned rows): element by element through fp32.
template <typename TTable, typename TOut>
__global__ void __launch_bounds__(kThreads) embedding_convert_kernel(const int32_t* __restrict__ ids,
                                                                     const TTable* __restrict__ table,
                                                                     int64_t table_stride, int64_t vocab,
                                                                     TOut* __restrict__ out, int64_t out_stride,
                                                                     int hidden, int64_t first_id) {
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t] - first_id;
  TOut* dst = out + t * out_stride;
  const bool valid = id >= 0 && id < vocab;
  const TTable* src = table + (valid ? id : 0) * table_stride;
  for (int i = threadIdx.x; i < hidden; i += kThreads) dst[i] = from_f32<TOut>(valid ? to_f32(src[i]) : 0.0f);
}

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }


void lookup_rows(const Tensor& ids, const Tensor& table, int64_t first_id, const Tensor& out) {
  METRALE_EXPECT(ids.device().is_cuda() && table.device().is_cuda() && out.device().is_cuda(),
                 "embedding: tensors must be on the GPU");
  METRALE_EXPECT(ids.dtype() == DType::kI32 && ids.ndim() == 1 && (ids.numel() <= 1 || ids.stride(0) == 1),
                 "embedding ids " + ids.describe());
  METRALE_EXPECT(table.ndim() == 2 && table.stride(1) == 1 && out.ndim() == 2 && out.stride(1) == 1,
                 "embedding table " + table.describe() + " out " + out.describe());
  const int64_t tokens = ids.numel(), vocab = table.size(0), hidden = table.size(1);
  METRALE_EXPECT(out.size(0) == tokens && out.size(1) == hidden, "embedding out " + out.describe());
  if (tokens == 0 || hidden == 0) return;
  METRALE_EXPECT(tokens <= INT32_MAX && hidden <= INT32_MAX, "embedding: too large");
  const int64_t row_bytes = hidden * static_cast<int64_t>(out.element_size());
  const bool vector_copy = table.dtype() == out.dtype() && row_bytes % 16 == 0 && aligned16(table.data()) &&
                           aligned16(out.data()) &&
                           (table.stride(0) * static_cast<int64_t>(table.element_size())) % 16 == 0 &&
                           (out.stride(0) * static_cast<int64_t>(out.element_size())) % 16 == 0;
  const auto grid = static_cast<unsigned int>(tokens);
  if (vector_copy) {
    const int64_t vector_elements = 16 / static_cast<int64_t>(out.element_size());
    embedding_copy_kernel<<<grid, kThreads, 0, stream_of(out)>>>(
        ids.data_as<const int32_t>(), static_cast<const uint4*>(table.data()), table.stride(0) / vector_elements, vocab,
        static_cast<uint4*>(out.data()), out.stride(0) / vector_elements, static_cast<int>(row_bytes / 16),
        first_id);
    METRALE_CHECK_LAUNCH("embedding_copy_kernel");
    return;
  }
  METRALE_DISPATCH_FLOAT(table.dtype(), "embedding table", [&] {
    using table_t = scalar_t;
    METRALE_DISPATCH_FLOAT(out.dtype(), "embedding out", [&] {
      embedding_convert_kernel<table_t, scalar_t><<<grid, kThreads, 0, stream_of(out)>>>(
          ids.data_as<const int32_t>(), table.data_as<const table_t>(), table.stride(0), vocab,
          out.data_as<scalar_t>(), out.stride(0), static_cast<int>(hidden), first_id);
    });
  });
  METRALE_CHECK_LAUNCH("embedding_convert_kernel");
}

}  // namespace

void embedding(const Tensor& ids, const Tensor& table, const Tensor& out) { lookup_rows(ids, table, 0, out); }

void embedding_shard(const Tensor& ids, const Tensor& table, int64_t first_id, const Tensor& out) {
  lookup_rows(ids, table, first_id, out);
}

}  // namespace metrale::kernels::cuda
