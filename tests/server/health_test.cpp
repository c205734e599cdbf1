// GET /health's reply (server/health.h): ok while the engine serves, 503 with the reason once it
// cannot.
#include "server/health.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace metrale::server {
namespace {

TEST(Health, OkWhileServingElseTheReason) {
  const HealthReply ok = health_reply(EngineHealth{});
  EXPECT_EQ(ok.status, 200);
  EXPECT_EQ(nlohmann::json::parse(ok.body), (nlohmann::json{{"status", "ok"}}));
  const HealthReply down = health_reply(EngineHealth{false, "the device \"0\" failed"});
  EXPECT_EQ(down.status, 503);
  const auto body = nlohmann::json::parse(down.body);
  EXPECT_EQ(body.at("status"), "error");
  EXPECT_EQ(body.at("reason"), "the device \"0\" failed");
}

}  // namespace
}  // namespace metrale::server
