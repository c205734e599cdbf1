#include "cache/cache_manager.h"

#include <algorithm>

#include "core/error.h"
#include "runtime/buffer.h"
#include "runtime/stream.h"

namespace metrale {

CacheManager::CacheManager(std::span<const CacheSpec> specs, const CacheConfig& config, Device device)
    : CacheManager(specs, config, std::span<const Device>(&device, 1)) {}

CacheManager::CacheManager(std::span<const CacheSpec> specs, const CacheConfig& config,
                           std::span<const Device> rank_devices)
    : config_(config),
      device_(rank_devices.empty() ? Device::cpu() : rank_devices.front()),
      devices_(rank_devices.begin(), rank_devices.end()),
      pool_(config.num_blocks),
      prefix_(config.num_blocks, std::max(config.block_size, 1)),
      specs_(specs.begin(), specs.end()) {
  if (config.block_size <= 0) raise(ErrorCode::kInvalidArgument, "block size must be positive, got {}", config.block_size);
  if (devices_.empty()) raise(ErrorCode::kInvalidArgument, "a cache needs at least one device");
  for (const Device& device : devices_) {
    if (device.kind != device_.kind)
      raise(ErrorCode::kInvalidArgument, "cache ranks on {} and {}: one kind of device", device_.to_string(),
            device.to_string());
  }
  if (config.num_state_slots < 0 || config.num_checkpoint_slots < 0)
    raise(ErrorCode::kInvalidArgument, "negative state slot counts ({} sequence, {} checkpoint)", config.num_state_slots,
          config.num_checkpoint_slots);
  if (config.state_checkpoint_interval <= 0)
    raise(ErrorCode::kInvalidArgument, "the state checkpoint interval must be positive, got {}", config.state_checkpoint_interval);
  // Checkpoints sit on block boundaries.
  config_.state_checkpoint_interval = (config.state_checkpoint_interval + config.block_size - 1) / config.block_size * config.block_size;
  for (size_t i = 0; i < specs_.size(); ++i) {
    check_cache_spec(specs_[i], config.block_size, fmt::format("cache {}", i));
    has_slots_ = has_slots_ || specs_[i].has_slots();
  }
  if (has_slots_) {
    const int32_t checkpoints = config.enable_prefix_caching ? config.num_checkpoint_slots : 0;
    sequence_slots_ = StatePool(0, config.num_state_slots);
    checkpoint_slots_ = StatePool(config.num_state_slots, checkpoints);
    padding_slot_ = config.num_state_slots + checkpoints;
    checkpoint_block_.assign(static_cast<size_t>(checkpoints), -1);
    checkpoint_used_at_.assign(static_cast<size_t>(checkpoints), 0);
  }
  const int64_t total_slots = has_slots_ ? padding_slot_ + 1 : 0;
  rank_caches_.assign(devices_.size(), std::vector<BlockCache>(specs_.size()));
  for (size_t rank = 0; rank < devices_.size(); ++rank) {
    const Device device = devices_[rank];
    for (size_t i = 0; i < specs_.size(); ++i) {
      for (const CacheTensorSpec& tensor : specs_[i].tensors) {
        const Shape shape = tensor.storage_shape(config.num_blocks, config.block_size, total_slots);
        const DType dtype = tensor.dtype_or(config.activation_dtype);
        std::vector<OwnedTensor>& storage = tensor.paged() ? paged_storage_ : slot_storage_;
        storage.emplace_back(dtype, shape, device);
        // Paged tensors on the GPU and every per-slot tensor start as zeros: padding rows of graph
        // layouts read rows nobody wrote, and slots are only read after a forward wrote them, but
        // zeros keep stray reads finite. (CPU blocks come from fresh zero pages, and zeroing would
        // commit all of them.)
        if (!tensor.paged() || device.is_cuda()) storage.back().buffer.zero();
        rank_caches_[rank][i].tensors.push_back(storage.back().tensor);
      }
    }
  }
  if (config.num_host_blocks > 0 || config.num_host_slots > 0) {
    std::vector<size_t> block_bytes, slot_bytes;
    for (const OwnedTensor& tensor : paged_storage_)
      block_bytes.push_back(config.num_blocks > 0 ? tensor.tensor.nbytes() / static_cast<size_t>(config.num_blocks) : 0);
    for (const OwnedTensor& tensor : slot_storage_)
      slot_bytes.push_back(tensor.tensor.nbytes() / static_cast<size_t>(tensor.tensor.size(0)));
    host_ = HostTier(devices_, std::move(block_bytes), std::move(slot_bytes), config.num_host_blocks,
                     has_slots_ ? config.num_host_slots : 0);
    host_.enable_staging(paged_storage_, config.num_host_staging_blocks);
    host_prefix_ = PrefixCache(host_.num_blocks(), config.block_size);
    host_checkpoints_ = CheckpointIndex(host_.num_slots());
  }
  if (!config.disk_dir.empty()) {
    if (host_.num_blocks() == 0)
      raise(ErrorCode::kInvalidArgument, "a disk tier ({}) needs a host tier (--swap-space) to spill from",
            config.disk_dir.string());
    const int32_t disk_slots = has_slots_ ? std::max(config.num_disk_slots, 0) : 0;
    disk_ = std::make_unique<DiskTier>(config.disk_dir, host_.packed_block_bytes(), host_.packed_slot_bytes(),
                                       config.num_disk_blocks, disk_slots);
    disk_prefix_ = PrefixCache(disk_->num_blocks(), config.block_size);
    disk_checkpoints_ = CheckpointIndex(disk_->num_slots());
    write_ahead_target_ = config.num_host_write_ahead_blocks >= 0
                              ? std::min(config.num_host_write_ahead_blocks, host_.num_blocks())
                              : std::min(256, host_.num_blocks() / 8);
  }
}

void CacheManager::synchronize_devices() const {
  for (const Device& device : devices_) synchronize(device);
}

uint64_t CacheManager::kv_memory_bytes() const {
  uint64_t bytes = 0;
  for (const auto& tensor : paged_storage_) bytes += tensor.buffer.size();
  return bytes;
}

uint64_t CacheManager::state_memory_bytes() const {
  uint64_t bytes = 0;
  for (const auto& tensor : slot_storage_) bytes += tensor.buffer.size();
  return bytes;
}

// ---- Sequences

void CacheManager::allocate_blocks(int32_t count, std::vector<int32_t>& out) {
  std::vector<int32_t> evicted;
  const bool ok = pool_.allocate(count, out, &evicted);
  METRALE_CHECK(ok, "allocation of {} blocks failed with {} free", count, pool_.num_free());
  for (const int32_t block : evicted) {
    offload_evicted_block(block);
    const int32_t slot = prefix_.erase(block);
    if (slot >= 0) drop_checkpoint(slot);
  }
}

std::optional<CacheManager::PrefixMatch> CacheManager::begin_sequence(int64_t seq_id, std::span<const int32_t> tokens,
                                                                      bool use_prefix_cache) {
  METRALE_CHECK(!has_sequence(seq_id) && !is_swapped(seq_id), "sequence {} already has cache entries", seq_id);
  SequenceEntry entry;
  if (needs_state_slot()) {
    entry.state_slot = sequence_slots_.allocate();
    if (entry.state_slot < 0) return std::nullopt;
  }
  PrefixMatch match;
  // A sequence that needs state but has no slot of its own (scratch caches) could not take a checkpoint.
  if (use_prefix_cache && prefix_caching() && !tokens.empty() && (!has_slots_ || entry.state_slot >= 0)) {
    const int64_t block_size = config_.block_size;
    const auto max_blocks = static_cast<size_t>((static_cast<int64_t>(tokens.size()) - 1) / block_size);
    BlockHash parent;
    size_t usable = 0;
    CheckpointSource checkpoint;
    std::vector<TierHit> hits;
    PrefixPrefetch prefetched = take_prefix_prefetch(seq_id);
    // Reads queued ahead of the match were judged worth it then (and are paid for by now).
    const bool read_disk = disk_ && disk_->block_pool().num_cached() > 0 &&
                           (!prefetched.blocks.empty() || prefetched.slot.entry >= 0 || disk_hits_pay());
    for (size_t i = 0; i < max_blocks; ++i) {
      const auto block_tokens = tokens.subspan(i * static_cast<size_t>(block_size), static_cast<size_t>(block_size));
      const PrefixBlock found = find_prefix_block(parent, block_tokens);
      const int32_t block = found.device;
      if (block < 0) {
        // Another tier may hold it (evicted from the device); it is copied back below.
        if (found.host < 0 && found.disk >= 0 && !read_disk) {
          ++swap_counters_.disk_hits_declined;
          break;
        }
        if (found.host < 0 && found.disk < 0) break;
        hits.push_back({entry.blocks.size(), found.host >= 0 ? Tier::kHost : Tier::kDisk,
                        found.host >= 0 ? found.host : found.disk});
      }
      const BlockHash& hash = found.hash;
      entry.blocks.push_back(block);
      entry.hashes.push_back(hash);
      parent = hash;
      if (!has_slots_) {
        usable = entry.blocks.size();
      } else if (const CheckpointSource source = find_checkpoint(block, hash); source.slot >= 0) {
        usable = entry.blocks.size();
        checkpoint = source;
      }
    }
    entry.blocks.resize(usable);
    entry.hashes.resize(usable);
    for (const int32_t block : entry.blocks)
      if (block >= 0) pool_.retain(block);
    std::erase_if(hits, [&](const TierHit& hit) { return hit.index >= usable; });
    bool restored = false;
    if (!hits.empty() || (checkpoint.slot >= 0 && checkpoint.tier != Tier::kDevice))
      restored = restore_tier_hits(entry, tokens, hits, checkpoint, prefetched);
    if (checkpoint.slot >= 0 && checkpoint.tier == Tier::kDevice && entry.blocks.size() == usable) {
      copy_state_slot(entry.state_slot, checkpoint.slot);
      touch_checkpoint(checkpoint.slot);
      restored = true;
    }
    match.cached_tokens = static_cast<int64_t>(entry.blocks.size()) * block_size;
    match.restored_state = restored && has_slots_;
  }
  sequences_.emplace(seq_id, std::move(entry));
  return match;
}

int32_t CacheManager::blocks_needed(int64_t seq_id, int64_t total_tokens) const {
  const auto it = sequences_.find(seq_id);
  const int32_t have = it == sequences_.end() ? 0 : static_cast<int32_t>(it->second.blocks.size());
  return std::max(0, blocks_for(total_tokens) - have);
}

bool CacheManager::reserve(int64_t seq_id, int64_t total_tokens) {
  METRALE_CHECK(!is_swapped(seq_id), "reserve for sequence {}, which is swapped out", seq_id);
  const int32_t needed = blocks_needed(seq_id, total_tokens);
  if (needed > pool_.num_free()) return false;
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    SequenceEntry entry;
    if (needs_state_slot()) {
      entry.state_slot = sequence_slots_.allocate();
      if (entry.state_slot < 0) return false;
    }
    it = sequences_.emplace(seq_id, std::move(entry)).first;
  }
  allocate_blocks(needed, it->second.blocks);
  return true;
}

