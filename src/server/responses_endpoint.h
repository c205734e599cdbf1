// POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items: the
// Responses API on the server's engine. A request is parsed (server/responses_api.h), its
// conversation (the stored previous response's, then its own input) rendered by the chat template
// and tokenized on a worker, submitted to the engine as one generation, and answered from the I/O
// thread's pump like a chat completion (http_server.h "Threads"): as one response object, or as the
// typed SSE events of server/response_events.h. The model's tool calls are parsed with the format
// the chat template writes (text/tool_calls/); `store` keeps the finished response in the
// ResponseStore.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "engine/async_engine.h"
#include "server/http_transport.h"
#include "server/metrics.h"
#include "server/openai_protocol.h"
#include "server/response_store.h"
#include "server/structured_output.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "text/tool_calls/tool_call_parser.h"

namespace metrale::server {

struct ResponseGeneration;

// What the endpoint borrows from the server that owns it (all outlive it).
struct ResponsesContext {
  AsyncEngine& engine;
  const Tokenizer& tokenizer;
  const ChatTemplate* chat_template = nullptr;  // null: the model has none (the endpoint answers 400)
  bool template_uses_think = false;
  std::optional<ToolCallFormat> tool_call_format;  // nullopt: tool calls stay text
  StructuredOutputs& structured;                   // text.format and forced tool calls
  std::string served_model_name;
  SamplingParams default_sampling;
  ProtocolLimits limits;
  ServerMetrics& metrics;
  ResponseStore& store;
  // Runs a task on the server's worker pool.
  std::function<void(std::function<void()>)> post_work;
  std::atomic<int64_t>& active;       // generations in flight (the drain waits for them)
  const std::atomic<bool>& draining;  // new requests get 503
};

class ResponsesEndpoint {
 public:
  explicit ResponsesEndpoint(ResponsesContext context);
  ~ResponsesEndpoint();
  ResponsesEndpoint(const ResponsesEndpoint&) = delete;
  ResponsesEndpoint& operator=(const ResponsesEndpoint&) = delete;

  // Whether `path` is one of this endpoint's routes (/v1/responses, /v1/responses/{id},
  // /v1/responses/{id}/input_items).
  static bool owns(std::string_view path);
  // On the exchange's I/O thread, for a path owns() accepted (authorization already checked).
  void handle(const std::shared_ptr<Exchange>& exchange);

 private:
  void start(const std::shared_ptr<Exchange>& exchange);
  // GET /v1/responses/{id}/input_items: a cursor page (after, limit, order) of the stored input items.
  void list_input_items(Exchange& exchange, const std::string& id) const;
  std::shared_ptr<ResponseGeneration> prepare(const std::string& body) const;
  void submit(ResponseGeneration& generation) const;
  bool step(ResponseGeneration& generation, Exchange& exchange);
  bool begin(ResponseGeneration& generation, Exchange& exchange, const StreamEvent& first);
  // Applies engine events; returns the stream events they produce.
  std::vector<nlohmann::ordered_json> apply(ResponseGeneration& generation, std::vector<StreamEvent> events);
  bool finish(ResponseGeneration& generation, Exchange& exchange);
  void record(const ResponseGeneration& generation);
  void abandon(ResponseGeneration& generation);

  ResponsesContext context_;
};

}  // namespace metrale::server
