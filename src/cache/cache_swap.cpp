// CacheManager's host and disk tiers: swapping a sequence's blocks and state slot out and back in.
#include <algorithm>

#include "cache/cache_manager.h"
#include "core/error.h"
#include "core/log.h"
#include "runtime/stream.h"

namespace metrale {

bool CacheManager::can_swap_out(int64_t seq_id) const {
  const auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) return false;
  const SequenceEntry& entry = it->second;
  if (host_.num_blocks() == 0 && host_.num_slots() == 0) return false;  // no tier
  const auto blocks = static_cast<int32_t>(entry.blocks.size());
  const bool needs_slot = entry.state_slot >= 0;
  if (blocks > host_.num_blocks() || (needs_slot && host_.num_slots() == 0)) return false;
  const bool slot_now = !needs_slot || host_.num_free_slots() > 0 || host_checkpoints_.size() > 0;
  if (blocks <= host_.num_free_blocks() && slot_now) return true;
  // Older swapped sequences can make room by moving to disk, if the disk has room for one.
  return disk_ != nullptr && oldest_host_swapped(seq_id, false) >= 0;
}

uint64_t CacheManager::swap_bytes(int64_t seq_id) const {
  const auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) return 0;
  const uint64_t slot = it->second.state_slot >= 0 ? host_.packed_slot_bytes() : 0;
  return static_cast<uint64_t>(it->second.blocks.size()) * host_.packed_block_bytes() + slot;
}

bool CacheManager::swap_out(int64_t seq_id) {
  if (!can_swap_out(seq_id)) return false;
  const auto it = sequences_.find(seq_id);
  const SequenceEntry& entry = it->second;
  SwappedEntry swapped;
  swapped.blocks.reserve(entry.blocks.size());
  if (!take_host_blocks(static_cast<int32_t>(entry.blocks.size()), swapped.blocks, seq_id)) return false;
  if (entry.state_slot >= 0) {
    swapped.slot = take_host_slot(seq_id);
    if (swapped.slot < 0) {
      for (const int32_t block : swapped.blocks) host_.block_pool().release(block);
      return false;
    }
  }
  for (size_t i = 0; i < entry.blocks.size(); ++i)
    host_.store_block(paged_storage_, entry.blocks[i], swapped.blocks[i]);
  if (swapped.slot >= 0) host_.store_slot(slot_storage_, entry.state_slot, swapped.slot);
  // The copies are queued ahead of any later write to the released blocks and slot.
  ++swap_counters_.sequences_out;
  swap_counters_.blocks_out += static_cast<int64_t>(swapped.blocks.size());
  swap_counters_.slots_out += swapped.slot >= 0 ? 1 : 0;
  swapped.swapped_at = ++swap_clock_;
  free_sequence(seq_id);
  swapped_.emplace(seq_id, std::move(swapped));
  return true;
}

int32_t CacheManager::swapped_blocks(int64_t seq_id) const {
  const auto it = swapped_.find(seq_id);
  METRALE_CHECK(it != swapped_.end(), "sequence {} is not swapped out", seq_id);
  return static_cast<int32_t>(it->second.blocks.size());
}

bool CacheManager::is_swapped_to_disk(int64_t seq_id) const {
  const auto it = swapped_.find(seq_id);
  return it != swapped_.end() && it->second.on_disk;
}

bool CacheManager::can_swap_in(int64_t seq_id, int64_t total_tokens) const {
  const auto it = swapped_.find(seq_id);
  if (it == swapped_.end()) return false;
  const int32_t blocks = std::max(static_cast<int32_t>(it->second.blocks.size()), blocks_for(total_tokens));
  if (blocks > pool_.num_free()) return false;
  return it->second.slot < 0 || sequence_slots_.num_free() > 0;
}

void CacheManager::prefetch(int64_t seq_id) {
  const auto it = swapped_.find(seq_id);
  if (it == swapped_.end() || !it->second.on_disk || !it->second.reads.empty()) return;
  SwappedEntry& swapped = it->second;
  for (const int32_t block : swapped.blocks) swapped.reads.push_back(disk_->read_block(block));
  if (swapped.slot >= 0) swapped.reads.push_back(disk_->read_slot(swapped.slot));
}

