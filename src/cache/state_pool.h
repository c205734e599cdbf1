// StatePool: the free list of a range of state slot ids. A slot is one index into every per-slot
// cache tensor of every block ([num_slots, ...shape]); the pool only hands out
// ids, the CacheManager owns the memory. Slots [first, first + count) belong to the pool.
// Invariant: num_free() + num_used() == num_slots().
#pragma once

#include <cstdint>
#include <vector>

namespace metrale {

class StatePool {
 public:
  StatePool() = default;
  StatePool(int32_t first_slot, int32_t num_slots);

  int32_t first_slot() const { return first_; }
  int32_t num_slots() const { return static_cast<int32_t>(allocated_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_slots() - num_free(); }
  bool contains(int32_t slot) const { return slot >= first_ && slot < first_ + num_slots(); }
  bool is_allocated(int32_t slot) const;

  // A free slot id (lowest first after start-up), or -1 when none is free.
  int32_t allocate();
  // Returns a slot to the pool; freeing a slot that is not allocated is an internal error.
  void free(int32_t slot);

 private:
  int32_t first_ = 0;
  std::vector<uint8_t> allocated_;  // per slot of the range
  std::vector<int32_t> free_;       // stack
};

}  // namespace metrale