void CacheManager::free_sequence(int64_t seq_id) {
  if (const auto swapped = swapped_.find(seq_id); swapped != swapped_.end()) {
    const SwappedEntry& held = swapped->second;
    for (const int32_t block : held.blocks) (held.on_disk ? disk_->block_pool() : host_.block_pool()).release(block);
    if (held.slot >= 0) {
      if (held.on_disk) {
        disk_->slot_pool().free(held.slot);
      } else {
        host_.free_slot(held.slot);
      }
    }
    swapped_.erase(swapped);
    return;
  }
  take_prefix_prefetch(seq_id);  // reads made for an admission that will not come
  const auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) return;
  // Tail first: the empty blocks go back on top of the free stack last, so the next allocation
  // reuses the sequence's first block first; cached blocks join the LRU list tail first, so that a
  // prefix's later blocks are evicted before its earlier ones (a prefix is usable only up to its
  // first missing block).
  const auto& blocks = it->second.blocks;
  for (auto block = blocks.rbegin(); block != blocks.rend(); ++block) pool_.release(*block);
  if (it->second.state_slot >= 0) sequence_slots_.free(it->second.state_slot);
  sequences_.erase(it);
}

std::span<const int32_t> CacheManager::block_table(int64_t seq_id) const {
  const auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) return {};
  return it->second.blocks;
}

