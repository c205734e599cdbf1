#include "server/http_server.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "server/choice_output.h"
#include "server/health.h"
#include "server/responses_endpoint.h"
#include "server/structured_output.h"
#include "text/chat_template.h"

namespace metrale::server {

using json = nlohmann::ordered_json;

namespace {



double seconds_between(SteadyClock::time_point from, SteadyClock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

const char* const kEngineFailure = "the engine failed while running this request (the server log has the details)";

// A fixed pool of threads for the request preparation (parse, template, tokenize, submit).
class WorkerPool {
 public:
  explicit WorkerPool(int threads) {
    for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { run(); });
  }
  ~WorkerPool() { stop(); }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void post(std::function<void()> task) {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      tasks_.push_back(std::move(task));
    }
    ready_.notify_one();
  }
  // Runs what is queued, then joins.
  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_all();
    for (auto& thread : threads_) {
      if (thread.joinable()) thread.join();
    }
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        ready_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// One generation request: its prompts, the engine stream of its n x prompts requests, and the text
// state of every choice. Built on a worker; from admission on, used by its I/O thread only.
struct Generation {
  bool chat = false;
  GenerationParams params;
  ResponseMeta meta;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> echo_texts;  // per prompt, when echo
  bool echo_logprobs = false;           // echo with logprobs: the prompt tokens' logprobs too
  bool reasoning = false;
  bool starts_in_reasoning = false;
  // Chat with tools: the tools whose calls the answer is parsed for (empty: no parsing), and whether
  // more than one call is kept (parallel_tool_calls).
  std::vector<ToolDefinition> parsed_tools;
  bool parallel_tool_calls = true;
  // Constrained decoding: the grammar every choice follows (null: none).
  std::shared_ptr<const grammar::CompiledGrammar> grammar;

  std::shared_ptr<RequestStream> stream;
  std::vector<ChoiceOutput> choices;  // [prompt * n + j]
  bool admitted = false;              // the engine accepted the group; the response has begun
  bool closed = false;                // the response is complete, or abandoned
  std::string engine_error;           // the engine failed mid-way (logged; not shown to the client)

  size_t prompt_of(size_t choice) const { return choice / static_cast<size_t>(params.n); }
  bool all_finished() const {
    for (const ChoiceOutput& choice : choices) {
      if (!choice.finished()) return false;
    }
    return true;
  }
  Usage usage() const {
    Usage usage;
    for (const auto& prompt : prompts) usage.prompt_tokens += static_cast<int64_t>(prompt.size());
    for (const ChoiceOutput& choice : choices) usage.completion_tokens += choice.num_tokens();
    return usage;
  }
};

std::string_view route_of(std::string_view path) {
  static constexpr std::string_view kRoutes[] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                                 "/metrics", "/tokenize", "/detokenize"};
  for (const std::string_view route : kRoutes) {
    if (path == route) return route;
  }
  if (ResponsesEndpoint::owns(path)) return "/v1/responses";
  if (path.rfind("/v1/models/", 0) == 0) return "/v1/models/{id}";
  return "other";
}

}  // namespace

struct HttpServer::Impl {
  AsyncEngine& engine;
  Tokenizer tokenizer;
  ServerConfig config;
  std::optional<ChatTemplate> chat_template;
  bool template_uses_think = false;
  ServerMetrics metrics;
  std::unique_ptr<StructuredOutputs> structured;
  std::atomic<bool> draining{false};
  std::atomic<int64_t> active{0};
  const int64_t created = static_cast<int64_t>(std::time(nullptr));
  WorkerPool workers;
  ResponseStore response_store;
  std::unique_ptr<ResponsesEndpoint> responses;
  HttpTransport transport;