SwapIn CacheManager::load_swapped(int64_t seq_id, SwappedEntry& swapped, SequenceEntry& entry) {
  // Verify everything before any device block changes hands: a lost sequence changes nothing else.
  std::vector<DiskRead> reads;
  std::string lost;
  if (swapped.on_disk) {
    prefetch(seq_id);
    for (auto& read : swapped.reads) reads.push_back(read.get());
    for (const DiskRead& read : reads)
      if (!read.ok && lost.empty()) lost = read.error;
  } else {
    for (const int32_t block : swapped.blocks)
      if (lost.empty() && !host_.verify_block(block)) lost = fmt::format("host block {}: checksum mismatch", block);
    if (lost.empty() && swapped.slot >= 0 && !host_.verify_slot(swapped.slot))
      lost = fmt::format("host slot {}: checksum mismatch", swapped.slot);
  }
  if (!lost.empty()) {
    METRALE_LOG_WARN("swapped-out sequence {} lost in the {} tier ({}); it will be recomputed", seq_id,
                     swapped.on_disk ? "disk" : "host", lost);
    ++swap_counters_.lost_entries;
    free_sequence(seq_id);  // gives the tier's blocks and slot back
    return SwapIn::kLost;
  }
  allocate_blocks(static_cast<int32_t>(swapped.blocks.size()), entry.blocks);
  if (swapped.slot >= 0) {
    entry.state_slot = sequence_slots_.allocate();
    METRALE_CHECK(entry.state_slot >= 0, "no state slot for swapped sequence {}", seq_id);
  }
  for (size_t i = 0; i < entry.blocks.size(); ++i) {
    if (swapped.on_disk) {
      host_.load_packed_block(paged_storage_, reads[i].bytes, entry.blocks[i]);
      disk_->block_pool().release(swapped.blocks[i]);
    } else {
      host_.load_block(paged_storage_, swapped.blocks[i], entry.blocks[i]);
      host_.block_pool().release(swapped.blocks[i]);
    }
  }
  if (swapped.slot >= 0) {
    if (swapped.on_disk) {
      host_.load_packed_slot(slot_storage_, reads.back().bytes, entry.state_slot);
      disk_->slot_pool().free(swapped.slot);
    } else {
      host_.load_slot(slot_storage_, swapped.slot, entry.state_slot);
      host_.free_slot(swapped.slot);
    }
  }
  if (swapped.on_disk) synchronize_devices();  // the copies read `reads`, freed on return
  return SwapIn::kDone;
}

SwapIn CacheManager::swap_in(int64_t seq_id) {
  if (!can_swap_in(seq_id, 0)) return SwapIn::kNoRoom;
  const auto it = swapped_.find(seq_id);
  SequenceEntry entry;
  const SwapIn result = load_swapped(seq_id, it->second, entry);
  if (result != SwapIn::kDone) return result;
  ++swap_counters_.sequences_in;
  swap_counters_.blocks_in += static_cast<int64_t>(entry.blocks.size());
  swap_counters_.slots_in += entry.state_slot >= 0 ? 1 : 0;
  swapped_.erase(it);
  sequences_.emplace(seq_id, std::move(entry));
  return SwapIn::kDone;
}