// ---- Recurrent state

int32_t CacheManager::state_slot(int64_t seq_id) const {
  const auto it = sequences_.find(seq_id);
  return it == sequences_.end() ? -1 : it->second.state_slot;
}

void CacheManager::copy_state_slot(int32_t dst, int32_t src) {
  METRALE_CHECK(has_slots_, "state copy in a cache without per-slot tensors");
  METRALE_CHECK(dst >= 0 && src >= 0 && dst <= padding_slot_ && src <= padding_slot_, "state copy {} -> {} out of range",
                src, dst);
  if (dst == src) return;
  for (const OwnedTensor& state : slot_storage_) {
    const Tensor& tensor = state.tensor;
    const size_t slot_bytes = tensor.nbytes() / static_cast<size_t>(tensor.size(0));
    auto* base = static_cast<char*>(tensor.data());
    copy_bytes_async(base + static_cast<size_t>(dst) * slot_bytes, device_, base + static_cast<size_t>(src) * slot_bytes,
                     device_, slot_bytes);
  }
}

// ---- Prefix cache

void CacheManager::cache_full_blocks(int64_t seq_id, std::span<const int32_t> tokens, int64_t num_computed) {
  if (!prefix_caching()) return;
  const auto it = sequences_.find(seq_id);
  METRALE_CHECK(it != sequences_.end(), "no cache entries for sequence {}", seq_id);
  METRALE_CHECK(static_cast<int64_t>(tokens.size()) >= num_computed, "{} computed of {} tokens", num_computed, tokens.size());
  SequenceEntry& entry = it->second;
  const auto block_size = static_cast<size_t>(config_.block_size);
  const size_t full = std::min(static_cast<size_t>(num_computed) / block_size, entry.blocks.size());
  for (size_t i = entry.hashes.size(); i < full; ++i) {
    const BlockHash parent = i == 0 ? BlockHash{} : entry.hashes[i - 1];
    const auto block_tokens = tokens.subspan(i * block_size, block_size);
    const BlockHash hash = hash_block(parent, block_tokens);
    entry.hashes.push_back(hash);
    const int32_t block = entry.blocks[i];
    // When another block already holds this prefix, this one stays private and is freed empty.
    if (prefix_.insert(block, hash, parent, block_tokens)) pool_.mark_cached(block);
  }
}

