// PLE n-gram ids on the GPU (semantics in kernels/ple_ngram.h; the CPU twin is the reference).
// Two launches, as causal_conv1d:
//  1. ids_kernel: one thread per token row. It finds its sequence (binary search over cu_q), reads
//     the n_max - 1 previous ids (this step's rows, else the slot's history, else EOS) and writes
//     its NH ids. The slots are only read here.
//  2. history_kernel: one thread per sequence reads the new last n_max - 1 ids (old slot entries
//     when q_len < n_max - 1) and then overwrites its slot.
// 64-bit remainders by the head sizes cost ~tens of instructions each: NH per token, negligible.
#include <cstdint>
#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/ple_ngram.h"

namespace metrale::kernels::cuda {
namespace {

constexpr int kThreads = 128;

struct IdArgs {
  const int32_t* tokens;  // [T]
  int64_t* history;       // [slots, n_max - 1]
  const int32_t* cu_q;
  const int32_t* kv_lens;
  const int32_t* slots;
  const int64_t* multipliers;  // [n_max]
  const int64_t* sizes;        // [NH]
  const int64_t* offsets;      // [NH]
  int64_t* ids;                // [T, NH]
  uint64_t eos;
  int64_t tokens_bound;  // T (the grid's extent)
  int num_seqs;
  int n_max;
  int hpn;
};


// Entry `index` (0-based, oldest first) of sequence s's history hist = ctx ++ rows.
__device__ __forceinline__ uint64_t history_entry(const IdArgs& a, int seq_begin, bool fresh, int slot, int index) {
  const int context = a.n_max - 1;
  if (index >= context) return static_cast<uint64_t>(static_cast<int64_t>(a.tokens[seq_begin + index - context]));
  if (fresh) return a.eos;
  return static_cast<uint64_t>(a.history[static_cast<int64_t>(slot) * context + index]);
}

__global__ void __launch_bounds__(kThreads) ids_kernel(IdArgs a) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (row >= a.tokens_bound || row >= a.cu_q[a.num_seqs]) return;
  const int s = sequence_of(a.cu_q, a.num_seqs, row);
  const int seq_begin = a.cu_q[s], q_len = a.cu_q[s + 1] - seq_begin;
  const int slot = a.slots[s];
  const bool fresh = a.kv_lens[s] == q_len || slot < 0;
  const int p = a.n_max - 1 + static_cast<int>(row - seq_begin);
  const int heads = (a.n_max - 1) * a.hpn;
  int64_t* out = a.ids + row * heads;
  uint64_t mixed = history_entry(a, seq_begin, fresh, slot, p) * static_cast<uint64_t>(a.multipliers[0]);
  bool blocked = false;
#pragma unroll
  for (int k = 1; k < kMaxPleNgram; ++k) {
    if (k >= a.n_max) break;
    const uint64_t previous = history_entry(a, seq_begin, fresh, slot, p - k);
    blocked = blocked || previous == a.eos;
    mixed ^= (blocked ? a.eos : previous) * static_cast<uint64_t>(a.multipliers[k]);
    for (int j = 0; j < a.hpn; ++j) {
      const int h = (k - 1) * a.hpn + j;
      out[h] = static_cast<int64_t>(mixed % static_cast<uint64_t>(__ldg(a.sizes + h))) + __ldg(a.offsets + h);
    }
  }
}

__global__ void __launch_bounds__(kThreads) history_kernel(IdArgs a) {
  const int s = static_cast<int>(blockIdx.x) * kThreads + threadIdx.x;
  if (s >= a.num_seqs) return;
  const int seq_begin = a.cu_q[s], q_len = a.cu_q[s + 1] - seq_begin;
  const int slot = a.slots[s];
  if (q_len == 0 || slot < 0) return;
  const bool fresh = a.kv_lens[s] == q_len;
  const int context = a.n_max - 1;
  uint64_t last[kMaxPleNgram];
#pragma unroll
  for (int k = 0; k < kMaxPleNgram - 1; ++k) {
    if (k < context) last[k] = history_entry(a, seq_begin, fresh, slot, q_len + k);
  }
#pragma unroll
  for (int k = 0; k < kMaxPleNgram - 1; ++k) {
    if (k < context) a.history[static_cast<int64_t>(slot) * context + k] = static_cast<int64_t>(last[k]);
  }
}

}  // namespace