  Impl(AsyncEngine& engine_ref, Tokenizer tokenizer_handle, ServerConfig server_config)
      : engine(engine_ref),
        tokenizer(std::move(tokenizer_handle)),
        config(std::move(server_config)),
        workers(config.http_workers),
        response_store(config.response_store),
        transport(
            config.transport, [this](const std::shared_ptr<Exchange>& exchange) { handle(exchange); },
            [this](std::string_view path, int status) { metrics.record_http(route_of(path), status); }) {
    if (!tokenizer.chat_template().empty()) {
      try {
        chat_template.emplace(ChatTemplate::from_tokenizer(tokenizer));
        template_uses_think = tokenizer.chat_template().find("<think>") != std::string::npos;
      } catch (const Error& e) {
        METRALE_LOG_WARN("the model's chat template cannot be used, /v1/chat/completions is off: {}", e.what());
      }
    }
    structured = std::make_unique<StructuredOutputs>(tokenizer, engine.model_config().vocab_size, stop_token_ids(),
                                                     pick_tool_format());
    responses = std::make_unique<ResponsesEndpoint>(ResponsesContext{
        engine, tokenizer, chat_template ? &*chat_template : nullptr, template_uses_think, structured->tool_format(),
        *structured, config.served_model_name, config.default_sampling, config.limits, metrics, response_store,
        [this](std::function<void()> task) { workers.post(std::move(task)); }, active, draining});
  }

  // The model's EOS ids: a complete constrained output ends with one.
  std::vector<int32_t> stop_token_ids() const {
    std::vector<int32_t> ids;
    for (const int64_t id : engine.model_config().eos_token_ids) ids.push_back(static_cast<int32_t>(id));
    return ids;
  }

  std::optional<ToolCallFormat> pick_tool_format() const {
    if (config.tool_call_parser == "none") return std::nullopt;
    if (!config.tool_call_parser.empty()) {
      auto format = tool_call_format_from_name(config.tool_call_parser);
      if (!format) {
        raise(ErrorCode::kInvalidArgument, "--tool-call-parser {}: unknown (known: {}, or none)", config.tool_call_parser,
              fmt::join(tool_call_format_names(), ", "));
      }
      return format;
    }
    auto format = select_tool_call_format(engine.model_config().model_type, tokenizer.chat_template());
    if (format) METRALE_LOG_INFO("tool calls are parsed as {}", tool_call_format_name(*format));
    return format;
  }

  // What /health answers: 503 while draining, else the engine's own health (server/health.h).
  HealthReply health_reply() const {
    if (draining) return {503, R"({"status":"draining"})"};
    return server::health_reply(engine.health());
  }

  void handle(const std::shared_ptr<Exchange>& exchange);
  bool authorized(const HttpRequest& request) const;
  static void send_error(Exchange& exchange, const ApiError& error, const HttpHeaders& extra = {}) {
    exchange.respond(error.status(), "application/json", dump_json(error_body(error)), extra);
  }

  void start_generation(const std::shared_ptr<Exchange>& exchange, bool chat);
  // POST /tokenize and /detokenize (vLLM's shapes), on a worker.
  void start_tokenize(const std::shared_ptr<Exchange>& exchange, bool detokenize);
  std::string tokenize_body(const std::string& body, bool detokenize) const;
  // The prompt text of chat messages, as /v1/chat/completions renders it.
  std::string render_chat(ChatRequest& request) const;
  std::shared_ptr<Generation> prepare(const std::string& body, bool chat) const;
  void submit(Generation& generation);

  // The pump step of one generation; false when the response is over.
  bool step(Generation& generation, Exchange& exchange);
  bool begin_response(Generation& generation, Exchange& exchange, const StreamEvent& first);
  bool stream_events(Generation& generation, Exchange& exchange, std::vector<StreamEvent> events);
  bool whole_events(Generation& generation, Exchange& exchange, std::vector<StreamEvent> events);
  // Nothing to send: writes a heartbeat when one is due; false (after abandoning) when the client is gone.
  bool heartbeat(Generation& generation, Exchange& exchange, std::string_view beat);

  // Applies engine events to the choices; returns the deltas the client should see, in order.
  std::vector<ChoiceText> apply(Generation& generation, std::vector<StreamEvent> events);
  void record_choice(const Generation& generation, size_t index);
  // The client is gone (or the response failed): cancel what still runs and count it aborted.
  void abandon(Generation& generation);
};

bool HttpServer::Impl::authorized(const HttpRequest& request) const {
  if (config.api_key.empty()) return true;
  const std::string_view header = request.header("Authorization");
  constexpr std::string_view kScheme = "Bearer ";
  if (header.size() < kScheme.size()) return false;
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(header[i])) != std::tolower(static_cast<unsigned char>(kScheme[i])))
      return false;
  }
  return constant_time_equals(header.substr(kScheme.size()), config.api_key);
}

