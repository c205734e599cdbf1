// CacheManager's tiers below the device: what moves to the host tier when the device drops it,
// what moves on to disk when the host tier does, and how a prefix hit in either comes back.
#include <algorithm>
#include <chrono>

#include "cache/cache_manager.h"
#include "core/error.h"
#include "core/log.h"
#include "runtime/stream.h"

namespace metrale {

// ---- Room in the tiers

int64_t CacheManager::oldest_host_swapped(int64_t keep, bool with_slot) const {
  int64_t oldest = -1;
  uint64_t oldest_at = 0;
  for (const auto& [seq_id, swapped] : swapped_) {
    if (swapped.on_disk || seq_id == keep || (with_slot && swapped.slot < 0)) continue;
    if (oldest < 0 || swapped.swapped_at < oldest_at) {
      oldest = seq_id;
      oldest_at = swapped.swapped_at;
    }
  }
  return oldest;
}

bool CacheManager::take_host_blocks(int32_t count, std::vector<int32_t>& out, std::optional<int64_t> swapping) {
  if (swapping) {
    while (host_.num_free_blocks() < count) {
      const int64_t oldest = oldest_host_swapped(*swapping, false);
      if (oldest < 0 || !spill_swapped(oldest)) break;
    }
  }
  std::vector<int32_t> evicted;
  if (!host_.block_pool().allocate(count, out, &evicted)) return false;
  for (const int32_t block : evicted) {
    spill_host_block(block);  // its bytes are still there: nothing was copied into it yet
    host_prefix_.erase(block);
  }
  return true;
}

int32_t CacheManager::take_host_slot(std::optional<int64_t> swapping) {
  if (const int32_t slot = host_.allocate_slot(); slot >= 0) return slot;
  if (const int32_t victim = host_checkpoints_.least_recent(); victim >= 0) {
    spill_host_checkpoint(victim);
    host_checkpoints_.erase(victim);
    host_.free_slot(victim);
    return host_.allocate_slot();
  }
  if (!swapping) return -1;
  const int64_t oldest = oldest_host_swapped(*swapping, true);
  if (oldest < 0 || !spill_swapped(oldest)) return -1;
  return host_.allocate_slot();
}

bool CacheManager::take_disk_blocks(int32_t count, std::vector<int32_t>& out) {
  std::vector<int32_t> evicted;
  if (!disk_->block_pool().allocate(count, out, &evicted)) return false;
  for (const int32_t block : evicted) disk_prefix_.erase(block);
  return true;
}

int32_t CacheManager::take_disk_slot() {
  if (const int32_t slot = disk_->slot_pool().allocate(); slot >= 0) return slot;
  const int32_t victim = disk_checkpoints_.least_recent();
  if (victim < 0) return -1;  // every disk slot holds a swapped sequence's state
  disk_checkpoints_.erase(victim);
  disk_->slot_pool().free(victim);
  return disk_->slot_pool().allocate();
}

// ---- Device -> host

void CacheManager::offload_evicted_block(int32_t block) {
  if (host_.num_blocks() == 0 || !prefix_.holds(block)) return;
  // A prefix of a model with recurrent state is only reusable from a state checkpoint: without
  // checkpoint slots none can exist, and the block would cost a copy and host memory for nothing.
  if (has_slots_ && checkpoint_slots_.num_slots() == 0) return;
  const BlockHash& hash = prefix_.hash_of(block);
  // Its checkpoint first: the slot is freed right after this returns.
  if (const int32_t slot = prefix_.checkpoint(block); slot >= 0) offload_checkpoint(hash, slot);
  if (host_prefix_.find(hash) >= 0) return;  // the host already holds this prefix block
  if (host_.num_free_blocks() == 0) return;  // every host block holds a swapped sequence
  std::vector<int32_t> taken;
  if (!take_host_blocks(1, taken, std::nullopt)) return;
  const int32_t host_block = taken.front();
  host_.store_block(paged_storage_, block, host_block);  // queued before the block's next writer
  METRALE_CHECK(host_prefix_.insert(host_block, hash, prefix_.parent_of(block), prefix_.tokens_of(block)),
                "host prefix index refused block {}", host_block);
  host_.block_pool().mark_cached(host_block);
  host_.block_pool().release(host_block);  // the most recent entry of the host LRU list
  ++swap_counters_.prefix_blocks_out;
}

void CacheManager::offload_checkpoint(const BlockHash& hash, int32_t device_slot) {
  if (host_.num_slots() == 0) return;
  if (const int32_t held = host_checkpoints_.find(hash); held >= 0) {
    host_checkpoints_.touch(held);
    return;
  }
  const int32_t host_slot = take_host_slot(std::nullopt);
  if (host_slot < 0) return;                                // every host slot holds a swapped sequence's state
  host_.store_slot(slot_storage_, device_slot, host_slot);  // queued before the slot's next writer
  host_checkpoints_.insert(hash, host_slot);
  ++swap_counters_.checkpoints_out;
}

// ---- Host -> disk

void CacheManager::spill_host_block(int32_t host_block) {
  if (!disk_ || disk_->num_blocks() == 0 || !host_prefix_.holds(host_block)) return;
  const BlockHash& hash = host_prefix_.hash_of(host_block);
  if (disk_prefix_.find(hash) >= 0) return;  // the disk already holds this prefix block
  // A corrupted host copy is not carried on: its disk checksum would vouch for the wrong bytes.
  if (!host_.verify_block(host_block)) {
    METRALE_LOG_WARN("host tier: prefix block {} failed its checksum; dropped", host_block);
    ++swap_counters_.lost_entries;
    return;
  }
  std::vector<int32_t> taken;
  if (!take_disk_blocks(1, taken)) return;  // every disk block holds a swapped sequence
  const int32_t disk_block = taken.front();
  disk_->write_block(disk_block, host_.pack_block(host_block));
  METRALE_CHECK(
      disk_prefix_.insert(disk_block, hash, host_prefix_.parent_of(host_block), host_prefix_.tokens_of(host_block)),
      "disk prefix index refused block {}", disk_block);
  disk_->block_pool().mark_cached(disk_block);
  disk_->block_pool().release(disk_block);
  ++swap_counters_.prefix_blocks_to_disk;
}

void CacheManager::spill_host_checkpoint(int32_t host_slot) {
  if (!disk_ || disk_->num_slots() == 0) return;
  const BlockHash hash = host_checkpoints_.hash_of(host_slot);
  if (const int32_t held = disk_checkpoints_.find(hash); held >= 0) {
    disk_checkpoints_.touch(held);
    return;
  }
  if (!host_.verify_slot(host_slot)) {
    METRALE_LOG_WARN("host tier: state checkpoint in slot {} failed its checksum; dropped", host_slot);
    ++swap_counters_.lost_entries;
    return;
  }
  const int32_t disk_slot = take_disk_slot();
  if (disk_slot < 0) return;
  disk_->write_slot(disk_slot, host_.pack_slot(host_slot));
  disk_checkpoints_.insert(hash, disk_slot);
}

void CacheManager::write_back_host_blocks() {
  if (!disk_ || disk_->num_blocks() == 0) return;
  BlockPool& pool = host_.block_pool();
  // Landed: the disk holds the block, so the host copy goes (a later hit reads the disk's).
  std::erase_if(host_writes_, [&](HostWriteAhead& write) {
    if (write.written.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
    if (host_prefix_.holds(write.host_block)) host_prefix_.erase(write.host_block);  // (unless found lost since)
    pool.discard(write.host_block);
    pool.release(write.host_block);  // empty
    return true;
  });
  while (pool.num_empty() + static_cast<int32_t>(host_writes_.size()) < write_ahead_target_) {
    const int32_t victim = pool.least_recent_cached();
    if (victim < 0) break;
    const BlockHash& hash = host_prefix_.hash_of(victim);
    const bool on_disk = disk_prefix_.find(hash) >= 0;
    const bool intact = on_disk || host_.verify_block(victim);
    if (on_disk || !intact) {
      // Nothing to write: the disk has it already, or the host copy is corrupted (not carried on).
      if (!intact) {
        METRALE_LOG_WARN("host tier: prefix block {} failed its checksum; dropped", victim);
        ++swap_counters_.lost_entries;
      }
      host_prefix_.erase(victim);
      pool.discard(victim);
      continue;
    }
    std::vector<int32_t> taken;
    if (!take_disk_blocks(1, taken)) break;  // every disk block holds a swapped sequence
    const int32_t disk_block = taken.front();
    pool.retain(victim);
    host_writes_.push_back({victim, disk_->write_block_in_place(disk_block, host_.block_pieces(victim))});
    METRALE_CHECK(disk_prefix_.insert(disk_block, hash, host_prefix_.parent_of(victim), host_prefix_.tokens_of(victim)),
                  "disk prefix index refused block {}", disk_block);
    disk_->block_pool().mark_cached(disk_block);
    disk_->block_pool().release(disk_block);
    ++swap_counters_.prefix_blocks_to_disk;
    ++swap_counters_.prefix_blocks_written_ahead;
  }
}

bool CacheManager::spill_swapped(int64_t seq_id) {
  SwappedEntry& swapped = swapped_.at(seq_id);
  if (!disk_ || swapped.on_disk) return false;
  const auto count = static_cast<int32_t>(swapped.blocks.size());
  if (count > disk_->block_pool().num_free()) return false;
  if (swapped.slot >= 0 && disk_->slot_pool().num_free() == 0 && disk_checkpoints_.size() == 0) return false;
  std::vector<int32_t> disk_blocks;
  disk_blocks.reserve(swapped.blocks.size());
  METRALE_CHECK(take_disk_blocks(count, disk_blocks), "disk tier: {} blocks not free", count);
  int32_t disk_slot = -1;
  if (swapped.slot >= 0) {
    disk_slot = take_disk_slot();
    METRALE_CHECK(disk_slot >= 0, "disk tier: no slot for swapped sequence {}", seq_id);
  }
  // Host copies are moved as they are: one that fails its checksum is caught when it comes back.
  for (size_t i = 0; i < swapped.blocks.size(); ++i) {
    disk_->write_block(disk_blocks[i], host_.pack_block(swapped.blocks[i]));
    host_.block_pool().release(swapped.blocks[i]);
  }
  if (swapped.slot >= 0) {
    disk_->write_slot(disk_slot, host_.pack_slot(swapped.slot));
    host_.free_slot(swapped.slot);
  }
  swapped.blocks = std::move(disk_blocks);
  swapped.slot = disk_slot;
  swapped.on_disk = true;
  ++swap_counters_.sequences_to_disk;
  return true;
}

// ---- Lost entries

void CacheManager::drop_lost_block(Tier tier, int32_t block, const std::string& why) {
  METRALE_LOG_WARN("prefix cache: {} block {} lost ({}); its tokens will be recomputed",
                   tier == Tier::kHost ? "host" : "disk", block, why);
  ++swap_counters_.lost_entries;
  if (tier == Tier::kHost) {
    host_prefix_.erase(block);
    host_.block_pool().discard(block);
  } else {
    disk_prefix_.erase(block);
    disk_->block_pool().discard(block);
  }
}

void CacheManager::drop_lost_checkpoint(Tier tier, int32_t slot, const std::string& why) {
  METRALE_LOG_WARN("prefix cache: {} state checkpoint {} lost ({}); its prefix will be recomputed",
                   tier == Tier::kHost ? "host" : "disk", slot, why);
  ++swap_counters_.lost_entries;
  if (tier == Tier::kHost) {
    host_checkpoints_.erase(slot);
    host_.free_slot(slot);
  } else {
    disk_checkpoints_.erase(slot);
    disk_->slot_pool().free(slot);
  }
}

// ---- Prefix hits in the tiers

bool CacheManager::disk_hits_pay() {
  const double read_rate = disk_->read_bytes_per_second();
  if (read_rate <= 0.0 || recompute_seconds_per_token_ <= 0.0) return true;  // unmeasured: read, and measure
  const double read_seconds = static_cast<double>(host_.packed_block_bytes()) / read_rate;
  if (read_seconds <= static_cast<double>(config_.block_size) * recompute_seconds_per_token_) {
    disk_matches_declined_ = 0;
    return true;
  }
  if (++disk_matches_declined_ < kDiskProbeInterval) return false;
  disk_matches_declined_ = 0;
  return true;
}

CacheManager::PrefixBlock CacheManager::find_prefix_block(const BlockHash& parent,
                                                          std::span<const int32_t> block_tokens) const {
  PrefixBlock found;
  found.hash = hash_block(parent, block_tokens);
  found.device = prefix_.find(found.hash, parent, block_tokens);
  if (found.device >= 0) return found;
  if (host_.num_cached_blocks() > 0) found.host = host_prefix_.find(found.hash, parent, block_tokens);
  if (found.host < 0 && disk_ && disk_->block_pool().num_cached() > 0)
    found.disk = disk_prefix_.find(found.hash, parent, block_tokens);
  return found;
}

void CacheManager::prefetch_prefix(int64_t seq_id, std::span<const int32_t> tokens) {
  if (!disk_ || disk_->block_pool().num_cached() == 0 || !prefix_caching() || tokens.empty() ||
      prefix_prefetches_.count(seq_id) != 0 || has_sequence(seq_id) || is_swapped(seq_id))
    return;
  // The match begin_sequence would make now (the same walk, nothing retained): its disk hits up to
  // the last block it could use, and that block's checkpoint when only the disk holds it.
  const auto block_size = static_cast<size_t>(config_.block_size);
  const size_t max_blocks = (tokens.size() - 1) / block_size;
  BlockHash parent;
  std::vector<int32_t> disk_hits;  // per block up to the walk's end: its disk block, or -1
  size_t usable = 0;
  CheckpointSource checkpoint;
  for (size_t i = 0; i < max_blocks; ++i) {
    const PrefixBlock found = find_prefix_block(parent, tokens.subspan(i * block_size, block_size));
    if (found.device < 0 && found.host < 0 && found.disk < 0) break;
    disk_hits.push_back(found.device < 0 && found.host < 0 ? found.disk : -1);
    parent = found.hash;
    if (!has_slots_) {
      usable = disk_hits.size();
    } else if (const CheckpointSource source = find_checkpoint(found.device, found.hash); source.slot >= 0) {
      usable = disk_hits.size();
      checkpoint = source;
    }
  }
  disk_hits.resize(usable);
  const bool state_from_disk = checkpoint.slot >= 0 && checkpoint.tier == Tier::kDisk;
  const auto blocks =
      static_cast<size_t>(std::count_if(disk_hits.begin(), disk_hits.end(), [](int32_t b) { return b >= 0; }));
  const size_t bytes = blocks * disk_->block_bytes() + (state_from_disk ? disk_->slot_bytes() : 0);
  PrefixPrefetch& prefetch = prefix_prefetches_[seq_id];  // also marks the sequence as looked at
  if (bytes == 0 || prefetched_bytes_ + bytes > kMaxPrefetchBytes || !disk_hits_pay()) return;
  for (const int32_t block : disk_hits)
    if (block >= 0) prefetch.blocks.push_back({block, disk_->block_generation(block), disk_->read_block(block)});
  if (state_from_disk)
    prefetch.slot = {checkpoint.slot, disk_->slot_generation(checkpoint.slot), disk_->read_slot(checkpoint.slot)};
  prefetch.bytes = bytes;
  prefetched_bytes_ += bytes;
  ++swap_counters_.prefix_prefetches;
}

CacheManager::PrefixPrefetch CacheManager::take_prefix_prefetch(int64_t seq_id) {
  const auto it = prefix_prefetches_.find(seq_id);
  if (it == prefix_prefetches_.end()) return {};
  PrefixPrefetch taken = std::move(it->second);
  prefix_prefetches_.erase(it);
  prefetched_bytes_ -= taken.bytes;
  return taken;
}

bool CacheManager::reads_pending(int64_t seq_id) const {
  const auto running = [](const std::future<DiskRead>& read) {
    return read.valid() && read.wait_for(std::chrono::seconds(0)) != std::future_status::ready;
  };
  if (const auto it = prefix_prefetches_.find(seq_id); it != prefix_prefetches_.end()) {
    const PrefixPrefetch& prefetch = it->second;
    if (running(prefetch.slot.data)) return true;
    return std::any_of(prefetch.blocks.begin(), prefetch.blocks.end(),
                       [&](const PrefetchedRead& read) { return running(read.data); });
  }
  if (const auto it = swapped_.find(seq_id); it != swapped_.end())
    return std::any_of(it->second.reads.begin(), it->second.reads.end(), running);
  return false;
}

CacheManager::CheckpointSource CacheManager::find_checkpoint(int32_t block, const BlockHash& hash) const {
  if (block >= 0) {
    if (const int32_t slot = prefix_.checkpoint(block); slot >= 0) return {Tier::kDevice, slot};
  }
  if (const int32_t slot = host_checkpoints_.find(hash); slot >= 0) return {Tier::kHost, slot};
  if (disk_) {
    if (const int32_t slot = disk_checkpoints_.find(hash); slot >= 0) return {Tier::kDisk, slot};
  }
  return {};
}

bool CacheManager::restore_tier_hits(SequenceEntry& entry, std::span<const int32_t> tokens,
                                     const std::vector<TierHit>& hits, const CheckpointSource& checkpoint,
                                     PrefixPrefetch& prefetched) {
  const size_t full = entry.blocks.size();
  // The workers read the disk hits (unless prefetched) while the host hits are verified here.
  std::vector<std::future<DiskRead>> reads(hits.size());
  for (size_t h = 0; h < hits.size(); ++h) {
    if (hits[h].tier != Tier::kDisk) continue;
    const int32_t block = hits[h].block;
    const auto ahead =
        std::find_if(prefetched.blocks.begin(), prefetched.blocks.end(), [&](const PrefetchedRead& read) {
          return read.entry == block && read.generation == disk_->block_generation(block) && read.data.valid();
        });
    reads[h] = ahead != prefetched.blocks.end() ? std::move(ahead->data) : disk_->read_block(block);
  }
  const bool tier_state = checkpoint.slot >= 0 && checkpoint.tier != Tier::kDevice;
  std::future<DiskRead> state_read;
  if (tier_state && checkpoint.tier == Tier::kDisk) {
    const bool ahead = prefetched.slot.entry == checkpoint.slot &&
                       prefetched.slot.generation == disk_->slot_generation(checkpoint.slot) &&
                       prefetched.slot.data.valid();
    state_read = ahead ? std::move(prefetched.slot.data) : disk_->read_slot(checkpoint.slot);
  }

  std::vector<DiskRead> data(hits.size());
  size_t good = hits.size();  // hits before the first lost one
  for (size_t h = 0; h < hits.size(); ++h) {
    if (hits[h].tier == Tier::kDisk) {
      data[h] = reads[h].get();
      if (!data[h].ok) {
        drop_lost_block(Tier::kDisk, hits[h].block, data[h].error);
        good = std::min(good, h);
      }
    } else if (h < good && !host_.verify_block(hits[h].block)) {
      drop_lost_block(Tier::kHost, hits[h].block, "checksum mismatch");
      good = h;
    }
  }
  bool state_ok = tier_state;
  DiskRead state_data;
  if (tier_state && checkpoint.tier == Tier::kDisk) {
    state_data = state_read.get();
    if (!state_data.ok) {
      drop_lost_checkpoint(Tier::kDisk, checkpoint.slot, state_data.error);
      state_ok = false;
    }
  } else if (tier_state && !host_.verify_slot(checkpoint.slot)) {
    drop_lost_checkpoint(Tier::kHost, checkpoint.slot, "checksum mismatch");
    state_ok = false;
  }

  // Cut before the first hit lost or without a free device block (the match's device blocks are
  // retained, so the allocation below cannot evict them). A state needs its whole prefix.
  const size_t restorable = std::min(good, static_cast<size_t>(pool_.num_free()));
  size_t cut = restorable < hits.size() ? hits[restorable].index : full;
  if (has_slots_ && (cut < full || (tier_state && !state_ok))) cut = 0;
  for (size_t i = entry.blocks.size(); i-- > cut;)
    if (entry.blocks[i] >= 0) pool_.release(entry.blocks[i]);
  entry.blocks.resize(cut);
  entry.hashes.resize(cut);
  const auto kept =
      static_cast<size_t>(std::count_if(hits.begin(), hits.end(), [&](const TierHit& hit) { return hit.index < cut; }));

  bool restored = false;
  bool packed_copies = false;
  if (tier_state && state_ok && cut == full) {
    // Into the sequence's own slot, queued before anything below can reuse the tier's slot.
    if (checkpoint.tier == Tier::kHost) {
      host_.load_slot(slot_storage_, checkpoint.slot, entry.state_slot);
      host_checkpoints_.touch(checkpoint.slot);
    } else {
      host_.load_packed_slot(slot_storage_, state_data.bytes, entry.state_slot);
      disk_checkpoints_.touch(checkpoint.slot);
      packed_copies = true;
    }
    ++swap_counters_.checkpoints_in;
    restored = true;
  }
  // The hits' tier blocks are pinned so that what the allocation evicts cannot take them.
  const auto pool_of = [&](Tier tier) -> BlockPool& {
    return tier == Tier::kHost ? host_.block_pool() : disk_->block_pool();
  };
  for (size_t h = 0; h < kept; ++h) pool_of(hits[h].tier).retain(hits[h].block);
  std::vector<int32_t> fresh;
  allocate_blocks(static_cast<int32_t>(kept), fresh);
  const auto block_size = static_cast<size_t>(config_.block_size);
  for (size_t h = 0; h < kept; ++h) {
    const size_t i = hits[h].index;
    const int32_t block = fresh[h];
    if (hits[h].tier == Tier::kHost) {
      host_.load_block(paged_storage_, hits[h].block, block);
      ++swap_counters_.prefix_blocks_in;
    } else {
      host_.load_packed_block(paged_storage_, data[h].bytes, block);
      packed_copies = true;
      ++swap_counters_.prefix_blocks_from_disk;
    }
    entry.blocks[i] = block;
    const BlockHash parent = i == 0 ? BlockHash{} : entry.hashes[i - 1];
    METRALE_CHECK(prefix_.insert(block, entry.hashes[i], parent, tokens.subspan(i * block_size, block_size)),
                  "block {} restored from another tier is already indexed", block);
    pool_.mark_cached(block);
    pool_of(hits[h].tier).release(hits[h].block);  // stays cached in its tier, most recently used
  }
  if (packed_copies) synchronize_devices();  // the copies read `data`, freed on return
  return restored;
}

}  // namespace metrale
