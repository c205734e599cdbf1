#include "cache/cache_manager.h"

#include "core/error.h"

namespace metrale {

uint64_t kv_bytes_per_block(std::span<const LayerCacheSpec> specs, int32_t block_size, DType kv_dtype) {
  uint64_t bytes = 0;
  for (const auto& spec : specs) {
    if (spec.kind == LayerCacheKind::kPagedKv) {
      bytes += 2ull * static_cast<uint64_t>(block_size * spec.num_kv_heads * spec.head_dim) * dtype_size(kv_dtype);
    }
  }
  return bytes;
}

CacheManager::CacheManager(std::span<const LayerCacheSpec> specs, const CacheConfig& config, Device device)
    : config_(config), device_(device), pool_(config.num_blocks) {
  if (config.block_size <= 0) raise(ErrorCode::kInvalidArgument, "block size must be positive, got {}", config.block_size);
  layers_.resize(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const LayerCacheSpec& spec = specs[i];
    if (spec.kind != LayerCacheKind::kPagedKv) continue;
    const Shape shape{config.num_blocks, config.block_size, spec.num_kv_heads, spec.head_dim};
    storage_.emplace_back(config.kv_dtype, shape, device);
    layers_[i].k_cache = storage_.back().tensor;
    storage_.emplace_back(config.kv_dtype, shape, device);
    layers_[i].v_cache = storage_.back().tensor;
  }
}

uint64_t CacheManager::memory_bytes() const {
  uint64_t bytes = 0;
  for (const auto& tensor : storage_) bytes += tensor.buffer.size();
  return bytes;
}

int32_t CacheManager::blocks_needed(int64_t seq_id, int64_t total_tokens) const {
  const auto it = tables_.find(seq_id);
  const int32_t have = it == tables_.end() ? 0 : static_cast<int32_t>(it->second.size());
  return std::max(0, blocks_for(total_tokens) - have);
}

bool CacheManager::reserve(int64_t seq_id, int64_t total_tokens) {
  const int32_t needed = blocks_needed(seq_id, total_tokens);
  if (needed > pool_.num_free()) return false;
  auto& table = tables_[seq_id];
  const bool ok = pool_.allocate(needed, table);
  METRALE_CHECK(ok, "allocation of {} blocks failed with {} free", needed, pool_.num_free());
  return true;
}

void CacheManager::free_sequence(int64_t seq_id) {
  const auto it = tables_.find(seq_id);
  if (it == tables_.end()) return;
  // Tail first: the most recent blocks go back on top of the free stack last, so the next
  // allocation reuses the sequence's first block first.
  for (auto block = it->second.rbegin(); block != it->second.rend(); ++block) pool_.release(*block);
  tables_.erase(it);
}

std::span<const int32_t> CacheManager::block_table(int64_t seq_id) const {
  const auto it = tables_.find(seq_id);
  if (it == tables_.end()) return {};
  return it->second;
}

}  // namespace metrale