bool CacheManager::is_checkpoint_position(int64_t num_prompt, int64_t position) const {
  if (!has_slots_ || checkpoint_slots_.num_slots() == 0) return false;
  const int64_t last = last_prompt_checkpoint(num_prompt);
  if (position <= 0 || position % config_.block_size != 0 || position > last) return false;
  return position == last || position % config_.state_checkpoint_interval == 0;
}

int64_t CacheManager::next_checkpoint_position(int64_t num_prompt, int64_t num_computed) const {
  if (!has_slots_ || checkpoint_slots_.num_slots() == 0) return -1;
  const int64_t last = last_prompt_checkpoint(num_prompt);
  if (num_computed >= last) return -1;
  const int64_t interval = config_.state_checkpoint_interval;
  const int64_t next_interval = (num_computed / interval + 1) * interval;
  return std::min(next_interval, last);
}

void CacheManager::touch_checkpoint(int32_t slot) {
  checkpoint_used_at_[static_cast<size_t>(slot - checkpoint_slots_.first_slot())] = ++clock_;
}

void CacheManager::drop_checkpoint(int32_t slot) {
  checkpoint_block_[static_cast<size_t>(slot - checkpoint_slots_.first_slot())] = -1;
  checkpoint_slots_.free(slot);
}

void CacheManager::checkpoint_state(int64_t seq_id, int64_t position) {
  if (!has_slots_ || checkpoint_slots_.num_slots() == 0) return;
  const auto it = sequences_.find(seq_id);
  METRALE_CHECK(it != sequences_.end(), "no cache entries for sequence {}", seq_id);
  const SequenceEntry& entry = it->second;
  METRALE_CHECK(position > 0 && position % config_.block_size == 0, "checkpoint at {} is not a block boundary", position);
  const auto index = static_cast<size_t>(position / config_.block_size - 1);
  if (entry.state_slot < 0 || index >= entry.hashes.size()) return;  // the block was not indexed
  // The block that holds this prefix in the index (this sequence's or an identical one's).
  const int32_t block = prefix_.find(entry.hashes[index]);
  if (block < 0) return;
  if (const int32_t existing = prefix_.checkpoint(block); existing >= 0) {
    touch_checkpoint(existing);
    return;
  }
  int32_t slot = checkpoint_slots_.allocate();
  if (slot < 0) {
    // Drop the least recently made or used checkpoint (its block stays cached without it).
    size_t oldest = 0;
    for (size_t i = 1; i < checkpoint_used_at_.size(); ++i)
      if (checkpoint_used_at_[i] < checkpoint_used_at_[oldest]) oldest = i;
    const int32_t victim = checkpoint_slots_.first_slot() + static_cast<int32_t>(oldest);
    const int32_t taken = prefix_.take_checkpoint(checkpoint_block_[oldest]);
    METRALE_CHECK(taken == victim, "checkpoint slot {} is not owned by block {}", victim, checkpoint_block_[oldest]);
    offload_checkpoint(prefix_.hash_of(checkpoint_block_[oldest]), victim);
    drop_checkpoint(victim);
    slot = checkpoint_slots_.allocate();
  }
  copy_state_slot(slot, entry.state_slot);
  prefix_.set_checkpoint(block, slot);
  checkpoint_block_[static_cast<size_t>(slot - checkpoint_slots_.first_slot())] = block;
  touch_checkpoint(slot);
}

