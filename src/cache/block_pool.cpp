#include "cache/block_pool.h"

#include "core/error.h"

namespace metrale {

BlockPool::BlockPool(int32_t num_blocks) {
  if (num_blocks < 0) raise(ErrorCode::kInvalidArgument, "negative block count {}", num_blocks);
  ref_counts_.assign(static_cast<size_t>(num_blocks), 0);
  free_.reserve(static_cast<size_t>(num_blocks));
  // Lowest ids on top of the stack so that allocation order is 0, 1, 2, ...
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

int32_t BlockPool::ref_count(int32_t block) const {
  METRALE_CHECK(block >= 0 && block < num_blocks(), "block {} out of range", block);
  return ref_counts_[static_cast<size_t>(block)];
}

bool BlockPool::allocate(int32_t count, std::vector<int32_t>& out) {
  if (count < 0 || count > num_free()) return false;
  for (int32_t i = 0; i < count; ++i) {
    const int32_t block = free_.back();
    free_.pop_back();
    METRALE_CHECK(ref_counts_[static_cast<size_t>(block)] == 0, "free block {} has references", block);
    ref_counts_[static_cast<size_t>(block)] = 1;
    out.push_back(block);
  }
  return true;
}

void BlockPool::retain(int32_t block) {
  METRALE_CHECK(ref_count(block) > 0, "retain of free block {}", block);
  ++ref_counts_[static_cast<size_t>(block)];
}

void BlockPool::release(int32_t block) {
  METRALE_CHECK(ref_count(block) > 0, "double release of block {}", block);
  if (--ref_counts_[static_cast<size_t>(block)] == 0) free_.push_back(block);
}

}  // namespace metrale
