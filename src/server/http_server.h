// The OpenAI-compatible HTTP server (cpp-httplib): POST /v1/completions, POST /v1/chat/completions
// (JSON or SSE streams), GET /v1/models, GET /health, GET /metrics.
//
// Request threads parse, tokenize and validate, submit to the AsyncEngine and stream the tokens
// back; each open response holds one worker of the pool, so the pool is sized for hundreds of
// streams. A client that goes away has its requests cancelled (and their cache blocks freed) at
// the next token or within ~100 ms when idle.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/async_engine.h"
#include "server/metrics.h"
#include "server/openai_protocol.h"
#include "text/tokenizer.h"

namespace metrale::server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;                      // 0: any free port (bind() returns it)
  std::string api_key;                  // "": no authentication
  std::string served_model_name = "metrale";
  int http_threads = 512;               // workers; each open response holds one
  int listen_backlog = 1024;
  size_t max_body_bytes = 32u << 20;    // larger bodies get 413
  int keep_alive_seconds = 10;
  SamplingParams default_sampling;      // for fields a request does not set (the model's generation_config)
  ProtocolLimits limits;
};

class HttpServer {
 public:
  // The chat template comes from the tokenizer; without one, chat requests get 400.
  HttpServer(AsyncEngine& engine, Tokenizer tokenizer, ServerConfig config);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds host:port with the configured backlog; returns the port. Throws kInvalidArgument when
  // the address cannot be bound.
  int bind();
  // Serves until stop() (from any thread). bind() first.
  void serve();
  void stop();

  bool has_chat_template() const;
  const ServerMetrics& metrics() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace metrale::server
