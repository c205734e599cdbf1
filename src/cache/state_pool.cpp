#include "cache/state_pool.h"

#include "core/error.h"

namespace metrale {

StatePool::StatePool(int32_t first_slot, int32_t num_slots) : first_(first_slot) {
  if (first_slot < 0 || num_slots < 0)
    raise(ErrorCode::kInvalidArgument, "state slot range [{}, +{}) is invalid", first_slot, num_slots);
  allocated_.assign(static_cast<size_t>(num_slots), 0);
  free_.reserve(static_cast<size_t>(num_slots));
  for (int32_t i = num_slots - 1; i >= 0; --i) free_.push_back(first_slot + i);
}

bool StatePool::is_allocated(int32_t slot) const {
  METRALE_CHECK(contains(slot), "state slot {} is outside [{}, {})", slot, first_, first_ + num_slots());
  return allocated_[static_cast<size_t>(slot - first_)] != 0;
}

int32_t StatePool::allocate() {
  if (free_.empty()) return -1;
  const int32_t slot = free_.back();
  free_.pop_back();
  allocated_[static_cast<size_t>(slot - first_)] = 1;
  return slot;
}

void StatePool::free(int32_t slot) {
  METRALE_CHECK(is_allocated(slot), "double free of state slot {}", slot);
  allocated_[static_cast<size_t>(slot - first_)] = 0;
  free_.push_back(slot);
}

}  // namespace metrale
