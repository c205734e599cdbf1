// Cache specs the cache and engine tests build by hand: what today's blocks declare (attention's
// {k, v} per token, GDN's {conv, recurrent} per slot), written out without a model.
#pragma once

#include <cstdint>

#include "model/cache_spec.h"

namespace metrale::testing {

// Attention: k and v per token, [kv_heads, head_dim] each in the activation dtype.
inline CacheSpec keys_and_values(int64_t kv_heads, int64_t head_dim) {
  return {{CacheTensorSpec::per_token("k", {kv_heads, head_dim}), CacheTensorSpec::per_token("v", {kv_heads, head_dim})}};
}

}  // namespace metrale::testing
