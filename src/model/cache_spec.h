// What each layer keeps per sequence between steps, and the views of that memory a forward gets.
// Layers declare specs; the cache floor (src/cache) owns and allocates the memory.
//
// Two kinds of per-sequence memory exist:
// - paged KV (attention layers): grows with the sequence, in blocks of block_size tokens shared by
//   all attention layers (one block numbering, one block table per sequence);
// - recurrent state (linear-attention layers such as Gated DeltaNet): fixed size per sequence, kept
//   in a *state slot*. Every recurrent layer owns one tensor per declared state, each
//   [num_state_slots, ...per_slot_shape]; a sequence holds one slot index valid in all of them
//   (ForwardBatch::state_slots).
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/tensor.h"

namespace metrale {

enum class LayerCacheKind {
  kNone,       // stateless layer
  kPagedKv,    // keys and values in fixed-size blocks of tokens
  kRecurrent,  // fixed-size state per sequence, in state slots
};

// One state tensor of a recurrent layer, per slot.
struct StateTensorSpec {
  std::vector<int64_t> per_slot_shape;  // e.g. conv state {K-1, conv_dim}, recurrent {Hv, dk, dv}
  // true: always fp32 (recurrent matrices); false: the cache's activation dtype (f32 on the CPU,
  // bf16 on the GPU), e.g. the conv window of projected inputs.
  bool fp32 = false;
};

struct LayerCacheSpec {
  LayerCacheKind kind = LayerCacheKind::kNone;
  int64_t num_kv_heads = 0;             // kPagedKv
  int64_t head_dim = 0;                 // kPagedKv
  std::vector<StateTensorSpec> states;  // kRecurrent, in the order of LayerCache::states
};

// The memory of one layer's cache, as the forward sees it.
struct LayerCache {
  Tensor k_cache;  // kPagedKv: [num_blocks, block_size, num_kv_heads, head_dim]
  Tensor v_cache;  // kPagedKv: same
  // kRecurrent: one tensor per LayerCacheSpec::states entry, [num_state_slots, ...per_slot_shape],
  // contiguous. A slot's contents are meaningful only for a sequence whose cached length is > 0:
  // a sequence starting from position 0 (kv_lens[s] == q_len_s) must ignore what its slot holds and
  // start from zero state; the forward then overwrites the slot.
  std::vector<Tensor> states;
};

// Bytes one state slot costs across all recurrent layers.
inline uint64_t state_bytes_per_slot(const std::vector<LayerCacheSpec>& specs, size_t activation_dtype_size) {
  uint64_t bytes = 0;
  for (const auto& spec : specs) {
    for (const auto& state : spec.states) {
      uint64_t elements = 1;
      for (const int64_t dim : state.per_slot_shape) elements *= static_cast<uint64_t>(dim);
      bytes += elements * (state.fp32 ? 4u : activation_dtype_size);
    }
  }
  return bytes;
}

}  // namespace metrale