// ---- Integrity

void CacheManager::check_integrity() const {
  const int64_t total_slots = has_slots_ ? padding_slot_ + 1 : 0;
  for (size_t rank = 0; rank < rank_caches_.size(); ++rank) {
    const std::vector<BlockCache>& caches = rank_caches_[rank];
    METRALE_CHECK(caches.size() == specs_.size(), "rank {}: {} caches for {} specs", rank, caches.size(), specs_.size());
    for (size_t i = 0; i < specs_.size(); ++i) {
      const auto& tensors = specs_[i].tensors;
      METRALE_CHECK(caches[i].tensors.size() == tensors.size(), "rank {} cache {} holds {} tensors for {} declared",
                    rank, i, caches[i].tensors.size(), tensors.size());
      for (size_t j = 0; j < tensors.size(); ++j) {
        const Tensor& tensor = caches[i].tensors[j];
        const Shape expected = tensors[j].storage_shape(config_.num_blocks, config_.block_size, total_slots);
        METRALE_CHECK(tensor.shape() == expected && tensor.dtype() == tensors[j].dtype_or(config_.activation_dtype) &&
                          tensor.is_contiguous() && tensor.device() == devices_[rank],
                      "rank {} cache {} tensor '{}' is {}, declared {} {}", rank, i, tensors[j].name, tensor.describe(),
                      expected.to_string(), dtype_name(tensors[j].dtype_or(config_.activation_dtype)));
      }
    }
  }
  const int32_t total = pool_.num_blocks();
  std::vector<int32_t> references(static_cast<size_t>(total), 0);
  std::vector<uint8_t> slot_owned(static_cast<size_t>(std::max(padding_slot_, 0)), 0);
  int32_t sequences_with_slots = 0;
  for (const auto& [seq_id, entry] : sequences_) {
    METRALE_CHECK(entry.hashes.size() <= entry.blocks.size(), "sequence {} hashes {} of {} blocks", seq_id,
                  entry.hashes.size(), entry.blocks.size());
    for (const int32_t block : entry.blocks) {
      METRALE_CHECK(block >= 0 && block < total, "sequence {} holds block {} out of range", seq_id, block);
      ++references[static_cast<size_t>(block)];
    }
    if (entry.state_slot >= 0) {
      METRALE_CHECK(sequence_slots_.contains(entry.state_slot) && sequence_slots_.is_allocated(entry.state_slot),
                    "sequence {} holds state slot {} that is not allocated", seq_id, entry.state_slot);
      METRALE_CHECK(slot_owned[static_cast<size_t>(entry.state_slot)] == 0, "state slot {} held twice", entry.state_slot);
      slot_owned[static_cast<size_t>(entry.state_slot)] = 1;
      ++sequences_with_slots;
    } else {
      METRALE_CHECK(!needs_state_slot(), "sequence {} has no state slot", seq_id);
    }
  }
  METRALE_CHECK(sequences_with_slots == sequence_slots_.num_used(), "{} sequences hold slots but {} are allocated",
                sequences_with_slots, sequence_slots_.num_used());
  int32_t used = 0, cached_free = 0, indexed = 0, checkpoints = 0;
  for (int32_t block = 0; block < total; ++block) {
    const int32_t refs = references[static_cast<size_t>(block)];
    METRALE_CHECK(pool_.ref_count(block) == refs, "block {} has {} references but {} tables hold it", block,
                  pool_.ref_count(block), refs);
    METRALE_CHECK(pool_.is_cached(block) == prefix_.holds(block), "block {}: pool cached {} but index holds {}", block,
                  pool_.is_cached(block), prefix_.holds(block));
    used += refs > 0;
    cached_free += refs == 0 && pool_.is_cached(block);
    indexed += prefix_.holds(block);
    if (const int32_t slot = prefix_.checkpoint(block); slot >= 0) {
      METRALE_CHECK(checkpoint_slots_.contains(slot) && checkpoint_slots_.is_allocated(slot),
                    "block {} has checkpoint slot {} that is not allocated", block, slot);
      METRALE_CHECK(checkpoint_block_[static_cast<size_t>(slot - checkpoint_slots_.first_slot())] == block,
                    "checkpoint slot {} does not point back at block {}", slot, block);
      ++checkpoints;
    }
  }
  METRALE_CHECK(pool_.num_used() == used && pool_.num_cached() == cached_free, "pool counts used {} cached {}, tables say {} and {}",
                pool_.num_used(), pool_.num_cached(), used, cached_free);
  METRALE_CHECK(pool_.num_empty() + pool_.num_cached() + pool_.num_used() == total, "empty {} + cached {} + used {} != {}",
                pool_.num_empty(), pool_.num_cached(), pool_.num_used(), total);
  METRALE_CHECK(static_cast<int32_t>(prefix_.size()) == indexed, "prefix index has {} hashes for {} blocks", prefix_.size(),
                indexed);
  METRALE_CHECK(checkpoints == checkpoint_slots_.num_used(), "{} checkpoints but {} checkpoint slots allocated",
                checkpoints, checkpoint_slots_.num_used());
  const auto lru = pool_.lru_order();
  METRALE_CHECK(static_cast<int32_t>(lru.size()) == cached_free, "LRU list has {} blocks, {} are cached and free",
                lru.size(), cached_free);
  for (const int32_t block : lru)
    METRALE_CHECK(pool_.ref_count(block) == 0 && pool_.is_cached(block), "LRU block {} is in use or not cached", block);
  check_host_tier_integrity();
}

}  // namespace metrale
