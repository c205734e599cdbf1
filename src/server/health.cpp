#include "server/health.h"

#include <nlohmann/json.hpp>

namespace metrale::server {

HealthReply health_reply(const EngineHealth& health) {
  if (health.serving) return {200, nlohmann::json{{"status", "ok"}}.dump()};
  return {503, nlohmann::json{{"status", "error"}, {"reason", health.reason}}.dump()};
}

}  // namespace metrale::server
