#include "server/response_store.h"

namespace metrale::server {

void ResponseStore::put(StoredResponse stored) {
  if (limits_.max_responses == 0) return;
  const std::string id = stored.response.at("id").get<std::string>();
  const size_t size =
      stored.response.dump().size() + stored.conversation.dump().size() + stored.input_items.dump().size() + id.size();
  auto shared = std::make_shared<const StoredResponse>(std::move(stored));
  std::lock_guard lock(mutex_);
  if (const auto it = index_.find(id); it != index_.end()) {
    bytes_ -= it->second->bytes;
    entries_.erase(it->second);
    index_.erase(it);
  }
  if (size > limits_.max_bytes) return;
  entries_.push_front(Entry{id, std::move(shared), size});
  index_[id] = entries_.begin();
  bytes_ += size;
  evict_locked();
}

void ResponseStore::evict_locked() {
  while (!entries_.empty() && (entries_.size() > limits_.max_responses || bytes_ > limits_.max_bytes)) {
    bytes_ -= entries_.back().bytes;
    index_.erase(entries_.back().id);
    entries_.pop_back();
  }
}

std::shared_ptr<const StoredResponse> ResponseStore::get(const std::string& id) {
  std::lock_guard lock(mutex_);
  const auto it = index_.find(id);
  if (it == index_.end()) return nullptr;
  entries_.splice(entries_.begin(), entries_, it->second);
  return it->second->stored;
}

bool ResponseStore::erase(const std::string& id) {
  std::lock_guard lock(mutex_);
  const auto it = index_.find(id);
  if (it == index_.end()) return false;
  bytes_ -= it->second->bytes;
  entries_.erase(it->second);
  index_.erase(it);
  return true;
}

size_t ResponseStore::size() const {
  std::lock_guard lock(mutex_);
  return entries_.size();
}

size_t ResponseStore::bytes() const {
  std::lock_guard lock(mutex_);
  return bytes_;
}

}  // namespace metrale::server
