// BlockPool: the free lists and reference counts of the paged KV cache's blocks. It knows nothing
// of what a block holds; the CacheManager maps sequences to blocks and the PrefixCache maps token
// hashes to blocks.
//
// A block is in exactly one of three states:
// - used: referenced by at least one block table (ref_count > 0);
// - empty: unreferenced and holding nothing reusable (on the empty stack);
// - cached: unreferenced but holding a full block of a prefix that may be reused (on the LRU list).
// Allocation takes empty blocks first and evicts cached blocks, least recently released first,
// only when no empty block is left; the caller is told which blocks it evicted so that it can
// forget their hashes. A cached block can be revived (retain) without being evicted.
// Invariants: num_empty() + num_cached() + num_used() == num_blocks(); num_free() is what an
// allocation can take (empty + cached).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace metrale {

class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(ref_counts_.size()); }
  int32_t num_empty() const { return static_cast<int32_t>(empty_.size()); }
  int32_t num_cached() const { return num_lru_; }
  int32_t num_free() const { return num_empty() + num_cached(); }
  int32_t num_used() const { return num_blocks() - num_free(); }
  int32_t ref_count(int32_t block) const;
  // Whether the block holds a reusable prefix (used or not).
  bool is_cached(int32_t block) const;

  // Takes `count` free blocks (ref count 1 each), or none at all when fewer are free. Cached
  // blocks taken are no longer cached and are appended to `evicted`, which must be given whenever
  // cached blocks exist.
  bool allocate(int32_t count, std::vector<int32_t>& out, std::vector<int32_t>* evicted = nullptr);
  // Adds a reference to a used block (sharing), or revives a cached free block (prefix hit).
  void retain(int32_t block);
  // Drops one reference; at zero a cached block joins the LRU list as its most recent entry and
  // any other block goes back on the empty stack.
  void release(int32_t block);
  // Marks a used block as holding a reusable prefix: when its last reference goes, it stays cached.
  void mark_cached(int32_t block);
  // The block no longer holds a reusable prefix (its contents were found lost): a cached free
  // block goes back on the empty stack, a used one is freed empty when its last reference goes.
  void discard(int32_t block);

  // Cached free blocks from least to most recently released (for tests and integrity checks).
  std::vector<int32_t> lru_order() const;
  // The least recently released cached free block (the next to be evicted), or -1.
  int32_t least_recent_cached() const { return num_lru_ == 0 ? -1 : lru_next_[static_cast<size_t>(sentinel())]; }

 private:
  void lru_push_back(int32_t block);
  void lru_unlink(int32_t block);
  int32_t sentinel() const { return num_blocks(); }

  std::vector<int32_t> ref_counts_;
  std::vector<uint8_t> cached_;  // per block: holds a reusable prefix
  std::vector<int32_t> empty_;   // stack: the most recently freed block is reused first
  // Intrusive doubly linked LRU list of cached free blocks; index num_blocks() is the sentinel
  // (its next is the least recently released block).
  std::vector<int32_t> lru_prev_, lru_next_;
  int32_t num_lru_ = 0;
};

}  // namespace metrale