void CacheManager::check_host_tier_integrity() const {
  std::vector<uint8_t> block_owned(static_cast<size_t>(host_.num_blocks()), 0);
  std::vector<uint8_t> slot_owned(static_cast<size_t>(host_.num_slots()), 0);
  int32_t blocks = 0, slots = 0;
  for (const auto& [seq_id, swapped] : swapped_) {
    METRALE_CHECK(!has_sequence(seq_id), "sequence {} is both resident and swapped out", seq_id);
    METRALE_CHECK(swapped.slot >= 0 || !needs_state_slot(), "swapped sequence {} kept no state", seq_id);
    if (swapped.on_disk) continue;  // check_disk_tier_integrity
    for (const int32_t block : swapped.blocks) {
      METRALE_CHECK(block >= 0 && block < host_.num_blocks() && host_.block_pool().ref_count(block) == 1 &&
                        !host_.block_pool().is_cached(block),
                    "swapped sequence {} holds host block {} that is not allocated to it", seq_id, block);
      METRALE_CHECK(block_owned[static_cast<size_t>(block)] == 0, "host block {} held twice", block);
      block_owned[static_cast<size_t>(block)] = 1;
      ++blocks;
    }
    if (swapped.slot >= 0) {
      METRALE_CHECK(host_.is_slot_allocated(swapped.slot) && !host_checkpoints_.holds(swapped.slot),
                    "swapped sequence {} holds host slot {} that is not allocated to it", seq_id, swapped.slot);
      METRALE_CHECK(slot_owned[static_cast<size_t>(swapped.slot)] == 0, "host slot {} held twice", swapped.slot);
      slot_owned[static_cast<size_t>(swapped.slot)] = 1;
      ++slots;
    }
  }
  // Blocks on their way to disk (write_back_host_blocks): held once, by the write alone.
  int32_t writing_cached = 0;
  for (const HostWriteAhead& write : host_writes_) {
    const int32_t block = write.host_block;
    METRALE_CHECK(block >= 0 && block < host_.num_blocks() && host_.block_pool().ref_count(block) == 1 &&
                      block_owned[static_cast<size_t>(block)] == 0,
                  "host block {} written ahead is held by something else", block);
    block_owned[static_cast<size_t>(block)] = 1;
    ++blocks;
    writing_cached += host_.block_pool().is_cached(block) ? 1 : 0;
  }
  const BlockPool& host_pool = host_.block_pool();
  METRALE_CHECK(blocks == host_pool.num_used() &&
                    host_pool.num_empty() + host_pool.num_cached() + host_pool.num_used() == host_pool.num_blocks(),
                "host tier: {} blocks held by swapped sequences and writes; used {} + cached {} + empty {} of {}",
                blocks, host_pool.num_used(), host_pool.num_cached(), host_pool.num_empty(), host_pool.num_blocks());
  int32_t indexed = 0;
  for (int32_t block = 0; block < host_pool.num_blocks(); ++block) {
    METRALE_CHECK(host_pool.is_cached(block) == host_prefix_.holds(block), "host block {}: cached {} but indexed {}",
                  block, host_pool.is_cached(block), host_prefix_.holds(block));
    METRALE_CHECK(
        !host_pool.is_cached(block) || host_pool.ref_count(block) == 0 || block_owned[static_cast<size_t>(block)],
        "host block {} is cached and held", block);
    if (host_prefix_.holds(block)) {
      METRALE_CHECK(host_prefix_.checkpoint(block) < 0, "host block {} has a block-bound state checkpoint", block);
      ++indexed;
    }
  }
  METRALE_CHECK(
      indexed == host_pool.num_cached() + writing_cached && static_cast<int32_t>(host_prefix_.size()) == indexed,
      "host prefix index has {} hashes for {} cached host blocks and {} being written", host_prefix_.size(),
      host_pool.num_cached(), writing_cached);
  int32_t checkpoints = 0;
  for (int32_t slot = 0; slot < host_.num_slots(); ++slot) {
    if (!host_checkpoints_.holds(slot)) continue;
    METRALE_CHECK(host_.is_slot_allocated(slot) && slot_owned[static_cast<size_t>(slot)] == 0 &&
                      host_checkpoints_.find(host_checkpoints_.hash_of(slot)) == slot,
                  "host checkpoint slot {} is not allocated to it alone", slot);
    ++checkpoints;
  }
  METRALE_CHECK(static_cast<size_t>(checkpoints) == host_checkpoints_.size() &&
                    slots + checkpoints == host_.num_used_slots() &&
                    host_.num_used_slots() + host_.num_free_slots() == host_.num_slots(),
                "host tier: {} slots held by swapped sequences and {} by checkpoints, {} used + {} free of {}", slots,
                checkpoints, host_.num_used_slots(), host_.num_free_slots(), host_.num_slots());
  const auto& counters = swap_counters_;
  METRALE_CHECK(counters.sequences_out - counters.sequences_in >= static_cast<int64_t>(swapped_.size()),
                "{} sequences swapped out, {} in, {} swapped now", counters.sequences_out, counters.sequences_in,
                swapped_.size());
  check_disk_tier_integrity();
}

