#include "cache/block_pool.h"

#include <algorithm>

#include "core/error.h"

namespace metrale {

BlockPool::BlockPool(int32_t num_blocks) {
  if (num_blocks < 0) raise(ErrorCode::kInvalidArgument, "negative block count {}", num_blocks);
  const auto n = static_cast<size_t>(num_blocks);
  ref_counts_.assign(n, 0);
  cached_.assign(n, 0);
  lru_prev_.assign(n + 1, -1);
  lru_next_.assign(n + 1, -1);
  lru_prev_[n] = lru_next_[n] = num_blocks;  // empty list: the sentinel points at itself
  empty_.reserve(n);
  // Lowest ids on top of the stack so that allocation order is 0, 1, 2, ...
  for (int32_t b = num_blocks - 1; b >= 0; --b) empty_.push_back(b);
}

int32_t BlockPool::ref_count(int32_t block) const {
  METRALE_CHECK(block >= 0 && block < num_blocks(), "block {} out of range", block);
  return ref_counts_[static_cast<size_t>(block)];
}

bool BlockPool::is_cached(int32_t block) const {
  METRALE_CHECK(block >= 0 && block < num_blocks(), "block {} out of range", block);
  return cached_[static_cast<size_t>(block)] != 0;
}

void BlockPool::lru_push_back(int32_t block) {
  const auto b = static_cast<size_t>(block), s = static_cast<size_t>(sentinel());
  const int32_t last = lru_prev_[s];
  lru_prev_[b] = last;
  lru_next_[b] = sentinel();
  lru_next_[static_cast<size_t>(last)] = block;
  lru_prev_[s] = block;
  ++num_lru_;
}

void BlockPool::lru_unlink(int32_t block) {
  const auto b = static_cast<size_t>(block);
  METRALE_CHECK(lru_prev_[b] >= 0, "block {} is not on the LRU list", block);
  lru_next_[static_cast<size_t>(lru_prev_[b])] = lru_next_[b];
  lru_prev_[static_cast<size_t>(lru_next_[b])] = lru_prev_[b];
  lru_prev_[b] = lru_next_[b] = -1;
  --num_lru_;
}

bool BlockPool::allocate(int32_t count, std::vector<int32_t>& out, std::vector<int32_t>* evicted) {
  if (count < 0 || count > num_free()) return false;
  const int32_t from_lru = std::max(0, count - num_empty());
  METRALE_CHECK(from_lru == 0 || evicted != nullptr, "allocation must evict {} cached blocks but nobody is told", from_lru);
  for (int32_t i = 0; i < count; ++i) {
    int32_t block = -1;
    if (!empty_.empty()) {
      block = empty_.back();
      empty_.pop_back();
    } else {
      block = lru_next_[static_cast<size_t>(sentinel())];  // least recently released
      lru_unlink(block);
      cached_[static_cast<size_t>(block)] = 0;
      evicted->push_back(block);
    }
    METRALE_CHECK(ref_counts_[static_cast<size_t>(block)] == 0, "free block {} has references", block);
    ref_counts_[static_cast<size_t>(block)] = 1;
    out.push_back(block);
  }
  return true;
}

void BlockPool::retain(int32_t block) {
  const int32_t refs = ref_count(block);
  if (refs == 0) {
    METRALE_CHECK(is_cached(block), "retain of free block {}", block);
    lru_unlink(block);
  }
  ++ref_counts_[static_cast<size_t>(block)];
}

void BlockPool::release(int32_t block) {
  METRALE_CHECK(ref_count(block) > 0, "double release of block {}", block);
  if (--ref_counts_[static_cast<size_t>(block)] > 0) return;
  if (is_cached(block)) {
    lru_push_back(block);
  } else {
    empty_.push_back(block);
  }
}

void BlockPool::mark_cached(int32_t block) {
  METRALE_CHECK(ref_count(block) > 0, "only a used block can become cached (block {})", block);
  cached_[static_cast<size_t>(block)] = 1;
}

void BlockPool::discard(int32_t block) {
  if (!is_cached(block)) return;
  if (ref_count(block) == 0) {
    lru_unlink(block);
    empty_.push_back(block);
  }
  cached_[static_cast<size_t>(block)] = 0;
}

std::vector<int32_t> BlockPool::lru_order() const {
  std::vector<int32_t> order;
  order.reserve(static_cast<size_t>(num_lru_));
  for (int32_t b = lru_next_[static_cast<size_t>(sentinel())]; b != sentinel(); b = lru_next_[static_cast<size_t>(b)])
    order.push_back(b);
  return order;
}

}  // namespace metrale
