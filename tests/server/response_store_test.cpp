// The bounded store behind previous_response_id: least recently used out first, by count and by
// bytes; a store of size 0 keeps nothing.
#include "server/response_store.h"

#include <gtest/gtest.h>

namespace metrale::server {
namespace {

using json = nlohmann::ordered_json;

StoredResponse stored(const std::string& id, size_t padding = 0) {
  return StoredResponse{json{{"id", id}, {"object", "response"}},
                        json::array({json{{"type", "message"}, {"text", std::string(padding, 'x')}}})};
}

TEST(ResponseStore, KeepsWhatItStores) {
  ResponseStore store({4, 1 << 20});
  store.put(stored("a"));
  const auto got = store.get("a");
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->response["id"], "a");
  EXPECT_EQ(got->conversation.size(), 1u);
  EXPECT_EQ(store.get("b"), nullptr);
  EXPECT_EQ(store.size(), 1u);
}

TEST(ResponseStore, EvictsTheLeastRecentlyUsedBeyondTheCount) {
  ResponseStore store({2, 1 << 20});
  store.put(stored("a"));
  store.put(stored("b"));
  ASSERT_NE(store.get("a"), nullptr);  // a is now the most recent
  store.put(stored("c"));
  EXPECT_NE(store.get("a"), nullptr);
  EXPECT_EQ(store.get("b"), nullptr);
  EXPECT_NE(store.get("c"), nullptr);
  EXPECT_EQ(store.size(), 2u);
}

TEST(ResponseStore, EvictsBeyondTheBytes) {
  ResponseStore store({100, 3000});
  store.put(stored("a", 1000));
  store.put(stored("b", 1000));
  EXPECT_EQ(store.size(), 2u);
  store.put(stored("c", 1000));
  EXPECT_EQ(store.get("a"), nullptr);
  EXPECT_LE(store.bytes(), 3000u);
  store.put(stored("huge", 5000));  // larger than the whole store: not kept, nothing else evicted for it
  EXPECT_EQ(store.get("huge"), nullptr);
  EXPECT_NE(store.get("c"), nullptr);
}

TEST(ResponseStore, ReplaceAndErase) {
  ResponseStore store({4, 1 << 20});
  store.put(stored("a", 10));
  store.put(stored("a", 20));
  EXPECT_EQ(store.size(), 1u);
  EXPECT_EQ(store.get("a")->conversation[0]["text"].get<std::string>().size(), 20u);
  const size_t bytes = store.bytes();
  EXPECT_GT(bytes, 20u);
  EXPECT_TRUE(store.erase("a"));
  EXPECT_FALSE(store.erase("a"));
  EXPECT_EQ(store.size(), 0u);
  EXPECT_EQ(store.bytes(), 0u);
}

TEST(ResponseStore, SizeZeroKeepsNothing) {
  ResponseStore store({0, 1 << 20});
  store.put(stored("a"));
  EXPECT_EQ(store.get("a"), nullptr);
  EXPECT_EQ(store.size(), 0u);
}

TEST(ResponseStore, AHeldResponseOutlivesItsEviction) {
  ResponseStore store({1, 1 << 20});
  store.put(stored("a"));
  const auto held = store.get("a");
  store.put(stored("b"));
  EXPECT_EQ(store.get("a"), nullptr);
  EXPECT_EQ(held->response["id"], "a");
}

}  // namespace
}  // namespace metrale::server