void HttpServer::Impl::handle(const std::shared_ptr<Exchange>& exchange) {
  const HttpRequest& request = exchange->request();
  const std::string& path = request.path;
  if (draining) exchange->close_after_response();
  const bool protected_path = path.rfind("/v1/", 0) == 0 || path == "/tokenize" || path == "/detokenize";
  if (protected_path && !authorized(request)) {
    send_error(*exchange,
               ApiError(401, "authentication_error", "invalid or missing API key (send Authorization: Bearer <key>)",
                        "", "invalid_api_key"),
               {{"WWW-Authenticate", R"(Bearer realm="metrale")"}});
    return;
  }
  const bool get = request.method == "GET" || request.method == "HEAD";
  const auto wrong_method = [&](const char* allowed) {
    send_error(*exchange, ApiError(405, "invalid_request_error",
                                   fmt::format("{} {}: method not allowed (use {})", request.method, path, allowed)),
               {{"Allow", allowed}});
  };
  if (path == "/health") {
    if (!get) return wrong_method("GET");
    const HealthReply reply = health_reply();
    exchange->respond(reply.status, "application/json", reply.body);
  } else if (path == "/metrics") {
    if (!get) return wrong_method("GET");
    exchange->respond(200, "text/plain; version=0.0.4; charset=utf-8", metrics.render(engine.stats()));
  } else if (path == "/v1/models") {
    if (!get) return wrong_method("GET");
    exchange->respond(200, "application/json",
                      dump_json(models_response(config.served_model_name, created, engine.plan().max_model_len)));
  } else if (path.rfind("/v1/models/", 0) == 0) {
    if (!get) return wrong_method("GET");
    const std::string id = path.substr(std::string_view("/v1/models/").size());
    if (id != config.served_model_name) {
      send_error(*exchange, ApiError(404, "invalid_request_error",
                                     fmt::format("the model '{}' does not exist; this server serves '{}'", id,
                                                 config.served_model_name),
                                     "model", "model_not_found"));
      return;
    }
    const json list = models_response(config.served_model_name, created, engine.plan().max_model_len);
    exchange->respond(200, "application/json", dump_json(list["data"][0]));
  } else if (path == "/tokenize" || path == "/detokenize") {
    if (request.method != "POST") return wrong_method("POST");
    start_tokenize(exchange, path == "/detokenize");
  } else if (path == "/v1/completions" || path == "/v1/chat/completions") {
    if (request.method != "POST") return wrong_method("POST");
    start_generation(exchange, path == "/v1/chat/completions");
  } else if (ResponsesEndpoint::owns(path)) {
    responses->handle(exchange);
  } else {
    send_error(*exchange, ApiError(404, "not_found_error", fmt::format("{} {}: no such route", request.method, path)));
  }
}

void HttpServer::Impl::start_generation(const std::shared_ptr<Exchange>& exchange, bool chat) {
  if (draining) {
    send_error(*exchange, ApiError(503, "service_unavailable", "the server is shutting down"));
    return;
  }
  ++active;
  // The worker reads the body through the exchange, which the I/O thread leaves alone meanwhile.
  workers.post([this, exchange, chat] {
    std::shared_ptr<Generation> generation;
    std::optional<ApiError> failure;
    try {
      generation = prepare(exchange->request().body, chat);
      submit(*generation);
    } catch (const ApiError& error) {
      failure = error;
    } catch (const Error& error) {
      // Tokenizer and template errors are the request's fault; anything else is ours (logged, not shown).
      if (error.code() == ErrorCode::kInvalidArgument) {
        failure = invalid_request(error.what());
      } else {
        METRALE_LOG_ERROR("preparing a request failed: {}", error.what());
        failure = ApiError(500, "server_error", "internal error (the server log has the details)");
      }
    } catch (const std::exception& error) {
      METRALE_LOG_ERROR("preparing a request failed: {}", error.what());
      failure = ApiError(500, "server_error", "internal error (the server log has the details)");
    }
    exchange->post([this, exchange, generation, failure] {
      if (failure) {
        send_error(*exchange, *failure);
        --active;
        return;
      }
      exchange->pump([this, exchange, generation] {
        const bool again = step(*generation, *exchange);
        if (!again) --active;
        return again;
      });
    });
  });
}

