// metrale serve: the OpenAI-compatible HTTP server on one model. SIGINT/SIGTERM drain it: new
// requests get 503 while the running ones finish (up to --shutdown-timeout), then what is left is
// aborted, the connections close and the engine thread joins.
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/error.h"
#include "core/log.h"
#include "core/startup.h"
#include "core/strings.h"
#include "engine/async_engine.h"
#include "model/config.h"
#include "model/registry.h"
#include "options.h"
#include "runtime/device.h"
#include "runtime/thread_pool.h"
#include "server/http_server.h"
#include "text/tokenizer.h"
#include "text/tool_calls/tool_call_parser.h"

namespace metrale::cli {
namespace {

struct ServeOptions {
  EngineOptions engine;
  std::string config;      // with random_weights: a config.json preset instead of --model
  bool random_weights = false;
  std::string tokenizer;   // directory with tokenizer.json; default: the model's, else the bundled model's
  std::string host = "127.0.0.1";
  int port = 8000;
  std::optional<std::string> api_key;
  std::string api_key_file;
  std::string served_model_name;
  std::string tool_call_parser;
  int64_t max_queued_requests = 1024;
  int http_threads = 2;
  int http_workers = 4;
  int max_connections = 10000;
  std::string max_header_size = "32KiB";
  std::string max_body_size = "32MiB";
  double idle_timeout = 60;
  double read_timeout = 30;
  double shutdown_timeout = 30;
  std::string log_format = "text";
  int64_t response_store_size = 1000;
  std::string response_store_memory = "256MiB";
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
  apply_cpu_threads(options.engine);
  rank_devices(options.engine);  // --device and --tensor-parallel-size name devices that exist
  const std::string text = read_file(options.config);
  nlohmann::json preset;
  try {
    preset = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    raise(ErrorCode::kBadFormat, "{}: invalid JSON: {}", options.config, e.what());
  }
  return make_engine_for(random_engine_model(options.engine, parse_model_config(preset, options.config)),
                         options.engine);
}

// The API key from --api-key, --api-key-file or $METRALE_API_KEY. An empty key is an error, never
// "no authentication": `--api-key "$UNSET_VARIABLE"` must not open the server.
std::string resolve_api_key(const ServeOptions& options) {
  if (options.api_key && !options.api_key_file.empty())
    raise(ErrorCode::kInvalidArgument, "give either --api-key or --api-key-file, not both");
  std::string key;
  std::string origin;
  if (options.api_key) {
    key = *options.api_key;
    origin = "--api-key";
  } else if (!options.api_key_file.empty()) {
    std::ifstream in(options.api_key_file, std::ios::binary);
    if (!in) raise(ErrorCode::kInvalidArgument, "--api-key-file {}: cannot read it", options.api_key_file);
    std::getline(in, key);  // the first line; a trailing newline (echo KEY > file) is not part of the key
    if (!key.empty() && key.back() == '\r') key.pop_back();
    origin = "--api-key-file " + options.api_key_file;
  } else if (const char* env = std::getenv("METRALE_API_KEY"); env != nullptr) {
    key = env;
    origin = "$METRALE_API_KEY";
  } else {
    return {};
  }
  if (key.empty()) {
    raise(ErrorCode::kInvalidArgument,
          "{} gives an empty API key (an unset variable?); give a key, or none of --api-key, --api-key-file and "
          "$METRALE_API_KEY to serve without authentication",
          origin);
  }
  for (const char c : key) {
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f)
      raise(ErrorCode::kInvalidArgument, "{}: the API key holds a space or control character", origin);
  }
  return key;
}

// Each connection takes a descriptor: raise the soft limit to the hard one, and keep the cap below
// it (with room for the model's files, the engine and the listener).
int connection_cap(int wanted) {
  constexpr rlim_t kReserve = 256;
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return wanted;
  if (limit.rlim_cur < limit.rlim_max) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  if (limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur > static_cast<rlim_t>(wanted) + kReserve) return wanted;
  const int cap = static_cast<int>(std::max<rlim_t>(limit.rlim_cur, kReserve + 16) - kReserve);
  METRALE_LOG_WARN("--max-connections {} lowered to {}: the process may open {} files (ulimit -n)", wanted, cap,
                   static_cast<uint64_t>(limit.rlim_cur));
  return cap;
}

std::chrono::milliseconds seconds_flag(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// SIGINT/SIGTERM: drain (new requests get 503, the running ones finish) for up to
// --shutdown-timeout, then abort what is left and stop. A second signal aborts at once.
void drain_and_stop(server::HttpServer& http, AsyncEngine& engine, const sigset_t& stop_signals, double timeout) {
  http.begin_drain();
  const auto deadline = std::chrono::steady_clock::now() + seconds_flag(timeout);
  timespec poll{0, 50'000'000};
  while (http.active_generations() > 0 && std::chrono::steady_clock::now() < deadline) {
    if (sigtimedwait(&stop_signals, nullptr, &poll) > 0) {
      METRALE_LOG_INFO("second signal: aborting the {} requests still running", http.active_generations());
      break;
    }
  }
  engine.shutdown(/*drain=*/false);  // ends every open stream with an abort
  // The aborted streams end their responses within a pump tick or two.
  const auto flush_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (http.active_generations() > 0 && std::chrono::steady_clock::now() < flush_deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  http.stop();
}

int run_serve(const ServeOptions& options) {
  set_log_format(options.log_format == "json" ? LogFormat::kJson : LogFormat::kText);
  set_startup_reporting(true);
  // Stop signals are taken by one watcher thread (sigwait), so they must be blocked before any
  // other thread exists; every thread started later inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a client that leaves must not end the process

  server::ServerConfig config;
  config.api_key = resolve_api_key(options);
  config.host = options.host;
  config.port = options.port;
  config.http_workers = options.http_workers;
  config.transport.io_threads = options.http_threads;
  config.transport.max_header_bytes = parse_byte_size(options.max_header_size, "--max-header-size");
  config.transport.max_body_bytes = parse_byte_size(options.max_body_size, "--max-body-size");
  config.transport.idle_timeout = seconds_flag(options.idle_timeout);
  config.transport.read_timeout = seconds_flag(options.read_timeout);
  config.transport.max_connections = connection_cap(options.max_connections);
  config.response_store.max_responses = static_cast<size_t>(options.response_store_size);
  config.response_store.max_bytes = parse_byte_size(options.response_store_memory, "--response-store-memory");

  std::filesystem::path model_dir;
  if (options.config.empty()) model_dir = resolve_model_dir(options.engine);
  const std::filesystem::path tokenizer_dir = !options.tokenizer.empty() ? std::filesystem::path(options.tokenizer)
                                              : !model_dir.empty()       ? model_dir
                                                                         : default_model_dir();
  report_startup("tokenizer", fmt::format("loading the tokenizer from {}", tokenizer_dir.string()),
                 {{"path", tokenizer_dir.string()}});
  Tokenizer tokenizer = Tokenizer::from_dir(tokenizer_dir);
  if (!options.served_model_name.empty()) config.served_model_name = options.served_model_name;
  else if (!model_dir.empty()) config.served_model_name = default_model_name(model_dir);
  else config.served_model_name = std::filesystem::path(options.config).stem().string();
  config.default_sampling = load_generation_defaults(model_dir.empty() ? tokenizer_dir : model_dir);
  config.tool_call_parser = options.tool_call_parser;
  if (!config.tool_call_parser.empty() && config.tool_call_parser != "none" &&
      !tool_call_format_from_name(config.tool_call_parser)) {
    raise(ErrorCode::kInvalidArgument, "--tool-call-parser {}: unknown (known: {}, or none)", config.tool_call_parser,
          fmt::join(tool_call_format_names(), ", "));
  }

  AsyncEngineConfig async_config;
  async_config.max_queued_requests = options.max_queued_requests;
  AsyncEngine engine(build_engine(options), async_config);
  server::HttpServer http(engine, tokenizer, config);
  const int port = http.bind();

  std::atomic<bool> served = false;
  std::thread watcher([&] {
    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
    if (served) return;  // woken because serve() ended on its own
    METRALE_LOG_INFO("signal {}: draining ({} requests running; up to {} s)", signal_number, http.active_generations(),
                     options.shutdown_timeout);
    drain_and_stop(http, engine, stop_signals, options.shutdown_timeout);
  });
  // The address is the contract for people and scripts: one stdout line, and with --log-format json
  // a "ready" record too.
  const std::string url = fmt::format("http://{}:{}", config.host, port);
  std::printf("metrale: serving '%s' (context %lld tokens) on %s%s\n", config.served_model_name.c_str(),
              static_cast<long long>(engine.plan().max_model_len), url.c_str(),
              http.has_chat_template() ? "" : " (no chat template: /v1/chat/completions is off)");
  std::fflush(stdout);
  if (log_format() == LogFormat::kJson) {
    report_startup("ready", fmt::format("serving '{}' on {}", config.served_model_name, url),
                   {{"url", url},
                    {"model", config.served_model_name},
                    {"max_model_len", engine.plan().max_model_len},
                    {"chat_template", http.has_chat_template()}});
  }
  set_startup_reporting(false);
  http.serve();
  served = true;
  // serve() returns after stop(); wake the watcher if it still waits (it did not call stop()).
  pthread_kill(watcher.native_handle(), SIGTERM);
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
  command->add_option("--api-key-file", options->api_key_file, "read the API key from the first line of this file");
  command->add_option("--served-model-name", options->served_model_name,
                      "the model name clients use (default: the model directory's name)");
  command->add_option("--tool-call-parser", options->tool_call_parser,
                      "how tool calls are read from chat outputs: hermes, qwen3_coder, glm45, deepseek_v3, deepseek_v31, "
                      "deepseek_v32 (aliases too), or none (default: from the chat template, else the model type)");
  command->add_option("--max-queued-requests", options->max_queued_requests,
                      "requests that may wait for a running slot before new ones get 429")
      ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  command->add_option("--http-threads", options->http_threads, "I/O threads holding the connections")
      ->capture_default_str()->check(CLI::Range(1, 64));
  command->add_option("--http-workers", options->http_workers,
                      "threads that parse, template and tokenize generation requests")
      ->capture_default_str()->check(CLI::Range(1, 256));
  command->add_option("--max-connections", options->max_connections, "open connections; beyond: 503")
      ->capture_default_str()->check(CLI::Range(1, 1 << 20));
  command->add_option("--max-header-size", options->max_header_size, "request line and headers; beyond: 431")
      ->capture_default_str();
  command->add_option("--max-body-size", options->max_body_size, "request body, chunked or not; beyond: 413")
      ->capture_default_str();
  command->add_option("--http-idle-timeout", options->idle_timeout,
                      "seconds a keep-alive connection may wait for its next request")
      ->capture_default_str()->check(CLI::Range(0.1, 86400.0));
  command->add_option("--http-read-timeout", options->read_timeout,
                      "seconds for a request's head and body to arrive, from its first byte; beyond: 408")
      ->capture_default_str()->check(CLI::Range(0.1, 86400.0));
  command->add_option("--shutdown-timeout", options->shutdown_timeout,
                      "on SIGTERM, seconds the running requests may take to finish before they are aborted")
      ->capture_default_str()->check(CLI::Range(0.0, 86400.0));
  command->add_option("--log-format", options->log_format,
                      "stderr lines: text for people, json (one JSON object a line) for log collectors")
      ->capture_default_str()->check(CLI::IsMember({"text", "json"}));
  command->add_option("--response-store-size", options->response_store_size,
                      "/v1/responses kept in memory for previous_response_id, least recently used out first (0: none)")
      ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  command->add_option("--response-store-memory", options->response_store_memory,
                      "memory the kept /v1/responses may take, all together")
      ->capture_default_str();
  add_engine_options(*command, options->engine);
  command->callback([options, &action] { action = [options] { return run_serve(*options); }; });
}

}  // namespace metrale::cli
