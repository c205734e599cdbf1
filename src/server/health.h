// GET /health: whether the engine serves (AsyncEngine::health). 200 {"status":"ok"} while it
// does; 503 {"status":"error","reason":...} when it cannot: it failed for good (a failed step
// whose recovery failed), or it is shutting down. A failed step whose requests failed and whose
// engine serves on is not a reason: /health stays ok.
#pragma once

#include <string>

#include "engine/engine.h"

namespace metrale::server {

struct HealthReply {
  int status = 200;
  std::string body;  // JSON
};

HealthReply health_reply(const EngineHealth& health);

}  // namespace metrale::server
