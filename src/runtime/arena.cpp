#include "runtime/arena.h"

#include <algorithm>

#include "core/error.h"
#include "core/strings.h"

namespace metrale {

Arena::Arena(Device device, size_t initial_bytes, bool growable) : device_(device), growable_(growable) {
  if (initial_bytes > 0) chunks_.emplace_back(device, initial_bytes);
}

Tensor Arena::alloc(DType dtype, Shape shape) {
  const size_t bytes = (static_cast<size_t>(shape.numel()) * dtype_size(dtype) + Buffer::kAlignment - 1) /
                       Buffer::kAlignment * Buffer::kAlignment;
  while (chunk_index_ < chunks_.size() && offset_ + bytes > chunks_[chunk_index_].size()) {
    ++chunk_index_;
    offset_ = 0;
  }
  if (chunk_index_ == chunks_.size()) {
    if (!growable_) {
      raise(ErrorCode::kOutOfMemory, "workspace arena of {} on {} exhausted by a request for {}",
            format_bytes(chunks_.empty() ? 0 : chunks_.front().size()), device_.to_string(), format_bytes(bytes));
    }
    const size_t last = chunks_.empty() ? 0 : chunks_.back().size();
    chunks_.emplace_back(device_, std::max({bytes, last * 2, size_t{1} << 20}));
    offset_ = 0;
  }
  void* data = static_cast<char*>(chunks_[chunk_index_].data()) + offset_;
  offset_ += bytes;
  used_ += bytes;
  high_water_ = std::max(high_water_, used_);
  return Tensor(data, dtype, shape, device_);
}

size_t Arena::capacity_bytes() const {
  size_t total = 0;
  for (const auto& chunk : chunks_) total += chunk.size();
  return total;
}

void Arena::reserve(size_t bytes, bool growable) {
  chunks_.clear();
  chunks_.emplace_back(device_, bytes);
  growable_ = growable;
  chunk_index_ = 0;
  offset_ = 0;
  used_ = 0;
  high_water_ = 0;
}

void Arena::reset() {
  // Fold growth into one chunk so that steady-state steps use a single contiguous allocation.
  if (chunks_.size() > 1 && growable_) {
    const size_t total = high_water_;
    chunks_.clear();
    chunks_.emplace_back(device_, total);
  }
  chunk_index_ = 0;
  offset_ = 0;
  used_ = 0;
}

}  // namespace metrale