void HttpServer::Impl::start_tokenize(const std::shared_ptr<Exchange>& exchange, bool detokenize) {
  workers.post([this, exchange, detokenize] {
    std::string body;
    std::optional<ApiError> failure;
    try {
      body = tokenize_body(exchange->request().body, detokenize);
    } catch (const ApiError& error) {
      failure = error;
    } catch (const Error& error) {
      failure = invalid_request(error.what());
    } catch (const std::exception& error) {
      METRALE_LOG_ERROR("tokenize failed: {}", error.what());
      failure = ApiError(500, "server_error", "internal error (the server log has the details)");
    }
    exchange->post([exchange, body = std::move(body), failure] {
      if (failure) {
        send_error(*exchange, *failure);
      } else {
        exchange->respond(200, "application/json", body);
      }
    });
  });
}

std::string HttpServer::Impl::tokenize_body(const std::string& body, bool detokenize) const {
  const json request = parse_json_body(body, config.limits);
  if (request.contains("model") && request["model"].is_string() && request["model"] != config.served_model_name)
    throw ApiError(404, "invalid_request_error", fmt::format("the model '{}' does not exist", request["model"].get<std::string>()),
                   "model", "model_not_found");
  if (detokenize) {
    const std::vector<int32_t> tokens = token_ids_field(request, "tokens");
    for (const int32_t id : tokens) {
      if (id >= tokenizer.vocab_size())
        throw invalid_request(fmt::format("'tokens' holds the id {}, outside the vocabulary", id), "tokens");
    }
    return dump_json(json{{"prompt", tokenizer.decode(tokens, /*skip_special_tokens=*/false)}});
  }
  std::vector<int32_t> ids;
  if (request.contains("messages")) {
    ChatRequest chat = parse_chat_request(request, config.default_sampling, config.limits);
    ids = tokenizer.encode(render_chat(chat), /*add_special_tokens=*/false);
  } else {
    if (!request.contains("prompt") || !request["prompt"].is_string())
      throw invalid_request("'prompt' (a string) or 'messages' is required", "prompt");
    bool add_special = true;
    if (request.contains("add_special_tokens")) {
      if (!request["add_special_tokens"].is_boolean()) throw invalid_request("'add_special_tokens' must be a boolean", "add_special_tokens");
      add_special = request["add_special_tokens"].get<bool>();
    }
    ids = tokenizer.encode(request["prompt"].get<std::string>(), add_special);
  }
  json reply = {{"count", ids.size()}, {"max_model_len", engine.plan().max_model_len}, {"tokens", ids}};
  if (request.value("return_token_strs", false)) {
    json strings = json::array();
    for (const int32_t id : ids) strings.push_back(tokenizer.id_to_token(id));
    reply["token_strs"] = std::move(strings);
  } else {
    reply["token_strs"] = nullptr;
  }
  return dump_json(reply);
}

std::string HttpServer::Impl::render_chat(ChatRequest& request) const {
  if (!chat_template) throw invalid_request("this model has no chat template; use /v1/completions", "messages");
  ChatTemplateInputs inputs;
  inputs.messages = std::move(request.messages);
  // tool_choice "none": the template does not see the tools (as /v1/responses, and vLLM with
  // --exclude-tools-when-tool-choice-none), so the model is not told it may call them; the output
  // is not parsed for calls either. Earlier turns' calls and tool results still render.
  if (request.tool_choice.mode != ToolChoiceMode::kNone) inputs.tools = std::move(request.tools);
  inputs.add_generation_prompt = request.add_generation_prompt;
  inputs.extra = std::move(request.chat_template_kwargs);
  try {
    return chat_template->render(inputs);
  } catch (const Error& e) {
    throw invalid_request(fmt::format("the chat template failed on these messages: {}", e.what()), "messages");
  }
}

