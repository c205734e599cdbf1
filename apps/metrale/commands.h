// The subcommands of the `metrale` command. Each lives in its own cmd_<name>.cpp and registers
// itself on the root CLI11 app; its action runs after parsing and returns the exit code.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

namespace metrale::cli {

// Exit codes: 0 success, 1 runtime error (one-line message on stderr), 2 usage error.
inline constexpr int kExitOk = 0;
inline constexpr int kExitRuntimeError = 1;
inline constexpr int kExitUsage = 2;

using Action = std::function<int()>;

// Each register function adds its subcommand to `root` and sets `action` when it is chosen.
void register_generate(CLI::App& root, Action& action);
void register_score(CLI::App& root, Action& action);
void register_tokenize(CLI::App& root, Action& action);
void register_bench(CLI::App& root, Action& action);
void register_serve(CLI::App& root, Action& action);
void register_chat(CLI::App& root, Action& action);
void register_bench_serve(CLI::App& root, Action& action);

}  // namespace metrale::cli
