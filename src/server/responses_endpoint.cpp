#include "server/responses_endpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <random>

#include "core/error.h"
#include "core/log.h"
#include "server/choice_output.h"
#include "server/response_events.h"
#include "server/responses_api.h"

namespace metrale::server {

using json = nlohmann::ordered_json;

struct ResponseGeneration {
  ResponsesRequest request;
  json history = json::array();  // the conversation of the previous response
  std::vector<int32_t> prompt;
  ResponseIdentity identity;
  std::optional<ChoiceOutput> choice;
  std::optional<ResponseEventBuilder> builder;
  bool reasoning = false;
  bool starts_in_reasoning = false;
  // Constrained decoding (text.format, a forced tool call): the grammar the output follows (null: none).
  std::shared_ptr<const grammar::CompiledGrammar> grammar;

  std::shared_ptr<RequestStream> stream;
  bool admitted = false;
  bool closed = false;
  std::string engine_error;
  int64_t reasoning_tokens = 0;

  ResponseUsage usage() const {
    ResponseUsage usage;
    usage.input_tokens = static_cast<int64_t>(prompt.size());
    usage.output_tokens = choice ? choice->num_tokens() : 0;
    usage.reasoning_tokens = reasoning_tokens;
    return usage;
  }
};

namespace {

constexpr std::string_view kRoute = "/v1/responses";
const char* const kInternal = "internal error (the server log has the details)";

void send_error(Exchange& exchange, const ApiError& error) {
  exchange.respond(error.status(), "application/json", dump_json(error_body(error)));
}

// One SSE event of the Responses API: named by its type, as the official client expects.
std::string typed_event(const json& event) {
  return fmt::format("event: {}\ndata: {}\n\n", event["type"].get<std::string>(), dump_json(event));
}

// Constrained decoding. The Responses request carries its constraint parsed and validated
// (request.text_format: a json_object or json_schema format with its schema; request.tool_choice:
// "required" or a named function, which constrain the output to a call of the request's tools);
// applying it to the engine request is the grammar engine's part (text/grammar/). Until the
// endpoint hands it over in submit(), a request that needs it is refused here rather than answered
// unconstrained.
// The chat endpoints' constraint of this request: text.format as response_format, tool_choice
// with the request's function tools (required or named: a valid call of them).
OutputConstraintSpec constraint_spec(const ResponsesRequest& request) {
  OutputConstraintSpec spec;
  switch (request.text_format.kind) {
    case ResponseTextFormat::Kind::kText: spec.response_format.type = ResponseFormatType::kText; break;
    case ResponseTextFormat::Kind::kJsonObject: spec.response_format.type = ResponseFormatType::kJsonObject; break;
    case ResponseTextFormat::Kind::kJsonSchema: spec.response_format.type = ResponseFormatType::kJsonSchema; break;
  }
  spec.response_format.name = request.text_format.name;
  spec.response_format.schema = request.text_format.schema;
  spec.response_format.strict = request.text_format.strict;
  switch (request.tool_choice.mode) {
    case ResponseToolChoice::Mode::kAuto: spec.tool_choice.mode = ToolChoiceMode::kAuto; break;
    case ResponseToolChoice::Mode::kNone: spec.tool_choice.mode = ToolChoiceMode::kNone; break;
    case ResponseToolChoice::Mode::kRequired: spec.tool_choice.mode = ToolChoiceMode::kRequired; break;
    case ResponseToolChoice::Mode::kFunction: spec.tool_choice.mode = ToolChoiceMode::kFunction; break;
  }
  spec.tool_choice.function = request.tool_choice.function;
  if (!request.tools.empty()) spec.tools = tool_definitions_from_openai(chat_tools(request.tools));
  spec.parallel_tool_calls = request.parallel_tool_calls;
  return spec;
}

uint64_t random_seed() {
  thread_local std::mt19937_64 generator{std::random_device{}()};
  return generator();
}

}  // namespace

ResponsesEndpoint::ResponsesEndpoint(ResponsesContext context) : context_(std::move(context)) {}
ResponsesEndpoint::~ResponsesEndpoint() = default;

bool ResponsesEndpoint::owns(std::string_view path) {
  return path == kRoute || (path.size() > kRoute.size() + 1 && path.substr(0, kRoute.size() + 1) == "/v1/responses/");
}

void ResponsesEndpoint::handle(const std::shared_ptr<Exchange>& exchange) {
  const HttpRequest& request = exchange->request();
  const auto wrong_method = [&](const char* allowed) {
    exchange->respond(405, "application/json",
                      dump_json(error_body(ApiError(
                          405, "invalid_request_error",
                          fmt::format("{} {}: method not allowed (use {})", request.method, request.path, allowed)))),
                      {{"Allow", allowed}});
  };
  if (request.path == kRoute) {
    if (request.method != "POST") return wrong_method("POST");
    return start(exchange);
  }
  std::string id = request.path.substr(kRoute.size() + 1);
  constexpr std::string_view kInputItems = "/input_items";
  if (id.size() > kInputItems.size() && id.ends_with(kInputItems)) {
    if (request.method != "GET" && request.method != "HEAD") return wrong_method("GET");
    id.resize(id.size() - kInputItems.size());
    if (id.find('/') == std::string::npos) return list_input_items(*exchange, id);
  }
  if (id.find('/') != std::string::npos) {
    return send_error(
        *exchange, ApiError(404, "not_found_error", fmt::format("{} {}: no such route", request.method, request.path)));
  }
  const auto not_found = [&] {
    send_error(*exchange, ApiError(404, "invalid_request_error",
                                   fmt::format("no response with id '{}' is stored (responses are kept in memory, the "
                                               "last {} at most, and only with store: true)",
                                               id, context_.store.limits().max_responses),
                                   "response_id", "response_not_found"));
  };
  if (request.method == "GET" || request.method == "HEAD") {
    const auto stored = context_.store.get(id);
    if (!stored) return not_found();
    exchange->respond(200, "application/json", dump_json(stored->response));
  } else if (request.method == "DELETE") {
    if (!context_.store.erase(id)) return not_found();
    exchange->respond(200, "application/json", dump_json(json{{"id", id}, {"object", "response"}, {"deleted", true}}));
  } else {
    wrong_method("GET, DELETE");
  }
}

namespace {

// The value of `key` in the target's query ("" when absent); values are ids and numbers, taken as sent.
std::string query_value(std::string_view target, std::string_view key) {
  const size_t question = target.find('?');
  if (question == std::string_view::npos) return {};
  std::string_view query = target.substr(question + 1);
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    const size_t equals = pair.find('=');
    if (pair.substr(0, equals) == key)
      return std::string(equals == std::string_view::npos ? "" : pair.substr(equals + 1));
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  return {};
}

}  // namespace

void ResponsesEndpoint::list_input_items(Exchange& exchange, const std::string& id) const {
  const std::string_view target = exchange.request().target;
  const std::string order = query_value(target, "order");
  const std::string after = query_value(target, "after");
  const std::string limit_text = query_value(target, "limit");
  int64_t limit = 20;
  if (!limit_text.empty()) {
    char* end = nullptr;
    limit = std::strtoll(limit_text.c_str(), &end, 10);
    if (*end != '\0' || limit < 1 || limit > 100)
      return send_error(exchange, invalid_request("'limit' must be an integer from 1 to 100", "limit"));
  }
  if (!order.empty() && order != "asc" && order != "desc")
    return send_error(exchange, invalid_request("'order' must be asc or desc", "order"));
  const auto stored = context_.store.get(id);
  if (!stored) {
    return send_error(exchange,
                      ApiError(404, "invalid_request_error", fmt::format("no response with id '{}' is stored", id),
                               "response_id", "response_not_found"));
  }
  std::vector<const json*> items;
  for (const json& item : stored->input_items) items.push_back(&item);
  if (order != "asc") std::reverse(items.begin(), items.end());  // the API's default: newest first
  size_t begin = 0;
  if (!after.empty()) {
    while (begin < items.size() && (*items[begin])["id"] != after) ++begin;
    if (begin == items.size())
      return send_error(exchange, invalid_request(fmt::format("'after': no input item '{}'", after), "after"));
    ++begin;
  }
  const size_t end = std::min(items.size(), begin + static_cast<size_t>(limit));
  json data = json::array();
  for (size_t i = begin; i < end; ++i) data.push_back(*items[i]);
  json page = {{"object", "list"},
               {"data", data},
               {"first_id", data.empty() ? json(nullptr) : data.front()["id"]},
               {"last_id", data.empty() ? json(nullptr) : data.back()["id"]},
               {"has_more", end < items.size()}};
  exchange.respond(200, "application/json", dump_json(page));
}

void ResponsesEndpoint::start(const std::shared_ptr<Exchange>& exchange) {
  if (context_.draining)
    return send_error(*exchange, ApiError(503, "service_unavailable", "the server is shutting down"));
  ++context_.active;
  context_.post_work([this, exchange] {
    std::shared_ptr<ResponseGeneration> generation;
    std::optional<ApiError> failure;
    try {
      generation = prepare(exchange->request().body);
      submit(*generation);
    } catch (const ApiError& error) {
      failure = error;
    } catch (const Error& error) {
      if (error.code() == ErrorCode::kInvalidArgument) {
        failure = invalid_request(error.what());
      } else {
        METRALE_LOG_ERROR("preparing a response failed: {}", error.what());
        failure = ApiError(500, "server_error", kInternal);
      }
    } catch (const std::exception& error) {
      METRALE_LOG_ERROR("preparing a response failed: {}", error.what());
      failure = ApiError(500, "server_error", kInternal);
    }
    exchange->post([this, exchange, generation, failure] {
      if (failure) {
        send_error(*exchange, *failure);
        --context_.active;
        return;
      }
      exchange->pump([this, exchange, generation] {
        const bool again = step(*generation, *exchange);
        if (!again) --context_.active;
        return again;
      });
    });
  });
}

std::shared_ptr<ResponseGeneration> ResponsesEndpoint::prepare(const std::string& body) const {
  const json request_json = parse_json_body(body, context_.limits);
  auto generation = std::make_shared<ResponseGeneration>();
  generation->request = parse_responses_request(request_json, context_.default_sampling, context_.limits);
  ResponsesRequest& request = generation->request;
  if (!request.params.model.empty() && request.params.model != context_.served_model_name) {
    throw ApiError(404, "invalid_request_error",
                   fmt::format("the model '{}' does not exist; this server serves '{}'", request.params.model,
                               context_.served_model_name),
                   "model", "model_not_found");
  }
  if (context_.chat_template == nullptr)
    throw invalid_request("this model has no chat template, which /v1/responses needs; use /v1/completions", "input");
  generation->grammar = context_.structured.grammar_for(constraint_spec(request));
  if (request.previous_response_id) {
    const auto previous = context_.store.get(*request.previous_response_id);
    if (!previous) {
      throw ApiError(400, "invalid_request_error",
                     fmt::format("previous_response_id '{}': no such response is stored (responses are kept in "
                                 "memory, the last {} at most, and only with store: true)",
                                 *request.previous_response_id, context_.store.limits().max_responses),
                     "previous_response_id", "previous_response_not_found");
    }
    generation->history = previous->conversation;
  }

  ChatRequest chat = to_chat_request(request, generation->history);
  ChatTemplateInputs inputs;
  inputs.messages = std::move(chat.messages);
  inputs.tools = std::move(chat.tools);
  inputs.add_generation_prompt = true;
  inputs.extra = std::move(chat.chat_template_kwargs);
  std::string prompt;
  try {
    prompt = context_.chat_template->render(inputs);
  } catch (const Error& e) {
    throw invalid_request(fmt::format("the chat template failed on this conversation: {}", e.what()), "input");
  }
  generation->prompt = context_.tokenizer.encode(prompt, /*add_special_tokens=*/false);
  generation->reasoning = context_.template_uses_think;
  const size_t open = prompt.rfind("<think>");
  const size_t close = prompt.rfind("</think>");
  generation->starts_in_reasoning = open != std::string::npos && (close == std::string::npos || close < open);

  const int64_t context = context_.engine.plan().max_model_len;
  const auto length = static_cast<int64_t>(generation->prompt.size());
  if (length == 0) throw invalid_request("the input is empty", "input");
  if (length >= context) {
    throw ApiError(400, "invalid_request_error",
                   fmt::format("the conversation has {} tokens but the model's context is {} tokens, which leaves no "
                               "room to generate",
                               length, context),
                   "input", "context_length_exceeded");
  }
  if (request.params.max_tokens && *request.params.max_tokens > context - length) {
    throw ApiError(400, "invalid_request_error",
                   fmt::format("max_output_tokens is too large: the conversation has {} tokens and the model's context "
                               "is {}, so at most {} tokens can be generated, but {} were asked for",
                               length, context, context - length, *request.params.max_tokens),
                   "max_output_tokens", "context_length_exceeded");
  }

  generation->identity.id = make_response_id("resp_");
  generation->identity.created_at = static_cast<int64_t>(std::time(nullptr));
  generation->identity.model = context_.served_model_name;
  std::optional<ToolCallFormat> format;
  std::vector<ToolDefinition> tools;
  if (!request.tools.empty() && request.tool_choice.mode != ResponseToolChoice::Mode::kNone) {
    format = context_.tool_call_format;
    tools = tool_definitions_from_openai(chat_tools(request.tools));
  }
  ToolCallParserOptions parser;
  parser.id_seed = random_seed();
  parser.max_calls = request.parallel_tool_calls ? 0 : 1;  // parallel_tool_calls: false keeps the first call
  generation->builder.emplace(response_object(generation->identity, request), format, std::move(tools), parser);

  ChoiceOptions options;
  options.stop = request.params.stop;
  options.reasoning = generation->reasoning;
  options.starts_in_reasoning = generation->starts_in_reasoning;
  generation->choice.emplace(context_.tokenizer, std::move(options));
  return generation;
}

void ResponsesEndpoint::submit(ResponseGeneration& generation) const {
  AsyncEngine& engine = context_.engine;
  const int64_t room = engine.plan().max_model_len - static_cast<int64_t>(generation.prompt.size());
  Request request;
  request.prompt = generation.prompt;
  request.sampling = generation.request.params.sampling;
  request.max_tokens =
      static_cast<int32_t>(std::min<int64_t>(generation.request.params.max_tokens.value_or(room), room));
  if (generation.grammar) {
    GrammarConstraintOptions options;
    options.reasoning = generation.reasoning;
    options.starts_in_reasoning = generation.starts_in_reasoning;
    options.max_tokens = request.max_tokens;
    request.constraint = context_.structured.constraint(generation.grammar, options);
  }
  std::vector<Request> requests;
  requests.push_back(std::move(request));
  SubmitResult submitted = engine.submit(std::move(requests));
  if (submitted.status == SubmitStatus::kQueueFull) {
    throw ApiError(
        429, "rate_limit_error",
        fmt::format("the server is busy: {} requests are already waiting; retry later", engine.max_queued_requests()),
        "", "queue_full");
  }
  if (submitted.status == SubmitStatus::kShuttingDown)
    throw ApiError(503, "service_unavailable", "the server is shutting down");
  generation.stream = std::move(submitted.stream);
}

bool ResponsesEndpoint::step(ResponseGeneration& generation, Exchange& exchange) {
  if (generation.closed) return false;
  if (exchange.client_gone()) {
    abandon(generation);
    return false;
  }
  std::vector<StreamEvent> events = generation.stream->take();
  if (!generation.admitted) {
    if (events.empty()) return true;
    if (!begin(generation, exchange, events.front())) return false;
    events.erase(events.begin());
  }
  const bool had_events = !events.empty();
  const bool streaming = generation.request.params.stream;
  for (const json& event : apply(generation, std::move(events))) {
    if (streaming && !exchange.write(typed_event(event))) {
      abandon(generation);
      return false;
    }
  }
  if (generation.choice->finished() || generation.stream->ended()) return finish(generation, exchange);
  if (had_events || SteadyClock::now() - exchange.last_write() < kHeartbeatInterval) return true;
  if (exchange.write(streaming ? ": keep-alive\n\n" : " ")) return true;
  abandon(generation);
  return false;
}

bool ResponsesEndpoint::begin(ResponseGeneration& generation, Exchange& exchange, const StreamEvent& first) {
  if (first.kind == StreamEvent::Kind::kError) {
    generation.closed = true;
    switch (first.error_kind) {
      case StreamErrorKind::kInvalidRequest:
        send_error(exchange, invalid_request(first.error_message));
        break;
      case StreamErrorKind::kShuttingDown:
        send_error(exchange, ApiError(503, "service_unavailable", first.error_message));
        break;
      case StreamErrorKind::kInternal:
        METRALE_LOG_ERROR("response rejected by an engine failure: {}", first.error_message);
        send_error(exchange, ApiError(500, "server_error", kInternal));
        break;
      case StreamErrorKind::kUnavailable:
        METRALE_LOG_ERROR("response refused: {}", first.error_message);
        send_error(exchange, ApiError(503, "service_unavailable",
                                      "the engine can no longer serve requests (GET /health says why)"));
        break;
    }
    return false;
  }
  METRALE_CHECK(first.kind == StreamEvent::Kind::kAdmitted, "a stream must start with its admission");
  generation.admitted = true;
  context_.metrics.record_prompt_tokens(static_cast<int64_t>(generation.prompt.size()));
  if (!generation.request.params.stream) {
    // Chunked, so that heartbeats notice a client that leaves while it waits.
    exchange.begin_stream(200, "application/json");
    return true;
  }
  exchange.begin_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}});
  for (const json& event : generation.builder->start()) {
    if (!exchange.write(typed_event(event))) {
      abandon(generation);
      return false;
    }
  }
  return true;
}