std::shared_ptr<Generation> HttpServer::Impl::prepare(const std::string& body, bool chat) const {
  const json request_json = parse_json_body(body, config.limits);
  auto generation = std::make_shared<Generation>();
  generation->chat = chat;
  if (chat) {
    ChatRequest request = parse_chat_request(request_json, config.default_sampling, config.limits);
    generation->params = std::move(request.params);
    if (!chat_template) throw invalid_request("this model has no chat template; use /v1/completions", "messages");
    OutputConstraintSpec spec;
    spec.response_format = generation->params.response_format;
    spec.tool_choice = request.tool_choice;
    spec.tools = request.tool_definitions;
    spec.parallel_tool_calls = request.parallel_tool_calls;
    generation->grammar = structured->grammar_for(spec);
    if (structured->tool_format() && request.tool_choice.mode != ToolChoiceMode::kNone)
      generation->parsed_tools = request.tool_definitions;
    generation->parallel_tool_calls = request.parallel_tool_calls;
    const std::string prompt = render_chat(request);
    generation->prompts.push_back(tokenizer.encode(prompt, /*add_special_tokens=*/false));
    generation->reasoning = template_uses_think;
    // The prompt leaves a think block open (thinking models' generation prompts): the output
    // starts inside the reasoning.
    const size_t open = prompt.rfind("<think>");
    const size_t close = prompt.rfind("</think>");
    generation->starts_in_reasoning = open != std::string::npos && (close == std::string::npos || close < open);
    generation->meta.id = make_response_id("chatcmpl-");
  } else {
    CompletionRequest request = parse_completion_request(request_json, config.default_sampling, config.limits);
    generation->params = std::move(request.params);
    OutputConstraintSpec spec;
    spec.response_format = generation->params.response_format;
    generation->grammar = structured->grammar_for(spec);
    for (const std::string& text : request.text_prompts) {
      generation->prompts.push_back(tokenizer.encode(text, /*add_special_tokens=*/true));
      if (request.echo) generation->echo_texts.push_back(text);
    }
    for (auto& ids : request.token_prompts) {
      if (request.echo) generation->echo_texts.push_back(tokenizer.decode(ids, /*skip_special_tokens=*/false));
      generation->prompts.push_back(std::move(ids));
    }
    generation->echo_logprobs = request.echo && generation->params.logprobs.has_value();
    generation->meta.id = make_response_id("cmpl-");
  }
  GenerationParams& params = generation->params;
  if (!params.model.empty() && params.model != config.served_model_name) {
    throw ApiError(404, "invalid_request_error",
                   fmt::format("the model '{}' does not exist; this server serves '{}'", params.model,
                               config.served_model_name),
                   "model", "model_not_found");
  }
  generation->meta.model = config.served_model_name;
  generation->meta.created = static_cast<int64_t>(std::time(nullptr));

  const int64_t context = engine.plan().max_model_len;
  const char* prompt_param = chat ? "messages" : "prompt";
  for (const auto& prompt : generation->prompts) {
    const auto length = static_cast<int64_t>(prompt.size());
    if (length == 0) throw invalid_request("the prompt is empty", prompt_param);
    if (length >= context) {
      throw ApiError(400, "invalid_request_error",
                     fmt::format("the prompt has {} tokens but the model's context is {} tokens, which leaves no room "
                                 "to generate",
                                 length, context),
                     prompt_param, "context_length_exceeded");
    }
    if (params.max_tokens && *params.max_tokens > context - length) {
      throw ApiError(400, "invalid_request_error",
                     fmt::format("max_tokens is too large: the prompt has {} tokens and the model's context is {}, so "
                                 "at most {} tokens can be generated, but {} were asked for",
                                 length, context, context - length, *params.max_tokens),
                     chat ? "max_completion_tokens" : "max_tokens", "context_length_exceeded");
    }
  }
  const int64_t total = static_cast<int64_t>(generation->prompts.size()) * params.n;
  const int64_t most = engine.max_queued_requests() + engine.max_num_seqs();
  if (total > most) {
    throw invalid_request(
        fmt::format("the request asks for {} choices (prompts x n) but the server holds at most {} at once", total, most),
        "n");
  }
  return generation;
}

