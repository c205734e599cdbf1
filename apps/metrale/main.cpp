// metrale: the command-line entry point. Parses the subcommand, runs it, and turns exceptions into
// a one-line message on stderr with the documented exit code.
#include <cstdio>
#include <exception>
#include <new>

#include "commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  using namespace metrale;
  CLI::App app{"metrale: an inference engine for hybrid large language models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "metrale 0.1.0");
  cli::Action action;
  cli::register_generate(app, action);
  cli::register_score(app, action);
  cli::register_tokenize(app, action);
  cli::register_bench(app, action);
  cli::register_serve(app, action);
  cli::register_chat(app, action);
  cli::register_bench_serve(app, action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? cli::kExitOk : cli::kExitUsage;
  }
  try {
    return action ? action() : cli::kExitUsage;
  } catch (const Error& e) {
    std::fprintf(stderr, "metrale: error: %s\n", e.what());
    return e.code() == ErrorCode::kInvalidArgument ? cli::kExitUsage : cli::kExitRuntimeError;
  } catch (const std::bad_alloc&) {
    // Sized allocations (buffers, caches) report their size as a metrale::Error; this is any other.
    std::fprintf(stderr, "metrale: error: out of memory (an allocation failed)\n");
    return cli::kExitRuntimeError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "metrale: error: %s\n", e.what());
    return cli::kExitRuntimeError;
  }
}
