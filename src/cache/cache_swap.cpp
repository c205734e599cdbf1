// CacheManager's host tier: swapping a sequence's blocks and state slot out to host memory and back.
#include <algorithm>

#include "cache/cache_manager.h"
#include "core/error.h"

namespace metrale {

bool CacheManager::can_swap_out(int64_t seq_id) const {
  const auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) return false;
  const SequenceEntry& entry = it->second;
  if (host_.num_blocks() == 0 && host_.num_slots() == 0) return false;  // no tier
  if (static_cast<int32_t>(entry.blocks.size()) > host_.num_free_blocks()) return false;
  return entry.state_slot < 0 || host_.num_free_slots() > 0;
}

bool CacheManager::swap_out(int64_t seq_id) {
  if (!can_swap_out(seq_id)) return false;
  const auto it = sequences_.find(seq_id);
  const SequenceEntry& entry = it->second;
  SwappedEntry swapped;
  swapped.host_blocks.reserve(entry.blocks.size());
  for (const int32_t block : entry.blocks) {
    const int32_t host_block = host_.allocate_block();
    host_.store_block(paged_storage_, block, host_block);
    swapped.host_blocks.push_back(host_block);
  }
  if (entry.state_slot >= 0) {
    swapped.host_slot = host_.allocate_slot();
    host_.store_slot(slot_storage_, entry.state_slot, swapped.host_slot);
  }
  // The copies are queued ahead of any later write to the released blocks and slot.
  ++swap_counters_.sequences_out;
  swap_counters_.blocks_out += static_cast<int64_t>(swapped.host_blocks.size());
  swap_counters_.slots_out += swapped.host_slot >= 0 ? 1 : 0;
  free_sequence(seq_id);
  swapped_.emplace(seq_id, std::move(swapped));
  return true;
}

int32_t CacheManager::swapped_blocks(int64_t seq_id) const {
  const auto it = swapped_.find(seq_id);
  METRALE_CHECK(it != swapped_.end(), "sequence {} is not swapped out", seq_id);
  return static_cast<int32_t>(it->second.host_blocks.size());
}

bool CacheManager::can_swap_in(int64_t seq_id, int64_t total_tokens) const {
  const auto it = swapped_.find(seq_id);
  if (it == swapped_.end()) return false;
  const int32_t blocks = std::max(static_cast<int32_t>(it->second.host_blocks.size()), blocks_for(total_tokens));
  if (blocks > pool_.num_free()) return false;
  return it->second.host_slot < 0 || sequence_slots_.num_free() > 0;
}

bool CacheManager::swap_in(int64_t seq_id) {
  if (!can_swap_in(seq_id, 0)) return false;
  const auto it = swapped_.find(seq_id);
  const SwappedEntry& swapped = it->second;
  SequenceEntry entry;
  allocate_blocks(static_cast<int32_t>(swapped.host_blocks.size()), entry.blocks);
  for (size_t i = 0; i < entry.blocks.size(); ++i) {
    host_.load_block(paged_storage_, swapped.host_blocks[i], entry.blocks[i]);
    host_.free_block(swapped.host_blocks[i]);
  }
  if (swapped.host_slot >= 0) {
    entry.state_slot = sequence_slots_.allocate();
    METRALE_CHECK(entry.state_slot >= 0, "no state slot for swapped sequence {}", seq_id);
    host_.load_slot(slot_storage_, swapped.host_slot, entry.state_slot);
    host_.free_slot(swapped.host_slot);
  }
  ++swap_counters_.sequences_in;
  swap_counters_.blocks_in += static_cast<int64_t>(entry.blocks.size());
  swap_counters_.slots_in += entry.state_slot >= 0 ? 1 : 0;
  swapped_.erase(it);
  sequences_.emplace(seq_id, std::move(entry));
  return true;
}

void CacheManager::check_host_tier_integrity() const {
  std::vector<uint8_t> block_owned(static_cast<size_t>(host_.num_blocks()), 0);
  std::vector<uint8_t> slot_owned(static_cast<size_t>(host_.num_slots()), 0);
  int32_t blocks = 0, slots = 0;
  for (const auto& [seq_id, swapped] : swapped_) {
    METRALE_CHECK(!has_sequence(seq_id), "sequence {} is both resident and swapped out", seq_id);
    for (const int32_t block : swapped.host_blocks) {
      METRALE_CHECK(host_.is_block_allocated(block), "swapped sequence {} holds host block {} that is not allocated",
                    seq_id, block);
      METRALE_CHECK(block_owned[static_cast<size_t>(block)] == 0, "host block {} held twice", block);
      block_owned[static_cast<size_t>(block)] = 1;
      ++blocks;
    }
    if (swapped.host_slot >= 0) {
      METRALE_CHECK(host_.is_slot_allocated(swapped.host_slot),
                    "swapped sequence {} holds host slot {} that is not allocated", seq_id, swapped.host_slot);
      METRALE_CHECK(slot_owned[static_cast<size_t>(swapped.host_slot)] == 0, "host slot {} held twice", swapped.host_slot);
      slot_owned[static_cast<size_t>(swapped.host_slot)] = 1;
      ++slots;
    } else {
      METRALE_CHECK(!needs_state_slot(), "swapped sequence {} kept no state", seq_id);
    }
  }
  METRALE_CHECK(blocks == host_.num_used_blocks() && host_.num_used_blocks() + host_.num_free_blocks() == host_.num_blocks(),
                "host tier: {} blocks held by swapped sequences, {} used + {} free of {}", blocks,
                host_.num_used_blocks(), host_.num_free_blocks(), host_.num_blocks());
  METRALE_CHECK(slots == host_.num_used_slots() && host_.num_used_slots() + host_.num_free_slots() == host_.num_slots(),
                "host tier: {} slots held by swapped sequences, {} used + {} free of {}", slots, host_.num_used_slots(),
                host_.num_free_slots(), host_.num_slots());
  const auto& counters = swap_counters_;
  METRALE_CHECK(counters.sequences_out - counters.sequences_in >= static_cast<int64_t>(swapped_.size()),
                "{} sequences swapped out, {} in, {} swapped now", counters.sequences_out, counters.sequences_in,
                swapped_.size());
}

}  // namespace metrale