void HttpServer::Impl::submit(Generation& generation) {
  const GenerationParams& params = generation.params;
  std::vector<Request> requests;
  const int64_t context = engine.plan().max_model_len;
  thread_local std::mt19937_64 id_generator{std::random_device{}()};
  const uint64_t tool_id_seed = id_generator();
  for (size_t p = 0; p < generation.prompts.size(); ++p) {
    const auto& prompt = generation.prompts[p];
    for (int32_t j = 0; j < params.n; ++j) {
      const size_t index = requests.size();
      Request request;
      request.prompt = prompt;
      request.sampling = params.sampling;
      request.sampling.top_logprobs = params.logprobs.value_or(0);
      // Every choice gets its own seed, so n > 1 with a seed gives n different, reproducible outputs.
      if (params.sampling.seed) request.sampling.seed = *params.sampling.seed + index;
      const int64_t room = context - static_cast<int64_t>(prompt.size());
      request.max_tokens = static_cast<int32_t>(std::min<int64_t>(params.max_tokens.value_or(room), room));
      request.ignore_eos = params.ignore_eos;
      request.stop_token_ids = params.stop_token_ids;
      if (generation.echo_logprobs) {
        request.return_prompt_logits = true;
        request.prompt_logprobs = *params.logprobs;
      }
      if (generation.grammar) {
        GrammarConstraintOptions constraint;
        constraint.reasoning = generation.reasoning;
        constraint.starts_in_reasoning = generation.starts_in_reasoning;
        constraint.max_tokens = request.max_tokens;
        request.constraint = structured->constraint(generation.grammar, constraint);
      }
      requests.push_back(std::move(request));

      ChoiceOptions options;
      options.index = static_cast<int32_t>(index);
      options.stop = params.stop;
      options.skip_special_tokens = params.skip_special_tokens;
      options.logprobs = params.logprobs;
      options.return_token_ids = params.return_token_ids;
      if (params.return_token_ids) options.prompt_token_ids = prompt;
      options.reasoning = generation.reasoning;
      options.starts_in_reasoning = generation.starts_in_reasoning;
      if (!generation.echo_texts.empty()) options.text_offset = count_code_points(generation.echo_texts[p]);
      if (!generation.parsed_tools.empty()) {
        options.tool_format = structured->tool_format();
        options.tools = generation.parsed_tools;
        options.tool_id_seed = tool_id_seed + index;
        options.max_tool_calls = generation.parallel_tool_calls ? 0 : 1;
        // DeepSeek's markers may be special tokens, which the detokenizer must then keep.
        const ToolCallFormat format = *options.tool_format;
        if (format == ToolCallFormat::kDeepSeekV3 || format == ToolCallFormat::kDeepSeekV31 ||
            format == ToolCallFormat::kDeepSeekV32)
          options.skip_special_tokens = false;
      }
      generation.choices.emplace_back(tokenizer, std::move(options));
    }
  }
  SubmitResult submitted = engine.submit(std::move(requests));
  if (submitted.status == SubmitStatus::kQueueFull) {
    throw ApiError(429, "rate_limit_error",
                   fmt::format("the server is busy: {} requests are already waiting; retry later",
                               engine.max_queued_requests()),
                   "", "queue_full");
  }
  if (submitted.status == SubmitStatus::kShuttingDown)
    throw ApiError(503, "service_unavailable", "the server is shutting down");
  generation.stream = std::move(submitted.stream);
}

bool HttpServer::Impl::step(Generation& generation, Exchange& exchange) {
  if (generation.closed) return false;
  if (exchange.client_gone()) {
    abandon(generation);
    return false;
  }
  std::vector<StreamEvent> events = generation.stream->take();
  if (!generation.admitted) {
    if (events.empty()) return true;
    // The engine thread validates the group and answers first; tokens may follow in the same batch.
    if (!begin_response(generation, exchange, events.front())) return false;
    events.erase(events.begin());
  }
  return generation.params.stream ? stream_events(generation, exchange, std::move(events))
                                  : whole_events(generation, exchange, std::move(events));
}

