// The OpenAI-compatible HTTP server: POST /v1/completions, POST /v1/chat/completions (JSON or SSE
// streams), the Responses API (/v1/responses: server/responses_endpoint.h), GET /v1/models,
// GET /health, GET /metrics, on the event-driven transport of server/http_transport.h.
//
// Threads (DESIGN.md "Threads"): the transport's I/O threads hold the connections and run every
// response; a small pool of workers parses, validates, renders the chat template, tokenizes and
// submits each generation request (the CPU-heavy part, kept off the I/O threads so that /health
// answers at once whatever arrives); the engine thread appends tokens to each request's stream,
// and the I/O thread of its connection drains the stream on its pump tick (about every
// millisecond), detokenizes and writes. Nothing the engine thread does waits for a client.
//
// A client that goes away has its requests cancelled (and their cache blocks freed) at its next
// write, or within two heartbeats (about half a second) while it waits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/async_engine.h"
#include "server/health.h"
#include "server/http_transport.h"
#include "server/metrics.h"
#include "server/openai_protocol.h"
#include "server/response_store.h"
#include "text/tokenizer.h"

namespace metrale::server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;                      // 0: any free port (bind() returns it)
  std::string api_key;                  // "": no authentication
  std::string served_model_name = "metrale";
  // The tool-call format parsed from chat outputs: a name of tool_call_format_names(), "none" (tool
  // calls stay plain content), or "" to pick it from the chat template and the model type.
  std::string tool_call_parser;
  int http_workers = 4;                 // threads that prepare generation requests
  int listen_backlog = 1024;
  TransportLimits transport;            // sizes, timeouts, the connection cap, I/O threads
  SamplingParams default_sampling;      // for fields a request does not set (the model's generation_config)
  ProtocolLimits limits;
  ResponseStoreLimits response_store;   // /v1/responses kept for previous_response_id
};

class HttpServer {
 public:
  // The chat template comes from the tokenizer; without one, chat requests get 400.
  HttpServer(AsyncEngine& engine, Tokenizer tokenizer, ServerConfig config);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds host:port with the configured backlog; returns the port. Throws kInvalidArgument for a
  // host that is not an address, kUnavailable when it cannot be bound.
  int bind();
  // Serves until stop() (from any thread). bind() first.
  void serve();
  // From any thread: new generation requests get 503 (and /health 503) while the ones in flight
  // go on; responses close their connections.
  void begin_drain();
  // Generation requests accepted and not yet answered to their end.
  int64_t active_generations() const;
  void stop();

  // What /health answers: 503 {"status":"draining"} during shutdown, else the engine's health.
  HealthReply health() const;
  bool has_chat_template() const;
  const ServerMetrics& metrics() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace metrale::server
