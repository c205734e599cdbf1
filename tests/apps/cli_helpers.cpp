#include "apps/cli_helpers.h"

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>

#include "core/strings.h"

namespace metrale::testing {

CommandResult run_metrale(const std::string& args) {
  static const std::string binary = std::string(METRALE_BINARY_DIR) + "/bin/metrale";
  // stderr goes to a file of this process: a second pipe would need a poll loop to avoid deadlock.
  const auto err_path = std::filesystem::temp_directory_path() / ("metrale_cli_err_" + std::to_string(::getpid()));
  const std::string command = binary + " " + args + " 2>" + err_path.string();
  CommandResult result;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer{};
  size_t n;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.out.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.err = read_file(err_path);
  std::filesystem::remove(err_path);
  return result;
}

std::string join_ids(const nlohmann::json& ids) {
  std::string text;
  for (const auto& id : ids) {
    if (!text.empty()) text.push_back(',');
    text.append(std::to_string(id.get<int>()));
  }
  return text;
}

}  // namespace metrale::testing
