// CheckpointIndex: the recurrent-state checkpoints a host or disk tier keeps, keyed by the prefix
// hash of the block they follow (the state after that block's last token), so that a checkpoint
// outlives the device slot and the device block it was taken with. Slots are the tier's own ids
// [0, num_slots); the index knows which hold a checkpoint and when each was last made or used, for
// LRU eviction. A hash names its whole prefix (prefix_cache.h), so one checkpoint per hash.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "cache/prefix_cache.h"

namespace metrale {

class CheckpointIndex {
 public:
  explicit CheckpointIndex(int32_t num_slots = 0)
      : hashes_(static_cast<size_t>(num_slots)),
        used_at_(static_cast<size_t>(num_slots), 0),
        valid_(static_cast<size_t>(num_slots), 0) {}

  size_t size() const { return by_hash_.size(); }
  // The slot holding the checkpoint after the prefix `hash`, or -1.
  int32_t find(const BlockHash& hash) const {
    const auto it = by_hash_.find(hash);
    return it == by_hash_.end() ? -1 : it->second;
  }
  bool holds(int32_t slot) const {
    return slot >= 0 && static_cast<size_t>(slot) < valid_.size() && valid_[static_cast<size_t>(slot)] != 0;
  }
  const BlockHash& hash_of(int32_t slot) const { return hashes_[static_cast<size_t>(slot)]; }
  // `slot` (holding nothing) now holds the checkpoint after `hash` (not indexed yet).
  void insert(const BlockHash& hash, int32_t slot) {
    const auto s = static_cast<size_t>(slot);
    hashes_[s] = hash;
    valid_[s] = 1;
    used_at_[s] = ++clock_;
    by_hash_.emplace(hash, slot);
  }
  void erase(int32_t slot) {
    const auto s = static_cast<size_t>(slot);
    if (valid_[s] == 0) return;
    by_hash_.erase(hashes_[s]);
    valid_[s] = 0;
  }
  void touch(int32_t slot) { used_at_[static_cast<size_t>(slot)] = ++clock_; }
  // The least recently made or used checkpoint's slot, or -1 when none is held.
  int32_t least_recent() const {
    int32_t oldest = -1;
    for (size_t s = 0; s < valid_.size(); ++s) {
      if (valid_[s] != 0 && (oldest < 0 || used_at_[s] < used_at_[static_cast<size_t>(oldest)]))
        oldest = static_cast<int32_t>(s);
    }
    return oldest;
  }

 private:
  std::vector<BlockHash> hashes_;  // per slot
  std::vector<uint64_t> used_at_;
  std::vector<uint8_t> valid_;
  std::unordered_map<BlockHash, int32_t, BlockHashHasher> by_hash_;
  uint64_t clock_ = 0;
};

}  // namespace metrale