std::vector<json> ResponsesEndpoint::apply(ResponseGeneration& generation, std::vector<StreamEvent> events) {
  std::vector<json> out;
  ChoiceOutput& choice = *generation.choice;
  const auto take = [&](const ChoiceText& delta) {
    for (json& event : generation.builder->feed(delta.reasoning, delta.text)) out.push_back(std::move(event));
  };
  for (StreamEvent& event : events) {
    const bool was_finished = choice.finished();
    if (event.kind == StreamEvent::Kind::kError) {
      METRALE_LOG_ERROR("response {} failed in the engine: {}", generation.identity.id, event.error_message);
      generation.engine_error = event.error_message;
      take(choice.on_error());
    } else if (event.index != 0) {
      continue;
    } else if (event.kind == StreamEvent::Kind::kToken) {
      const ChoiceText delta = choice.on_token(event.sampled, event.finish_reason, event.time);
      if (!delta.reasoning.empty() && delta.text.empty()) ++generation.reasoning_tokens;
      take(delta);
      // A stop string ended the output while its engine request still runs.
      if (!was_finished && choice.stopped_by_string() && event.finish_reason == FinishReason::kNone)
        context_.engine.cancel(generation.stream->id(), event.index);
    } else if (event.kind == StreamEvent::Kind::kFinished) {
      take(choice.on_end(event.finish_reason));
    }
    if (!was_finished && choice.finished()) record(generation);
  }
  return out;
}