bool HttpServer::Impl::begin_response(Generation& generation, Exchange& exchange, const StreamEvent& first) {
  if (first.kind == StreamEvent::Kind::kError) {
    generation.closed = true;
    switch (first.error_kind) {
      case StreamErrorKind::kInvalidRequest: send_error(exchange, invalid_request(first.error_message)); break;
      case StreamErrorKind::kShuttingDown: send_error(exchange, ApiError(503, "service_unavailable", first.error_message)); break;
      case StreamErrorKind::kInternal:
        METRALE_LOG_ERROR("request rejected by an engine failure: {}", first.error_message);
        send_error(exchange, ApiError(500, "server_error", kEngineFailure));
        break;
      case StreamErrorKind::kUnavailable:
        METRALE_LOG_ERROR("request refused: {}", first.error_message);
        send_error(exchange, ApiError(503, "service_unavailable", "the engine can no longer serve requests (GET /health says why)"));
        break;
    }
    return false;
  }
  METRALE_CHECK(first.kind == StreamEvent::Kind::kAdmitted, "a stream must start with its admission");
  generation.admitted = true;
  metrics.record_prompt_tokens(generation.usage().prompt_tokens);
  if (!generation.params.stream) {
    // Chunked too, so that heartbeats can notice a client that leaves while it waits.
    exchange.begin_stream(200, "application/json");
    return true;
  }
  exchange.begin_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}});
  // Chat streams open each choice with its role; completions with the echoed prompt.
  const bool usage_field = generation.params.include_usage;
  for (size_t i = 0; i < generation.choices.size(); ++i) {
    ChoiceText opening;
    opening.index = static_cast<int32_t>(i);
    if (generation.chat) {
      opening.first = true;
    } else if (!generation.echo_texts.empty()) {
      opening.text = generation.echo_texts[generation.prompt_of(i)];
    } else {
      continue;
    }
    const json chunk = generation.chat ? chat_chunk(generation.meta, opening, usage_field)
                                       : completion_chunk(generation.meta, opening, usage_field);
    if (!exchange.write(sse_event(chunk))) {
      abandon(generation);
      return false;
    }
  }
  return true;
}

bool HttpServer::Impl::heartbeat(Generation& generation, Exchange& exchange, std::string_view beat) {
  if (SteadyClock::now() - exchange.last_write() < kHeartbeatInterval) return true;
  if (exchange.write(beat)) return true;
  abandon(generation);
  return false;
}

bool HttpServer::Impl::stream_events(Generation& generation, Exchange& exchange, std::vector<StreamEvent> events) {
  const bool usage_field = generation.params.include_usage;
  const auto send = [&](const json& chunk) {
    if (exchange.write(sse_event(chunk))) return true;
    abandon(generation);
    return false;
  };
  const bool had_events = !events.empty();
  for (const ChoiceText& delta : apply(generation, std::move(events))) {
    const json chunk = generation.chat ? chat_chunk(generation.meta, delta, usage_field)
                                       : completion_chunk(generation.meta, delta, usage_field);
    if (!send(chunk)) return false;
  }
  if (!generation.all_finished() && !generation.stream->ended()) {
    return had_events || heartbeat(generation, exchange, ": keep-alive\n\n");
  }
  if (!generation.engine_error.empty() && !send(error_body(ApiError(500, "server_error", kEngineFailure)))) return false;
  if (usage_field && !send(usage_chunk(generation.meta, generation.chat, generation.usage()))) return false;
  if (!exchange.write(sse_done())) {
    abandon(generation);
    return false;
  }
  generation.closed = true;
  exchange.end_stream();
  return false;
}

bool HttpServer::Impl::whole_events(Generation& generation, Exchange& exchange, std::vector<StreamEvent> events) {
  apply(generation, std::move(events));
  if (!generation.all_finished() && !generation.stream->ended()) return heartbeat(generation, exchange, " ");
  std::string body;
  if (!generation.engine_error.empty()) {
    // The status line (200) is already out: the error travels in the body.
    body = dump_json(error_body(ApiError(500, "server_error", kEngineFailure)));
  } else {
    std::vector<ChoiceText> choices;
    for (size_t i = 0; i < generation.choices.size(); ++i) {
      ChoiceText choice = generation.choices[i].accumulated();
      if (!generation.echo_texts.empty()) choice.text = generation.echo_texts[generation.prompt_of(i)] + choice.text;
      choices.push_back(std::move(choice));
    }
    const json response = generation.chat ? chat_response(generation.meta, choices, generation.usage())
                                          : completion_response(generation.meta, choices, generation.usage());
    body = dump_json(response);
  }
  generation.closed = true;
  if (exchange.write(body)) exchange.end_stream();
  return false;
}

