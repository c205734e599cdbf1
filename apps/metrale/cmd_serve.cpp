// metrale serve: the OpenAI-compatible HTTP server on one model. SIGINT/SIGTERM stop it: the
// listener closes, running requests are aborted (their streams end) and the engine thread joins.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "engine/async_engine.h"
#include "model/config.h"
#include "model/registry.h"
#include "options.h"
#include "runtime/device.h"
#include "runtime/thread_pool.h"
#include "server/http_server.h"
#include "text/tokenizer.h"

namespace metrale::cli {
namespace {

struct ServeOptions {
  EngineOptions engine;
  std::string config;      // with random_weights: a config.json preset instead of --model
  bool random_weights = false;
  std::string tokenizer;   // directory with tokenizer.json; default: the model's, else the bundled model's
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;
  std::string served_model_name;
  int64_t max_queued_requests = 1024;
  int http_threads = 512;
};

std::string default_model_name(const std::filesystem::path& dir) {
  std::filesystem::path clean = dir.lexically_normal();
  if (clean.filename().empty()) clean = clean.parent_path();
  const std::string name = clean.filename().string();
  return name.empty() ? "metrale" : name;
}

// The engine on --model, or on a random-weight model of a preset's shapes (benchmarks).
std::unique_ptr<Engine> build_engine(const ServeOptions& options) {
  if (options.config.empty()) {
    if (options.random_weights) raise(ErrorCode::kInvalidArgument, "--random-weights needs --config FILE");
    return make_engine(options.engine);
  }
  if (!options.random_weights) raise(ErrorCode::kInvalidArgument, "--config needs --random-weights (a preset has no weights)");
  if (!options.engine.model.empty()) raise(ErrorCode::kInvalidArgument, "give either --model or --config, not both");
  if (options.engine.threads > 0) set_cpu_threads(options.engine.threads);
  const Device device = options.engine.device.empty() ? default_device() : parse_device(options.engine.device);
  if (device.is_cuda() && !cuda_available()) raise(ErrorCode::kInvalidArgument, "no CUDA device is available");
  const ModelConfig config = parse_model_config(nlohmann::json::parse(read_file(options.config)), options.config);
  return std::make_unique<Engine>(make_random_model(config, device, 1), engine_config_from(options.engine));
}

int run_serve(const ServeOptions& options) {
  // Stop signals are taken by one watcher thread (sigwait), so they must be blocked before any
  // other thread exists; every thread started later inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a client that leaves must not end the process

  std::filesystem::path model_dir;
  if (options.config.empty()) model_dir = resolve_model_dir(options.engine);
  const std::filesystem::path tokenizer_dir = !options.tokenizer.empty() ? std::filesystem::path(options.tokenizer)
                                              : !model_dir.empty()       ? model_dir
                                                                         : default_model_dir();
  Tokenizer tokenizer = Tokenizer::from_dir(tokenizer_dir);
  server::ServerConfig config;
  config.host = options.host;
  config.port = options.port;
  config.api_key = options.api_key;
  if (config.api_key.empty()) {
    if (const char* key = std::getenv("METRALE_API_KEY"); key != nullptr) config.api_key = key;
  }
  if (!options.served_model_name.empty()) config.served_model_name = options.served_model_name;
  else if (!model_dir.empty()) config.served_model_name = default_model_name(model_dir);
  else config.served_model_name = std::filesystem::path(options.config).stem().string();
  config.http_threads = options.http_threads;
  config.default_sampling = load_generation_defaults(model_dir.empty() ? tokenizer_dir : model_dir);

  AsyncEngineConfig async_config;
  async_config.max_queued_requests = options.max_queued_requests;
  AsyncEngine engine(build_engine(options), async_config);
  server::HttpServer http(engine, tokenizer, config);
  const int port = http.bind();

  std::atomic<bool> stopping = false;
  std::mutex served_mutex;
  std::condition_variable served_cv;
  bool served = false;
  std::thread watcher([&] {
    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
    {
      std::lock_guard lock(served_mutex);
      if (served) return;  // woken because serve() ended on its own
    }
    stopping = true;
    METRALE_LOG_INFO("signal {}: stopping", signal_number);
    http.stop();
    engine.shutdown(/*drain=*/false);  // ends every open stream, so the workers can finish
    // httplib joins its workers before serve() returns, and a worker on an idle keep-alive
    // connection only notices after the keep-alive timeout. Nothing is left to finish by now
    // (every request has ended), so do not make the operator wait for idle sockets.
    std::unique_lock lock(served_mutex);
    if (!served_cv.wait_for(lock, std::chrono::seconds(1), [&] { return served; })) {
      std::fflush(stdout);
      std::_Exit(kExitOk);
    }
  });
  std::printf("metrale: serving '%s' (context %lld tokens) on http://%s:%d%s\n", config.served_model_name.c_str(),
              static_cast<long long>(engine.plan().max_model_len), config.host.c_str(), port,
              http.has_chat_template() ? "" : " (no chat template: /v1/chat/completions is off)");
  std::fflush(stdout);
  http.serve();
  {
    std::lock_guard lock(served_mutex);
    served = true;
  }
  served_cv.notify_all();
  // serve() also returns when the listener fails; wake the watcher so it can be joined.
  if (!stopping) pthread_kill(watcher.native_handle(), SIGTERM);
  watcher.join();
  engine.shutdown(/*drain=*/false);
  return kExitOk;
}

}  // namespace

void register_serve(CLI::App& root, Action& action) {
  auto options = std::make_shared<ServeOptions>();
  CLI::App* command = root.add_subcommand("serve", "Serve the model over an OpenAI-compatible HTTP API");
  add_model_option(*command, options->engine);
  command->add_option("--config", options->config, "serve a model of this config.json's shapes (with --random-weights)");
  command->add_flag("--random-weights", options->random_weights, "generate the weights (with --config; benchmarks)");
  command->add_option("--tokenizer", options->tokenizer,
                      "directory with tokenizer.json (default: the model's; with --config: the bundled model's)");
  command->add_option("--host", options->host, "address to listen on")->capture_default_str();
  command->add_option("--port", options->port, "port to listen on (0: any free port)")
      ->capture_default_str()->check(CLI::Range(0, 65535));
  command->add_option("--api-key", options->api_key,
                      "require 'Authorization: Bearer KEY' on /v1/* (default: $METRALE_API_KEY, else none)");
  command->add_option("--served-model-name", options->served_model_name,
                      "the model name clients use (default: the model directory's name)");
  command->add_option("--max-queued-requests", options->max_queued_requests,
                      "requests that may wait for a running slot before new ones get 429")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  command->add_option("--http-threads", options->http_threads, "HTTP workers (each open response holds one)")
      ->capture_default_str()->check(CLI::Range(1, 65536));
  add_engine_options(*command, options->engine);
  command->callback([options, &action] { action = [options] { return run_serve(*options); }; });
}

}  // namespace metrale::cli
