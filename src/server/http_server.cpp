#include "server/http_server.h"

#include <sys/socket.h>

#include <chrono>
#include <ctime>
#include <optional>

#include <httplib.h>

#include "core/error.h"
#include "core/log.h"
#include "server/choice_output.h"
#include "server/health.h"
#include "text/chat_template.h"

namespace metrale::server {
namespace {

using json = nlohmann::ordered_json;

// cpp-httplib is a compiled library on Debian: its backlog (5) cannot be set by macros; listening
// again on the bound socket raises it.
class ListeningServer : public httplib::Server {
 public:
  bool relisten(int backlog) { return ::listen(svr_sock_, backlog) == 0; }
};

constexpr std::chrono::milliseconds kPollInterval{100};
// While a response has nothing to send it writes a heartbeat this often (an SSE comment, or JSON's
// insignificant leading whitespace): a write is the only reliable way to learn that the client is
// gone (the second write after the peer closed fails), so waiting requests of departed clients are
// cancelled too.
constexpr std::chrono::milliseconds kHeartbeatInterval{1000};

std::string status_text(int status) {
  switch (status) {
    case 400: return "the HTTP request is malformed";
    case 404: return "no such route";
    case 405: return "method not allowed";
    case 413: return "the request body is too large";
    case 414: return "the request URI is too long";
    default: return fmt::format("HTTP status {}", status);
  }
}

double seconds_between(SteadyClock::time_point from, SteadyClock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// One HTTP request's work: its prompts, the engine stream of its n x prompts requests, and the
// text state of every choice. Owned by the response's content provider; used by one worker thread.
struct Generation {
  bool chat = false;
  GenerationParams params;
  ResponseMeta meta;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> echo_texts;  // per prompt, when echo
  bool reasoning = false;
  bool starts_in_reasoning = false;

  std::shared_ptr<RequestStream> stream;
  std::vector<StreamEvent> backlog;  // events that arrived with the admission
  std::vector<ChoiceOutput> choices; // [prompt * n + j]
  bool started = false;              // the opening chunks are out
  bool closed = false;               // the response is complete, or abandoned
  SteadyClock::time_point last_write = SteadyClock::now();
  std::string engine_error;          // the engine failed mid-way

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

}  // namespace

struct HttpServer::Impl {
  AsyncEngine& engine;
  Tokenizer tokenizer;
  ServerConfig config;
  std::optional<ChatTemplate> chat_template;
  bool template_uses_think = false;
  ServerMetrics metrics;
  ListeningServer http;
  const int64_t created = static_cast<int64_t>(std::time(nullptr));

  Impl(AsyncEngine& engine_ref, Tokenizer tokenizer_handle, ServerConfig server_config)
      : engine(engine_ref), tokenizer(std::move(tokenizer_handle)), config(std::move(server_config)) {
    if (!tokenizer.chat_template().empty()) {
      try {
        chat_template.emplace(ChatTemplate::from_tokenizer(tokenizer));
        template_uses_think = tokenizer.chat_template().find("<think>") != std::string::npos;
      } catch (const Error& e) {
        METRALE_LOG_WARN("the model's chat template cannot be used, /v1/chat/completions is off: {}", e.what());
      }
    }
    install_routes();
  }

  void install_routes();
  void send_error(httplib::Response& res, const ApiError& error) const;
  bool authorized(const httplib::Request& req) const;

  std::shared_ptr<Generation> prepare(const std::string& body, bool chat) const;
  void submit(Generation& generation);
  void handle_generation(const httplib::Request& req, httplib::Response& res, bool chat);

  // Applies engine events to the choices; returns the deltas the client should see, in order.
  std::vector<ChoiceText> apply(Generation& generation, std::vector<StreamEvent> events);
  void record_choice(const Generation& generation, size_t index);
  // The client is gone (or the response failed): cancel what still runs and count it aborted.
  void abandon(Generation& generation);
  // Nothing to send: returns false (after abandoning the request) when the client is gone.
  bool client_present(Generation& generation, httplib::DataSink& sink, std::string_view heartbeat);
  bool stream_step(Generation& generation, httplib::DataSink& sink);
  bool whole_step(Generation& generation, httplib::DataSink& sink);
};

void HttpServer::Impl::send_error(httplib::Response& res, const ApiError& error) const {
  res.status = error.status();
  res.set_content(dump_json(error_body(error)), "application/json");
}

bool HttpServer::Impl::authorized(const httplib::Request& req) const {
  if (config.api_key.empty()) return true;
  return req.get_header_value("Authorization") == "Bearer " + config.api_key;
}

void HttpServer::Impl::install_routes() {
  const auto threads = static_cast<size_t>(std::max(1, config.http_threads));
  // httplib takes ownership of the pool it is handed (its API is a factory returning a raw pointer).
  http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http.set_keep_alive_max_count(100000);
  http.set_keep_alive_timeout(config.keep_alive_seconds);
  http.set_payload_max_length(config.max_body_bytes);
  http.set_tcp_nodelay(true);

  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (req.path.rfind("/v1/", 0) == 0 && !authorized(req)) {
      send_error(res, ApiError(401, "authentication_error", "invalid or missing API key (send Authorization: Bearer <key>)",
                               "", "invalid_api_key"));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generation(req, res, /*chat=*/false);
  });
  http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_generation(req, res, /*chat=*/true);
  });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(dump_json(models_response(config.served_model_name, created, engine.plan().max_model_len)),
                    "application/json");
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const HealthReply reply = health_reply(engine.health());
    res.status = reply.status;
    res.set_content(reply.body, "application/json");
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.render(engine.stats()), "text/plain; version=0.0.4; charset=utf-8");
  });
  // Statuses httplib sets itself (404 no route, 413 body too large, 400 unparsable HTTP) get an
  // OpenAI-style body too.
  http.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req,
                                                                      httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string message = fmt::format("{} {}: {}", req.method, req.path, status_text(res.status));
    const std::string type = res.status == 404 ? "not_found_error" : "invalid_request_error";
    send_error(res, ApiError(res.status, type, std::move(message)));
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.set_exception_handler([this](const httplib::Request&, httplib::Response& res, std::exception_ptr failure) {
    std::string message = "internal error";
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      message = std::string("internal error: ") + e.what();
    } catch (...) {
    }
    METRALE_LOG_ERROR("{}", message);
    send_error(res, ApiError(500, "server_error", message));
  });
  http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    static const char* const kRoutes[] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                          "/metrics"};
    std::string_view route = "other";
    for (const char* known : kRoutes) {
      if (req.path == known) route = known;
    }
    metrics.record_http(route, res.status);
  });
}

