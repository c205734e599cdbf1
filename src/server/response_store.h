// Responses kept for previous_response_id and GET /v1/responses/{id}: a bounded in-memory store,
// least recently used out first, bounded by count and by bytes (the JSON text of what it holds).
// Thread-safe: workers read it while preparing requests, I/O threads write it as responses end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>

namespace metrale::server {

struct ResponseStoreLimits {
  size_t max_responses = 1000;           // 0: nothing is stored (previous_response_id always 404s)
  size_t max_bytes = size_t{256} << 20;  // of the stored JSON, all responses together
};

struct StoredResponse {
  nlohmann::ordered_json response;  // the response object as answered
  // The whole conversation up to and including this response: the items of the responses it
  // continues, its own input items and its output items (an array). previous_response_id replays it.
  nlohmann::ordered_json conversation;
  // The response's own input items, each with an id (GET /v1/responses/{id}/input_items).
  nlohmann::ordered_json input_items = nlohmann::ordered_json::array();
};

class ResponseStore {
 public:
  explicit ResponseStore(ResponseStoreLimits limits = {}) : limits_(limits) {}

  // Stores (or replaces) a response under response["id"]; evicts the least recently used ones
  // beyond the limits. A response larger than max_bytes alone is not stored.
  void put(StoredResponse stored);
  // The response, marked recently used; nullptr when it is not (or no longer) stored.
  std::shared_ptr<const StoredResponse> get(const std::string& id);
  // Whether it was there.
  bool erase(const std::string& id);

  size_t size() const;
  size_t bytes() const;
  const ResponseStoreLimits& limits() const { return limits_; }

 private:
  struct Entry {
    std::string id;
    std::shared_ptr<const StoredResponse> stored;
    size_t bytes = 0;
  };
  void evict_locked();

  ResponseStoreLimits limits_;
  mutable std::mutex mutex_;
  std::list<Entry> entries_;  // most recently used first
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;
  size_t bytes_ = 0;
};

}  // namespace metrale::server
