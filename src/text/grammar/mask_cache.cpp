#include "text/grammar/mask_cache.h"

namespace metrale::grammar {

size_t PositionMask::memory_bytes() const {
  return accepted_bits.size() * sizeof(uint32_t) + accepted_ids.size() * sizeof(int32_t) + uncertain.memory_bytes();
}

std::shared_ptr<const RuleMasks> RuleMaskCache::find(const std::string& key) {
  const std::lock_guard lock(mutex_);
  const auto it = entries_.find(key);
  if (it == entries_.end()) return nullptr;
  ages_.splice(ages_.begin(), ages_, it->second.age);
  return it->second.masks;
}

void RuleMaskCache::insert(const std::string& key, std::shared_ptr<const RuleMasks> masks) {
  size_t size = key.size();
  for (const PositionMask& mask : *masks) size += mask.memory_bytes() + sizeof(PositionMask);
  const std::lock_guard lock(mutex_);
  if (entries_.contains(key) || size > max_bytes_) return;
  ages_.push_front(key);
  entries_.emplace(key, Entry{std::move(masks), size, ages_.begin()});
  bytes_ += size;
  while (bytes_ > max_bytes_ && !ages_.empty()) {
    const auto oldest = entries_.find(ages_.back());
    bytes_ -= oldest->second.bytes;
    entries_.erase(oldest);
    ages_.pop_back();
  }
}

size_t RuleMaskCache::size() const {
  const std::lock_guard lock(mutex_);
  return entries_.size();
}

size_t RuleMaskCache::bytes() const {
  const std::lock_guard lock(mutex_);
  return bytes_;
}

}  // namespace metrale::grammar