std::shared_ptr<Generation> HttpServer::Impl::prepare(const std::string& body, bool chat) const {
  const json request_json = parse_json_body(body);
  auto generation = std::make_shared<Generation>();
  generation->chat = chat;
  if (chat) {
    ChatRequest request = parse_chat_request(request_json, config.default_sampling, config.limits);
    generation->params = std::move(request.params);
    if (!chat_template) throw invalid_request("this model has no chat template; use /v1/completions", "messages");
    ChatTemplateInputs inputs;
    inputs.messages = std::move(request.messages);
    inputs.tools = std::move(request.tools);
    inputs.add_generation_prompt = request.add_generation_prompt;
    inputs.extra = std::move(request.chat_template_kwargs);
    std::string prompt;
    try {
      prompt = chat_template->render(inputs);
    } catch (const Error& e) {
      throw invalid_request(fmt::format("the chat template failed on these messages: {}", e.what()), "messages");
    }
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
    for (const std::string& text : request.text_prompts) {
      generation->prompts.push_back(tokenizer.encode(text, /*add_special_tokens=*/true));
      if (request.echo) generation->echo_texts.push_back(text);
    }
    for (auto& ids : request.token_prompts) {
      if (request.echo) generation->echo_texts.push_back(tokenizer.decode(ids, /*skip_special_tokens=*/false));
      generation->prompts.push_back(std::move(ids));
    }
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
    if (params.max_tokens && length + *params.max_tokens > context) {
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
      requests.push_back(std::move(request));

      ChoiceOptions options;
      options.index = static_cast<int32_t>(index);
      options.stop = params.stop;
      options.skip_special_tokens = params.skip_special_tokens;
      options.logprobs = params.logprobs;
      options.reasoning = generation.reasoning;
      options.starts_in_reasoning = generation.starts_in_reasoning;
      if (!generation.echo_texts.empty()) options.text_offset = count_code_points(generation.echo_texts[p]);
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

  // The engine thread validates the group and answers first; tokens may follow in the same batch.
  for (;;) {
    std::vector<StreamEvent> events = generation.stream->wait(std::chrono::milliseconds(1000));
    if (events.empty()) continue;
    const StreamEvent& first = events.front();
    if (first.kind == StreamEvent::Kind::kError) {
      switch (first.error_kind) {
        case StreamErrorKind::kInvalidRequest: throw invalid_request(first.error_message);
        case StreamErrorKind::kShuttingDown: throw ApiError(503, "service_unavailable", first.error_message);
        case StreamErrorKind::kInternal: throw ApiError(500, "server_error", first.error_message);
      }
    }
    METRALE_CHECK(first.kind == StreamEvent::Kind::kAdmitted, "a stream must start with its admission");
    generation.backlog.assign(std::make_move_iterator(events.begin() + 1), std::make_move_iterator(events.end()));
    break;
  }
  metrics.record_prompt_tokens(generation.usage().prompt_tokens);
}

void HttpServer::Impl::handle_generation(const httplib::Request& req, httplib::Response& res, bool chat) {
  std::shared_ptr<Generation> generation;
  try {
    generation = prepare(req.body, chat);
    submit(*generation);
  } catch (const ApiError& error) {
    send_error(res, error);
    return;
  } catch (const Error& error) {
    // Tokenizer and template errors are the request's fault; anything else is ours.
    if (error.code() == ErrorCode::kInvalidArgument) send_error(res, invalid_request(error.what()));
    else send_error(res, ApiError(500, "server_error", error.what()));
    return;
  }
  const auto release = [this, generation](bool success) {
    if (!success) abandon(*generation);
  };
  if (generation->params.stream) {
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, generation](size_t, httplib::DataSink& sink) { return stream_step(*generation, sink); }, release);
  } else {
    // Chunked too, so that the worker can notice a client that leaves while it waits.
    res.set_chunked_content_provider(
        "application/json",
        [this, generation](size_t, httplib::DataSink& sink) { return whole_step(*generation, sink); }, release);
  }
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
    if (ended_now || !delta.text.empty() || !delta.reasoning.empty() || !delta.logprobs.empty())
      deltas.push_back(std::move(delta));
  };
  for (StreamEvent& event : events) {
    if (event.kind == StreamEvent::Kind::kError) {
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

bool HttpServer::Impl::client_present(Generation& generation, httplib::DataSink& sink, std::string_view heartbeat) {
  const SteadyClock::time_point now = SteadyClock::now();
  bool present = sink.is_writable();
  if (present && now - generation.last_write >= kHeartbeatInterval) {
    present = sink.write(heartbeat.data(), heartbeat.size());
    generation.last_write = now;
  }
  if (!present) abandon(generation);
  return present;
}

bool HttpServer::Impl::stream_step(Generation& generation, httplib::DataSink& sink) {
  if (generation.closed) return false;
  const bool usage_field = generation.params.include_usage;
  const auto send = [&](const json& chunk) {
    const std::string event = sse_event(chunk);
    generation.last_write = SteadyClock::now();
    if (sink.write(event.data(), event.size())) return true;
    abandon(generation);
    return false;
  };
  const auto chunk_of = [&](const ChoiceText& delta) {
    return generation.chat ? chat_chunk(generation.meta, delta, usage_field)
                           : completion_chunk(generation.meta, delta, usage_field);
  };
  if (!generation.started) {
    generation.started = true;
    // Chat streams open each choice with its role; completions with the echoed prompt.
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
      if (!send(chunk_of(opening))) return false;
    }
  }
  std::vector<StreamEvent> events;
  if (!generation.backlog.empty()) events.swap(generation.backlog);
  else events = generation.stream->wait(kPollInterval);
  if (events.empty() && !generation.all_finished() && !generation.stream->ended())
    return client_present(generation, sink, ": keep-alive\n\n");
  for (const ChoiceText& delta : apply(generation, std::move(events))) {
    if (!send(chunk_of(delta))) return false;
  }
  if (!generation.all_finished() && !generation.stream->ended()) return true;
  if (!generation.engine_error.empty()) {
    if (!send(error_body(ApiError(500, "server_error", generation.engine_error)))) return false;
  }
  if (usage_field && !send(usage_chunk(generation.meta, generation.chat, generation.usage()))) return false;
  const std::string done = sse_done();
  if (!sink.write(done.data(), done.size())) {
    abandon(generation);
    return false;
  }
  generation.closed = true;
  sink.done();
  return true;
}

bool HttpServer::Impl::whole_step(Generation& generation, httplib::DataSink& sink) {
  if (generation.closed) return false;
  std::vector<StreamEvent> events;
  if (!generation.backlog.empty()) events.swap(generation.backlog);
  else events = generation.stream->wait(kPollInterval);
  apply(generation, std::move(events));
  if (!generation.all_finished() && !generation.stream->ended()) return client_present(generation, sink, " ");
  std::string body;
  if (!generation.engine_error.empty()) {
    // The status line (200) is already out: the error travels in the body.
    body = dump_json(error_body(ApiError(500, "server_error", generation.engine_error)));
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
  if (!sink.write(body.data(), body.size())) return false;
  sink.done();
  return true;
}

HttpServer::HttpServer(AsyncEngine& engine, Tokenizer tokenizer, ServerConfig config)
    : impl_(std::make_unique<Impl>(engine, std::move(tokenizer), std::move(config))) {}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind() {
  ServerConfig& config = impl_->config;
  int port = config.port;
  if (port == 0) {
    port = impl_->http.bind_to_any_port(config.host);
    if (port < 0) raise(ErrorCode::kInvalidArgument, "cannot bind to {} (any port)", config.host);
  } else if (!impl_->http.bind_to_port(config.host, port)) {
    raise(ErrorCode::kInvalidArgument, "cannot bind to {}:{} (in use, or not an address of this machine?)",
          config.host, port);
  }
  if (!impl_->http.relisten(config.listen_backlog))
    METRALE_LOG_WARN("could not raise the listen backlog to {}", config.listen_backlog);
  return port;
}

void HttpServer::serve() { impl_->http.listen_after_bind(); }

void HttpServer::stop() {
  if (impl_->http.is_running()) impl_->http.stop();
}

bool HttpServer::has_chat_template() const { return impl_->chat_template.has_value(); }

const ServerMetrics& HttpServer::metrics() const { return impl_->metrics; }

}  // namespace metrale::server
