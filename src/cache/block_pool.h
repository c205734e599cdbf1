// BlockPool: the free list and reference counts of the paged KV cache's blocks. It knows nothing
// of what a block holds; the CacheManager maps sequences to blocks.
// Invariant: num_free() + num_used() == num_blocks() at all times.
#pragma once

#include <cstdint>
#include <vector>

namespace metrale {

class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(ref_counts_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_blocks() - num_free(); }
  int32_t ref_count(int32_t block) const;

  // Takes `count` free blocks (ref count 1 each), or none at all when fewer are free.
  bool allocate(int32_t count, std::vector<int32_t>& out);
  // Adds a reference to a block in use (sharing).
  void retain(int32_t block);
  // Drops one reference; the block returns to the free list at zero.
  void release(int32_t block);

 private:
  std::vector<int32_t> ref_counts_;
  std::vector<int32_t> free_;  // stack: the most recently freed block is reused first
};

}  // namespace metrale
