// Ragged-batch metadata owned by a kernel test (header-only, for the CPU and CUDA test floors): the
// query offsets, kv lengths and state slots of attention.h's batch layout as host vectors, with
// views over them; and the per-head view of a projection's columns.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/tensor.h"

namespace metrale::testing {

struct RaggedBatch {
  std::vector<int32_t> cu_q{0}, kv_lens, slots;
  Tensor cu() { return Tensor(cu_q.data(), DType::kI32, {static_cast<int64_t>(cu_q.size())}); }
  Tensor lens() { return Tensor(kv_lens.data(), DType::kI32, {static_cast<int64_t>(kv_lens.size())}); }
  Tensor state_slots() { return Tensor(slots.data(), DType::kI32, {static_cast<int64_t>(slots.size())}); }
  int64_t tokens() const { return cu_q.back(); }
  int64_t size() const { return static_cast<int64_t>(kv_lens.size()); }
  int64_t q_len(int64_t s) const { return cu_q[static_cast<size_t>(s) + 1] - cu_q[static_cast<size_t>(s)]; }
  int64_t ctx(int64_t s) const { return kv_lens[static_cast<size_t>(s)] - q_len(s); }
  // A sequence of q_len new rows after ctx cached tokens, reading and writing state slot `slot`.
  void add(int32_t q_len, int32_t ctx, int32_t slot = 0) {
    cu_q.push_back(cu_q.back() + q_len);
    kv_lens.push_back(ctx + q_len);
    slots.push_back(slot);
  }
};

// [T, heads, dim] view of the columns of a [T, >= heads * dim] tensor (rows keep their stride).
inline Tensor split_heads(const Tensor& rows, int64_t heads, int64_t dim) {
  return Tensor(rows.data(), rows.dtype(), {rows.size(0), heads, dim}, {rows.stride(0), dim, 1}, rows.device());
}

}  // namespace metrale::testing
