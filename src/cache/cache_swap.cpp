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
  METRALE_CHECK(take_host_blocks(static_cast<int32_t>(entry.blocks.size()), swapped.host_blocks),
                "host tier: {} blocks not free for sequence {}", entry.blocks.size(), seq_id);
  for (size_t i = 0; i < entry.blocks.size(); ++i) host_.store_block(paged_storage_, entry.blocks[i], swapped.host_blocks[i]);
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
    host_.block_pool().release(swapped.host_blocks[i]);
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

bool CacheManager::take_host_blocks(int32_t count, std::vector<int32_t>& out) {
  std::vector<int32_t> evicted;
  if (!host_.block_pool().allocate(count, out, &evicted)) return false;
  for (const int32_t block : evicted) host_prefix_.erase(block);  // no checkpoints on the host
  return true;
}

void CacheManager::offload_evicted_block(int32_t block) {
  // Hybrid models: a prefix is usable only with its state checkpoint, which the host tier does
  // not keep, so their evicted blocks are simply dropped.
  if (host_.num_blocks() == 0 || has_slots_ || !prefix_.holds(block)) return;
  const BlockHash& hash = prefix_.hash_of(block);
  if (host_prefix_.find(hash) >= 0) return;  // the host already holds this prefix block
  std::vector<int32_t> taken;
  if (!take_host_blocks(1, taken)) return;  // every host block holds a swapped sequence
  const int32_t host_block = taken.front();
  host_.store_block(paged_storage_, block, host_block);  // queued before the block's next writer
  METRALE_CHECK(host_prefix_.insert(host_block, hash, prefix_.parent_of(block), prefix_.tokens_of(block)),
                "host prefix index refused block {}", host_block);
  host_.block_pool().mark_cached(host_block);
  host_.block_pool().release(host_block);  // the most recent entry of the host LRU list
  ++swap_counters_.prefix_blocks_out;
}

void CacheManager::restore_host_hits(SequenceEntry& entry, std::span<const int32_t> tokens,
                                     const std::vector<HostHit>& hits) {
  // The device blocks of the match are retained, so the allocation below cannot evict them; the
  // host blocks are pinned (retained) so that offloading what it evicts cannot take them either.
  size_t restorable = std::min(hits.size(), static_cast<size_t>(pool_.num_free()));
  if (restorable < hits.size()) {
    const size_t cut = hits[restorable].index;
    for (size_t i = entry.blocks.size(); i-- > cut;)
      if (entry.blocks[i] >= 0) pool_.release(entry.blocks[i]);
    entry.blocks.resize(cut);
    entry.hashes.resize(cut);
  }
  for (size_t h = 0; h < restorable; ++h) host_.block_pool().retain(hits[h].host_block);
  std::vector<int32_t> fresh;
  allocate_blocks(static_cast<int32_t>(restorable), fresh);
  const auto block_size = static_cast<size_t>(config_.block_size);
  for (size_t h = 0; h < restorable; ++h) {
    const size_t i = hits[h].index;
    const int32_t block = fresh[h];
    host_.load_block(paged_storage_, hits[h].host_block, block);
    entry.blocks[i] = block;
    const BlockHash parent = i == 0 ? BlockHash{} : entry.hashes[i - 1];
    METRALE_CHECK(prefix_.insert(block, entry.hashes[i], parent, tokens.subspan(i * block_size, block_size)),
                  "block {} restored from the host tier is already indexed", block);
    pool_.mark_cached(block);
    host_.block_pool().release(hits[h].host_block);  // stays cached on the host, most recently used
  }
  swap_counters_.prefix_blocks_in += static_cast<int64_t>(restorable);
}

void CacheManager::check_host_tier_integrity() const {
  std::vector<uint8_t> block_owned(static_cast<size_t>(host_.num_blocks()), 0);
  std::vector<uint8_t> slot_owned(static_cast<size_t>(host_.num_slots()), 0);
  int32_t blocks = 0, slots = 0;
  for (const auto& [seq_id, swapped] : swapped_) {
    METRALE_CHECK(!has_sequence(seq_id), "sequence {} is both resident and swapped out", seq_id);
    for (const int32_t block : swapped.host_blocks) {
      METRALE_CHECK(block >= 0 && block < host_.num_blocks() && host_.block_pool().ref_count(block) == 1 &&
                        !host_.block_pool().is_cached(block),
                    "swapped sequence {} holds host block {} that is not allocated to it", seq_id, block);
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
  const BlockPool& host_pool = host_.block_pool();
  METRALE_CHECK(blocks == host_pool.num_used() &&
                    host_pool.num_empty() + host_pool.num_cached() + host_pool.num_used() == host_pool.num_blocks(),
                "host tier: {} blocks held by swapped sequences; used {} + cached {} + empty {} of {}", blocks,
                host_pool.num_used(), host_pool.num_cached(), host_pool.num_empty(), host_pool.num_blocks());
  int32_t indexed = 0;
  for (int32_t block = 0; block < host_pool.num_blocks(); ++block) {
    METRALE_CHECK(host_pool.is_cached(block) == host_prefix_.holds(block), "host block {}: cached {} but indexed {}",
                  block, host_pool.is_cached(block), host_prefix_.holds(block));
    METRALE_CHECK(!host_pool.is_cached(block) || host_pool.ref_count(block) == 0,
                  "host block {} is cached and held", block);
    if (host_prefix_.holds(block)) {
      METRALE_CHECK(host_prefix_.checkpoint(block) < 0, "host block {} has a state checkpoint", block);
      ++indexed;
    }
  }
  METRALE_CHECK(indexed == host_pool.num_cached() && static_cast<int32_t>(host_prefix_.size()) == indexed,
                "host prefix index has {} hashes for {} cached host blocks", host_prefix_.size(), host_pool.num_cached());
  METRALE_CHECK(slots == host_.num_used_slots() && host_.num_used_slots() + host_.num_free_slots() == host_.num_slots(),
                "host tier: {} slots held by swapped sequences, {} used + {} free of {}", slots, host_.num_used_slots(),
                host_.num_free_slots(), host_.num_slots());
  const auto& counters = swap_counters_;
  METRALE_CHECK(counters.sequences_out - counters.sequences_in >= static_cast<int64_t>(swapped_.size()),
                "{} sequences swapped out, {} in, {} swapped now", counters.sequences_out, counters.sequences_in,
                swapped_.size());
}

}  // namespace metrale
