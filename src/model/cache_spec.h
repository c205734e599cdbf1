// What each layer keeps per sequence between steps, and the views of that memory a forward gets.
// Layers declare specs; the cache floor (src/cache) owns and allocates the memory.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/tensor.h"

namespace metrale {

enum class LayerCacheKind {
  kNone,     // stateless layer
  kPagedKv,  // keys and values in fixed-size blocks of tokens
};

struct LayerCacheSpec {
  LayerCacheKind kind = LayerCacheKind::kNone;
  int64_t num_kv_heads = 0;  // kPagedKv
  int64_t head_dim = 0;      // kPagedKv
};

// The memory of one layer's cache, as the forward sees it.
struct LayerCache {
  Tensor k_cache;  // kPagedKv: [num_blocks, block_size, num_kv_heads, head_dim]
  Tensor v_cache;  // kPagedKv: same
};

}  // namespace metrale