void CacheManager::check_disk_tier_integrity() const {
  if (!disk_) {
    for (const auto& [seq_id, swapped] : swapped_)
      METRALE_CHECK(!swapped.on_disk, "sequence {} is swapped to a disk tier that does not exist", seq_id);
    return;
  }
  const BlockPool& disk_pool = disk_->block_pool();
  std::vector<uint8_t> block_owned(static_cast<size_t>(disk_->num_blocks()), 0);
  std::vector<uint8_t> slot_owned(static_cast<size_t>(disk_->num_slots()), 0);
  int32_t blocks = 0, slots = 0;
  for (const auto& [seq_id, swapped] : swapped_) {
    if (!swapped.on_disk) continue;
    for (const int32_t block : swapped.blocks) {
      METRALE_CHECK(block >= 0 && block < disk_->num_blocks() && disk_pool.ref_count(block) == 1 &&
                        !disk_pool.is_cached(block) && block_owned[static_cast<size_t>(block)] == 0,
                    "swapped sequence {} holds disk block {} that is not allocated to it alone", seq_id, block);
      block_owned[static_cast<size_t>(block)] = 1;
      ++blocks;
    }
    if (swapped.slot >= 0) {
      METRALE_CHECK(disk_->slot_pool().contains(swapped.slot) && disk_->slot_pool().is_allocated(swapped.slot) &&
                        !disk_checkpoints_.holds(swapped.slot) && slot_owned[static_cast<size_t>(swapped.slot)] == 0,
                    "swapped sequence {} holds disk slot {} that is not allocated to it alone", seq_id, swapped.slot);
      slot_owned[static_cast<size_t>(swapped.slot)] = 1;
      ++slots;
    }
  }
  METRALE_CHECK(blocks == disk_pool.num_used() &&
                    disk_pool.num_empty() + disk_pool.num_cached() + disk_pool.num_used() == disk_pool.num_blocks(),
                "disk tier: {} blocks held by swapped sequences; used {} + cached {} + empty {} of {}", blocks,
                disk_pool.num_used(), disk_pool.num_cached(), disk_pool.num_empty(), disk_pool.num_blocks());
  for (int32_t block = 0; block < disk_pool.num_blocks(); ++block) {
    METRALE_CHECK(disk_pool.is_cached(block) == disk_prefix_.holds(block), "disk block {}: cached {} but indexed {}",
                  block, disk_pool.is_cached(block), disk_prefix_.holds(block));
  }
  METRALE_CHECK(static_cast<int32_t>(disk_prefix_.size()) == disk_pool.num_cached(),
                "disk prefix index has {} hashes for {} cached disk blocks", disk_prefix_.size(),
                disk_pool.num_cached());
  int32_t checkpoints = 0;
  for (int32_t slot = 0; slot < disk_->num_slots(); ++slot) {
    if (!disk_checkpoints_.holds(slot)) continue;
    METRALE_CHECK(
        disk_->slot_pool().is_allocated(slot) && disk_checkpoints_.find(disk_checkpoints_.hash_of(slot)) == slot,
        "disk checkpoint slot {} is not allocated to it", slot);
    ++checkpoints;
  }
  METRALE_CHECK(static_cast<size_t>(checkpoints) == disk_checkpoints_.size() &&
                    slots + checkpoints == disk_->slot_pool().num_used(),
                "disk tier: {} slots held by swapped sequences and {} by checkpoints, {} used", slots, checkpoints,
                disk_->slot_pool().num_used());
}

}  // namespace metrale
