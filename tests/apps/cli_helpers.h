// Runs the built `metrale` command (build/bin/metrale) as a user would, for the tests that drive it.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace metrale::testing {

struct CommandResult {
  int exit_code = -1;  // -1: the command could not be started or did not exit normally
  std::string out;     // stdout
  std::string err;     // stderr
};

// Runs `metrale <args>` through the shell (so `args` is split and quoted as a shell would).
CommandResult run_metrale(const std::string& args);

// Token ids as the comma-separated list of --tokens and --prompt-ids.
std::string join_ids(const nlohmann::json& ids);

}  // namespace metrale::testing