void HttpServer::Impl::record_choice(const Generation& generation, size_t index) {
  const ChoiceOutput& choice = generation.choices[index];
  ChoiceRecord record;
  record.finish_reason = choice.finish_reason();
  record.generation_tokens = choice.num_tokens();
  const SteadyClock::time_point submitted = generation.stream->submitted();
  record.e2e_seconds = seconds_between(submitted, SteadyClock::now());
  if (choice.first_token_time()) record.ttft_seconds = seconds_between(submitted, *choice.first_token_time());
  if (choice.num_tokens() > 1) {
    record.tpot_seconds = seconds_between(*choice.first_token_time(), *choice.last_token_time()) /
                          static_cast<double>(choice.num_tokens() - 1);
  }
  metrics.record_choice(record);
}

std::vector<ChoiceText> HttpServer::Impl::apply(Generation& generation, std::vector<StreamEvent> events) {
  std::vector<ChoiceText> deltas;
  const auto keep = [&](ChoiceText delta, size_t index, bool was_finished) {
    const bool ended_now = !was_finished && generation.choices[index].finished();
    if (ended_now) record_choice(generation, index);
    if (ended_now || !delta.text.empty() || !delta.reasoning.empty() || !delta.logprobs.empty() ||
        !delta.tool_calls.empty() || !delta.token_ids.empty())
      deltas.push_back(std::move(delta));
  };
  for (StreamEvent& event : events) {
    if (event.kind == StreamEvent::Kind::kError) {
      METRALE_LOG_ERROR("request {} failed in the engine: {}", generation.meta.id, event.error_message);
      generation.engine_error = event.error_message;
      for (size_t i = 0; i < generation.choices.size(); ++i) {
        const bool was_finished = generation.choices[i].finished();
        keep(generation.choices[i].on_error(), i, was_finished);
      }
      continue;
    }
    if (event.index < 0 || static_cast<size_t>(event.index) >= generation.choices.size()) continue;
    const auto index = static_cast<size_t>(event.index);
    ChoiceOutput& choice = generation.choices[index];
    const bool was_finished = choice.finished();
    if (event.kind == StreamEvent::Kind::kToken) {
      if (!event.prompt_logprobs.empty())
        choice.on_prompt_logprobs(generation.prompts[generation.prompt_of(index)], event.prompt_logprobs);
      keep(choice.on_token(event.sampled, event.finish_reason, event.time), index, was_finished);
      // A stop string ended the choice while its engine request still runs.
      if (!was_finished && choice.stopped_by_string() && event.finish_reason == FinishReason::kNone)
        engine.cancel(generation.stream->id(), event.index);
    } else if (event.kind == StreamEvent::Kind::kFinished) {
      keep(choice.on_end(event.finish_reason), index, was_finished);
    }
  }
  return deltas;
}

void HttpServer::Impl::abandon(Generation& generation) {
  if (generation.closed) return;
  generation.closed = true;
  engine.cancel(generation.stream->id());
  for (size_t i = 0; i < generation.choices.size(); ++i) {
    if (generation.choices[i].finished()) continue;
    generation.choices[i].on_end(FinishReason::kAbort);
    record_choice(generation, i);
  }
}

HttpServer::HttpServer(AsyncEngine& engine, Tokenizer tokenizer, ServerConfig config)
    : impl_(std::make_unique<Impl>(engine, std::move(tokenizer), std::move(config))) {}

HttpServer::~HttpServer() {
  // Workers first: a preparation in flight posts to an I/O loop, which must still exist.
  impl_->workers.stop();
  impl_->transport.stop();
}

int HttpServer::bind() {
  const ServerConfig& config = impl_->config;
  return impl_->transport.bind(config.host, config.port, config.listen_backlog);
}

void HttpServer::serve() { impl_->transport.run(); }

void HttpServer::begin_drain() { impl_->draining = true; }

int64_t HttpServer::active_generations() const { return impl_->active.load(); }

void HttpServer::stop() { impl_->transport.stop(); }

HealthReply HttpServer::health() const { return impl_->health_reply(); }

bool HttpServer::has_chat_template() const { return impl_->chat_template.has_value(); }

const ServerMetrics& HttpServer::metrics() const { return impl_->metrics; }

}  // namespace metrale::server
