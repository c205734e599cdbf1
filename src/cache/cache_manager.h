// CacheManager: owns the memory of every layer's cache (one paged K and V pool per attention layer,
// all sharing one block numbering) and maps sequences to their blocks.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "cache/block_pool.h"
#include "model/cache_spec.h"

namespace metrale {

struct CacheConfig {
  int32_t block_size = 16;   // tokens per block
  int32_t num_blocks = 0;    // blocks per attention layer (all layers share the numbering)
  DType kv_dtype = DType::kF32;
};

// Bytes one block costs across all layers with a paged KV cache.
uint64_t kv_bytes_per_block(std::span<const LayerCacheSpec> specs, int32_t block_size, DType kv_dtype);

class CacheManager {
 public:
  CacheManager(std::span<const LayerCacheSpec> specs, const CacheConfig& config, Device device);

  const CacheConfig& config() const { return config_; }
  int32_t block_size() const { return config_.block_size; }
  const BlockPool& pool() const { return pool_; }
  std::span<const LayerCache> layer_caches() const { return layers_; }
  uint64_t memory_bytes() const;

  // Blocks needed to hold `tokens` tokens.
  int32_t blocks_for(int64_t tokens) const {
    return static_cast<int32_t>((tokens + config_.block_size - 1) / config_.block_size);
  }
  // Grows sequence `seq_id`'s blocks to hold `total_tokens`. All or nothing: returns false and
  // changes nothing when too few blocks are free.
  bool reserve(int64_t seq_id, int64_t total_tokens);
  // Blocks that reserve(seq_id, total_tokens) would have to take from the pool.
  int32_t blocks_needed(int64_t seq_id, int64_t total_tokens) const;
  // Releases every block of the sequence.
  void free_sequence(int64_t seq_id);
  std::span<const int32_t> block_table(int64_t seq_id) const;
  bool has_sequence(int64_t seq_id) const { return tables_.count(seq_id) != 0; }
  size_t num_sequences() const { return tables_.size(); }

 private:
  CacheConfig config_;
  Device device_;
  BlockPool pool_;
  std::vector<OwnedTensor> storage_;  // K and V per attention layer
  std::vector<LayerCache> layers_;    // one per layer (empty tensors for stateless layers)
  std::unordered_map<int64_t, std::vector<int32_t>> tables_;
};

}  // namespace metrale