bool ResponsesEndpoint::finish(ResponseGeneration& generation, Exchange& exchange) {
  ChoiceOutput& choice = *generation.choice;
  std::vector<json> events;
  if (!choice.finished()) {
    // The stream ended without a verdict on the choice (the engine shut down).
    const ChoiceText rest = choice.on_end(FinishReason::kAbort);
    events = generation.builder->feed(rest.reasoning, rest.text);
    record(generation);
  }
  const std::string reason = generation.engine_error.empty() ? choice.finish_reason() : "error";
  for (json& event : generation.builder->finish(reason, generation.usage())) events.push_back(std::move(event));
  generation.closed = true;
  bool delivered = true;
  if (generation.request.params.stream) {
    for (const json& event : events) delivered = delivered && exchange.write(typed_event(event));
  } else {
    delivered = exchange.write(dump_json(generation.builder->response()));
  }
  if (generation.request.store) {
    StoredResponse stored;
    stored.response = generation.builder->response();
    stored.conversation = std::move(generation.history);
    // Input items keep the ids the client gave them; the others get one, as the API numbers them.
    const std::string stem = generation.identity.id.substr(generation.identity.id.find('_') + 1);
    for (size_t i = 0; i < generation.request.input_items.size(); ++i) {
      json item = generation.request.input_items[i];
      if (!item.contains("id")) {
        const std::string type = item["type"];
        const char* prefix = type == "message"         ? "msg"
                             : type == "reasoning"     ? "rs"
                             : type == "function_call" ? "fc"
                                                       : "fco";
        item["id"] = fmt::format("{}_{}in{:04x}", prefix, stem, i);
      }
      stored.input_items.push_back(std::move(item));
      stored.conversation.push_back(generation.request.input_items[i]);
    }
    for (const json& item : generation.builder->output()) stored.conversation.push_back(item);
    context_.store.put(std::move(stored));
  }
  if (delivered) exchange.end_stream();
  return false;
}

void ResponsesEndpoint::record(const ResponseGeneration& generation) {
  const ChoiceOutput& choice = *generation.choice;
  ChoiceRecord record;
  record.finish_reason = choice.finish_reason();
  record.generation_tokens = choice.num_tokens();
  const SteadyClock::time_point submitted = generation.stream->submitted();
  record.e2e_seconds = std::chrono::duration<double>(SteadyClock::now() - submitted).count();
  if (choice.first_token_time())
    record.ttft_seconds = std::chrono::duration<double>(*choice.first_token_time() - submitted).count();
  if (choice.num_tokens() > 1) {
    record.tpot_seconds =
        std::chrono::duration<double>(*choice.last_token_time() - *choice.first_token_time()).count() /
        static_cast<double>(choice.num_tokens() - 1);
  }
  context_.metrics.record_choice(record);
}

void ResponsesEndpoint::abandon(ResponseGeneration& generation) {
  if (generation.closed) return;
  generation.closed = true;
  context_.engine.cancel(generation.stream->id());
  if (!generation.choice->finished()) {
    generation.choice->on_end(FinishReason::kAbort);
    record(generation);
  }
}

}  // namespace metrale::server