void ple_ngram_ids(const Tensor& token_ids, const Tensor& history, const Tensor& cu_q, const Tensor& kv_lens,
                   const Tensor& slots, const Tensor& multipliers, const Tensor& head_sizes,
                   const Tensor& head_offsets, const Tensor& ids, const PleNgramParams& params) {
  for (const Tensor* t : {&token_ids, &history, &cu_q, &kv_lens, &slots, &multipliers, &head_sizes, &head_offsets,
                          &ids}) {
    METRALE_EXPECT(t->device().is_cuda(), "ple_ngram_ids: tensors must be on the GPU (" + t->describe() + ")");
  }
  const int n_max = params.ngram_size, hpn = params.heads_per_ngram;
  if (n_max < 2 || n_max > kMaxPleNgram || hpn < 1) {
    raise_message(ErrorCode::kUnsupported, "ple_ngram_ids (cuda): ngram_size " + std::to_string(n_max) +
                                               " (2.." + std::to_string(kMaxPleNgram) + ") heads_per_ngram " +
                                               std::to_string(hpn));
  }
  const int64_t heads = static_cast<int64_t>(n_max - 1) * hpn, tokens = token_ids.numel();
  const int64_t num_seqs = kv_lens.numel();
  METRALE_EXPECT(token_ids.dtype() == DType::kI32 && token_ids.is_contiguous() && ids.dtype() == DType::kI64 &&
                     ids.is_contiguous() && ids.ndim() == 2 && ids.size(0) == tokens && ids.size(1) == heads,
                 "ple_ngram_ids: token_ids " + token_ids.describe() + " ids " + ids.describe());
  METRALE_EXPECT(history.dtype() == DType::kI64 && history.ndim() == 2 && history.is_contiguous() &&
                     history.size(1) == n_max - 1,
                 "ple_ngram_ids: history " + history.describe());
  METRALE_EXPECT(multipliers.dtype() == DType::kI64 && multipliers.numel() == n_max &&
                     head_sizes.dtype() == DType::kI64 && head_sizes.numel() == heads &&
                     head_offsets.dtype() == DType::kI64 && head_offsets.numel() == heads &&
                     multipliers.is_contiguous() && head_sizes.is_contiguous() && head_offsets.is_contiguous(),
                 "ple_ngram_ids: multipliers " + multipliers.describe() + " sizes " + head_sizes.describe());
  METRALE_EXPECT(cu_q.numel() == num_seqs + 1 && slots.numel() == num_seqs && cu_q.dtype() == DType::kI32 &&
                     kv_lens.dtype() == DType::kI32 && slots.dtype() == DType::kI32,
                 "ple_ngram_ids: cu_q " + cu_q.describe() + " slots " + slots.describe());
  METRALE_EXPECT(num_seqs <= INT32_MAX && tokens <= INT32_MAX, "ple_ngram_ids: batch too large");
  if (num_seqs == 0) return;
  IdArgs a{};
  a.tokens = token_ids.data_as<const int32_t>();
  a.history = history.data_as<int64_t>();
  a.cu_q = cu_q.data_as<const int32_t>();
  a.kv_lens = kv_lens.data_as<const int32_t>();
  a.slots = slots.data_as<const int32_t>();
  a.multipliers = multipliers.data_as<const int64_t>();
  a.sizes = head_sizes.data_as<const int64_t>();
  a.offsets = head_offsets.data_as<const int64_t>();
  a.ids = ids.data_as<int64_t>();
  a.eos = static_cast<uint64_t>(params.eos_token_id);
  a.tokens_bound = tokens;
  a.num_seqs = static_cast<int>(num_seqs);
  a.n_max = n_max;
  a.hpn = hpn;
  const cudaStream_t stream = stream_of(ids);
  if (tokens > 0) ids_kernel<<<ceil_div(tokens, kThreads), kThreads, 0, stream>>>(a);
  METRALE_CHECK_LAUNCH("ple_ngram_ids");
  if (params.write_history) history_kernel<<<ceil_div(num_seqs, kThreads), kThreads, 0, stream>>>(a);
  METRALE_CHECK_LAUNCH("ple_ngram_history");
}

}  // namespace metrale::kernels::cuda
