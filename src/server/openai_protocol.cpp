#include "server/openai_protocol.h"
#include "server/request_fields.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <random>

#include <fmt/format.h>

#include "core/error.h"
#include "core/json_depth.h"

namespace metrale::server {

using json = nlohmann::ordered_json;

ApiError invalid_request(std::string message, std::string param) {
  return ApiError(400, "invalid_request_error", std::move(message), std::move(param));
}

json error_body(const ApiError& error) {
  json body = {{"message", error.what()},
               {"type", error.type()},
               {"param", error.param().empty() ? json(nullptr) : json(error.param())},
               {"code", error.code().empty() ? json(nullptr) : json(error.code())}};
  return json{{"error", std::move(body)}};
}

namespace {

// nlohmann's messages start with "[json.exception.parse_error.101] "; the client needs the rest.
std::string_view without_exception_id(std::string_view message) {
  if (message.rfind("[json.exception.", 0) == 0) {
    const size_t end = message.find("] ");
    if (end != std::string_view::npos) message.remove_prefix(end + 2);
  }
  return message;
}

}  // namespace

json parse_json_body(std::string_view body, const ProtocolLimits& limits) {
  // Copies and dumps of the parsed value recurse once per level: refuse deep text before parsing.
  if (json_nests_deeper_than(body, limits.max_json_depth))
    throw invalid_request(fmt::format("the request body nests deeper than {} levels", limits.max_json_depth));
  json value;
  try {
    value = json::parse(body.begin(), body.end());
  } catch (const json::out_of_range& e) {
    // A number beyond a double (1e400).
    throw invalid_request(fmt::format("the request body holds a number out of range: {}", without_exception_id(e.what())));
  } catch (const json::exception& e) {
    throw invalid_request(fmt::format("the request body is not valid JSON: {}", without_exception_id(e.what())));
  }
  if (!value.is_object()) throw invalid_request("the request body must be a JSON object");
  return value;
}

namespace {

using request_fields::as_integer;
using request_fields::field;
using request_fields::get_bool;
using request_fields::get_integer;
using request_fields::get_number;
using request_fields::get_string;
using request_fields::wrong_type;

// The string at `key`, "" when it is absent or not a string (the caller's check then fails).
std::string string_field_or_empty(const json& object, const char* key) {
  const auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : std::string();
}

void check_range(bool ok, const std::string& key, const std::string& range, double got) {
  if (!ok) throw invalid_request(fmt::format("'{}' must be {}, got {}", key, range, got), key);
}

std::vector<int32_t> token_id_list(const json& value, const std::string& key) {
  std::vector<int32_t> ids;
  ids.reserve(value.size());
  for (const json& item : value) {
    const int64_t id = as_integer(item, key);
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      throw invalid_request(fmt::format("'{}' holds the token id {}, which is out of range", key, id), key);
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

bool is_token_id_list(const json& value) {
  if (!value.is_array() || value.empty()) return false;
  for (const json& item : value) {
    if (!item.is_number()) return false;
  }
  return true;
}

// The fields both endpoints share. `max_tokens_key`: the field that wins for the length limit.
GenerationParams parse_common(const json& body, const SamplingParams& defaults, const ProtocolLimits& limits) {
  GenerationParams params;
  params.sampling = defaults;
  params.sampling.seed.reset();
  params.sampling.top_logprobs = 0;
  if (auto model = get_string(body, "model")) params.model = *model;

  if (auto n = get_integer(body, "n")) {
    if (*n < 1 || *n > limits.max_n)
      throw invalid_request(fmt::format("'n' must be between 1 and {}, got {}", limits.max_n, *n), "n");
    params.n = static_cast<int32_t>(*n);
  }
  if (auto best_of = get_integer(body, "best_of"); best_of && *best_of != params.n)
    throw invalid_request("'best_of' other than n is not supported", "best_of");
  if (const json* bias = field(body, "logit_bias")) {
    if (!bias->is_object()) throw wrong_type("logit_bias", "an object of token ids to biases", *bias);
    for (const auto& [key, value] : bias->items()) {
      int64_t id = -1;
      const auto [end, error] = std::from_chars(key.data(), key.data() + key.size(), id);
      if (error != std::errc() || end != key.data() + key.size() || id < 0 || id > std::numeric_limits<int32_t>::max())
        throw invalid_request(fmt::format("'logit_bias' keys must be token ids, got '{}'", key), "logit_bias");
      if (!value.is_number()) throw wrong_type("logit_bias", "numbers as biases", value);
      const double amount = value.get<double>();
      check_range(amount >= -SamplingParams::kMaxLogitBias && amount <= SamplingParams::kMaxLogitBias, "logit_bias",
                  "in [-100, 100]", amount);
      params.sampling.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(amount));
    }
  }
  if (const json* format = field(body, "response_format"))
    params.response_format = parse_response_format(*format, "response_format");

  SamplingParams& sampling = params.sampling;
  if (auto value = get_number(body, "temperature")) {
    check_range(std::isfinite(*value) && *value >= 0.0, "temperature", "a number >= 0", *value);
    sampling.temperature = static_cast<float>(*value);
  }
  if (auto value = get_number(body, "top_p")) {
    check_range(*value > 0.0 && *value <= 1.0, "top_p", "in (0, 1]", *value);
    sampling.top_p = static_cast<float>(*value);
  }
  if (auto value = get_integer(body, "top_k")) {
    check_range(*value >= -1 && *value <= std::numeric_limits<int32_t>::max(), "top_k", "-1, 0 (off) or a positive integer",
                static_cast<double>(*value));
    sampling.top_k = static_cast<int32_t>(*value);
  }
  if (auto value = get_number(body, "min_p")) {
    check_range(*value >= 0.0 && *value <= 1.0, "min_p", "in [0, 1]", *value);
    sampling.min_p = static_cast<float>(*value);
  }
  if (auto value = get_number(body, "presence_penalty")) {
    check_range(*value >= -2.0 && *value <= 2.0, "presence_penalty", "in [-2, 2]", *value);
    sampling.presence_penalty = static_cast<float>(*value);
  }
  if (auto value = get_number(body, "frequency_penalty")) {
    check_range(*value >= -2.0 && *value <= 2.0, "frequency_penalty", "in [-2, 2]", *value);
    sampling.frequency_penalty = static_cast<float>(*value);
  }
  if (auto value = get_number(body, "repetition_penalty")) {
    check_range(std::isfinite(*value) && *value > 0.0, "repetition_penalty", "a number > 0", *value);
    sampling.repetition_penalty = static_cast<float>(*value);
  }
  if (auto seed = get_integer(body, "seed")) sampling.seed = static_cast<uint64_t>(*seed);

  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      params.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& item : *stop) {
        if (!item.is_string()) throw wrong_type("stop", "a string or a list of strings", item);
        params.stop.push_back(item.get<std::string>());
      }
    } else {
      throw wrong_type("stop", "a string or a list of strings", *stop);
    }
    if (static_cast<int32_t>(params.stop.size()) > limits.max_stop_strings)
      throw invalid_request(fmt::format("'stop' may hold at most {} strings", limits.max_stop_strings), "stop");
    for (const std::string& text : params.stop) {
      if (text.empty()) throw invalid_request("'stop' strings must not be empty", "stop");
      if (text.size() > limits.max_stop_bytes)
        throw invalid_request(fmt::format("'stop' strings may be at most {} bytes long", limits.max_stop_bytes), "stop");
    }
  }
  if (const json* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) throw wrong_type("stop_token_ids", "a list of integers", *ids);
    params.stop_token_ids = token_id_list(*ids, "stop_token_ids");
  }
  if (auto value = get_bool(body, "ignore_eos")) params.ignore_eos = *value;
  if (auto value = get_bool(body, "skip_special_tokens")) params.skip_special_tokens = *value;
  if (auto value = get_bool(body, "return_token_ids")) params.return_token_ids = *value;
  if (auto value = get_bool(body, "stream")) params.stream = *value;
  if (const json* options = field(body, "stream_options")) {
    if (!options->is_object()) throw wrong_type("stream_options", "an object", *options);
    if (auto include = get_bool(*options, "include_usage")) params.include_usage = *include;
  }
  return params;
}

void parse_max_tokens(const json& body, const std::string& key, GenerationParams& params) {
  if (auto value = get_integer(body, key)) {
    if (*value < 1) throw invalid_request(fmt::format("'{}' must be at least 1, got {}", key, *value), key);
    params.max_tokens = *value;
  }
}

// Chat content: a string, null, or a list of {type: "text", text} parts (joined). Null (an assistant
// turn that only called tools) becomes "": templates test and split the content as a string.
json normalize_content(const json& content, size_t message_index) {
  if (content.is_null()) return "";
  if (content.is_string()) return content;
  const std::string param = fmt::format("messages[{}].content", message_index);
  if (!content.is_array()) throw wrong_type(param, "a string or a list of content parts", content);
  std::string text;
  for (const json& part : content) {
    if (!part.is_object() || string_field_or_empty(part, "type") != "text" || !part.contains("text") || !part["text"].is_string())
      throw invalid_request(fmt::format("'{}' may hold only text parts ({{\"type\": \"text\", \"text\": ...}})", param),
                            param);
    text += part["text"].get<std::string>();
  }
  return text;
}

// An assistant message's tool_calls as the chat templates read them: each call's `arguments`, a
// JSON string on the wire, becomes the object it spells (templates iterate it or print it with
// tojson); arguments that are not a JSON object stay as sent, and so does everything else of the
// call. Also accepts the flat {name, arguments} shape beside {function: {name, arguments}}.
json normalize_tool_calls(const json& calls, size_t message_index) {
  const std::string param = fmt::format("messages[{}].tool_calls", message_index);
  if (calls.is_null()) return calls;
  if (!calls.is_array()) throw wrong_type(param, "a list of tool calls", calls);
  json normalized = json::array();
  for (const json& call : calls) {
    if (!call.is_object()) throw wrong_type(param, "a list of tool call objects", call);
    json copy = call;
    json& function = copy.contains("function") ? copy["function"] : copy;
    if (function.is_object() && function.contains("arguments") && function["arguments"].is_string()) {
      json parsed = json::parse(function["arguments"].get<std::string>(), nullptr, /*allow_exceptions=*/false);
      if (parsed.is_object()) function["arguments"] = std::move(parsed);
    }
    normalized.push_back(std::move(copy));
  }
  return normalized;
}

ToolChoice parse_tool_choice(const json& value, const std::vector<ToolDefinition>& tools) {
  ToolChoice choice;
  if (value.is_string()) {
    const std::string mode = value.get<std::string>();
    if (mode == "auto") {
      choice.mode = ToolChoiceMode::kAuto;
    } else if (mode == "none") {
      choice.mode = ToolChoiceMode::kNone;
    } else if (mode == "required") {
      choice.mode = ToolChoiceMode::kRequired;
    } else {
      throw invalid_request(fmt::format("'tool_choice' must be \"auto\", \"none\", \"required\" or a function, got \"{}\"", mode),
                            "tool_choice");
    }
  } else if (value.is_object()) {
    const json* function = field(value, "function");
    if (string_field_or_empty(value, "type") != "function" || function == nullptr || !function->is_object() ||
        !function->contains("name") || !(*function)["name"].is_string())
      throw invalid_request("'tool_choice' must name a function as {\"type\": \"function\", \"function\": {\"name\": ...}}",
                            "tool_choice");
    choice.mode = ToolChoiceMode::kFunction;
    choice.function = (*function)["name"].get<std::string>();
    const bool declared =
        std::any_of(tools.begin(), tools.end(), [&](const ToolDefinition& tool) { return tool.name == choice.function; });
    if (!declared)
      throw invalid_request(fmt::format("'tool_choice' names the function '{}', which is not among the tools", choice.function),
                            "tool_choice");
  } else {
    throw wrong_type("tool_choice", "a string or an object", value);
  }
  if ((choice.mode == ToolChoiceMode::kRequired) && tools.empty())
    throw invalid_request("'tool_choice' \"required\" needs 'tools'", "tool_choice");
  return choice;
}

}  // namespace

std::vector<int32_t> token_ids_field(const json& body, const std::string& key) {
  const json* value = field(body, key);
  if (value == nullptr) throw invalid_request(fmt::format("'{}' is required", key), key);
  if (!value->is_array()) throw wrong_type(key, "a list of token ids", *value);
  return token_id_list(*value, key);
}

ResponseFormat parse_response_format(const json& value, const std::string& param) {
  ResponseFormat format;
  if (value.is_null()) return format;
  if (!value.is_object()) throw wrong_type(param, "an object", value);
  const std::string type = value.contains("type") && value["type"].is_string() ? value["type"].get<std::string>() : "";
  if (type == "text") return format;
  if (type == "json_object") {
    format.type = ResponseFormatType::kJsonObject;
    return format;
  }
  if (type != "json_schema")
    throw invalid_request(fmt::format("'{}.type' must be \"text\", \"json_object\" or \"json_schema\"", param),
                          param + ".type");
  format.type = ResponseFormatType::kJsonSchema;
  const json* spec = field(value, "json_schema");
  if (spec == nullptr || !spec->is_object())
    throw invalid_request(fmt::format("'{}.json_schema' must be an object with a 'schema'", param), param + ".json_schema");
  if (auto name = get_string(*spec, "name")) format.name = *name;
  if (auto strict = get_bool(*spec, "strict")) format.strict = *strict;
  const json* schema = field(*spec, "schema");
  if (schema == nullptr) {
    format.schema = json::object();
  } else if (schema->is_object() || schema->is_boolean()) {
    format.schema = *schema;
  } else {
    throw wrong_type(param + ".json_schema.schema", "a JSON Schema object", *schema);
  }
  return format;
}

CompletionRequest parse_completion_request(const json& body, const SamplingParams& defaults,
                                           const ProtocolLimits& limits) {
  CompletionRequest request;
  request.params = parse_common(body, defaults, limits);
  parse_max_tokens(body, "max_tokens", request.params);
  const json* prompt = field(body, "prompt");
  if (prompt == nullptr) throw invalid_request("'prompt' is required", "prompt");
  if (prompt->is_string()) {
    request.text_prompts.push_back(prompt->get<std::string>());
  } else if (is_token_id_list(*prompt)) {
    request.token_prompts.push_back(token_id_list(*prompt, "prompt"));
  } else if (prompt->is_array() && !prompt->empty()) {
    const bool strings = (*prompt)[0].is_string();
    for (const json& item : *prompt) {
      if (strings && item.is_string()) {
        request.text_prompts.push_back(item.get<std::string>());
      } else if (!strings && is_token_id_list(item)) {
        request.token_prompts.push_back(token_id_list(item, "prompt"));
      } else {
        throw invalid_request("'prompt' must be a string, a list of strings, a list of token ids or a list of such "
                              "lists (not mixed, none empty)",
                              "prompt");
      }
    }
  } else {
    throw invalid_request("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists "
                          "(not mixed, none empty)",
                          "prompt");
  }
  if (auto echo = get_bool(body, "echo")) request.echo = *echo;
  if (const json* logprobs = field(body, "logprobs")) {
    if (logprobs->is_boolean()) throw wrong_type("logprobs", "an integer", *logprobs);
    const int64_t count = as_integer(*logprobs, "logprobs");
    if (count < 0 || count > limits.max_top_logprobs)
      throw invalid_request(fmt::format("'logprobs' must be between 0 and {}, got {}", limits.max_top_logprobs, count),
                            "logprobs");
    request.params.logprobs = static_cast<int32_t>(count);
  }
  if (auto suffix = get_string(body, "suffix"); suffix && !suffix->empty())
    throw invalid_request("'suffix' is not supported", "suffix");
  return request;
}

ChatRequest parse_chat_request(const json& body, const SamplingParams& defaults, const ProtocolLimits& limits) {
  ChatRequest request;
  request.params = parse_common(body, defaults, limits);
  parse_max_tokens(body, "max_tokens", request.params);
  parse_max_tokens(body, "max_completion_tokens", request.params);  // wins over the legacy max_tokens

  const json* messages = field(body, "messages");
  if (messages == nullptr) throw invalid_request("'messages' is required", "messages");
  if (!messages->is_array()) throw wrong_type("messages", "a list of messages", *messages);
  if (messages->empty()) throw invalid_request("'messages' must hold at least one message", "messages");
  if (messages->size() > limits.max_messages)
    throw invalid_request(fmt::format("'messages' may hold at most {} messages", limits.max_messages), "messages");
  request.messages = json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& message = (*messages)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!message.is_object()) throw wrong_type(param, "an object", message);
    if (!message.contains("role") || !message["role"].is_string())
      throw invalid_request(fmt::format("'{}.role' must be a string", param), param + ".role");
    json normalized = message;
    normalized["content"] = message.contains("content") ? normalize_content(message["content"], i) : json("");
    if (message.contains("tool_calls")) normalized["tool_calls"] = normalize_tool_calls(message["tool_calls"], i);
    request.messages.push_back(std::move(normalized));
  }

  const bool logprobs = get_bool(body, "logprobs").value_or(false);
  const std::optional<int64_t> top_logprobs = get_integer(body, "top_logprobs");
  if (top_logprobs) {
    if (*top_logprobs < 0 || *top_logprobs > limits.max_top_logprobs)
      throw invalid_request(
          fmt::format("'top_logprobs' must be between 0 and {}, got {}", limits.max_top_logprobs, *top_logprobs),
          "top_logprobs");
    if (!logprobs && *top_logprobs > 0)
      throw invalid_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs");
  }
  if (logprobs) request.params.logprobs = static_cast<int32_t>(top_logprobs.value_or(0));

  if (const json* tools = field(body, "tools")) {
    if (!tools->is_array()) throw wrong_type("tools", "a list of tools", *tools);
    if (tools->size() > limits.max_tools)
      throw invalid_request(fmt::format("'tools' may hold at most {} tools", limits.max_tools), "tools");
    if (!tools->empty()) request.tools = *tools;
  }
  if (const json* kwargs = field(body, "chat_template_kwargs")) {
    if (!kwargs->is_object()) throw wrong_type("chat_template_kwargs", "an object", *kwargs);
    if (kwargs->size() > limits.max_template_kwargs)
      throw invalid_request(fmt::format("'chat_template_kwargs' may hold at most {} keys", limits.max_template_kwargs),
                            "chat_template_kwargs");
    request.chat_template_kwargs = *kwargs;
  }
  if (auto value = get_bool(body, "add_generation_prompt")) request.add_generation_prompt = *value;
  if (!request.tools.is_null()) {
    try {
      request.tool_definitions = tool_definitions_from_openai(request.tools);
    } catch (const Error& e) {
      throw invalid_request(e.what(), "tools");
    }
  }
  if (auto value = get_bool(body, "parallel_tool_calls")) request.parallel_tool_calls = *value;
  if (const json* choice = field(body, "tool_choice")) request.tool_choice = parse_tool_choice(*choice, request.tool_definitions);
  return request;
}

namespace {

// JSON has no infinity: a masked token's -inf logprob is reported as -9999 (as vLLM does).
double finite_logprob(float logprob) { return std::isfinite(logprob) ? static_cast<double>(logprob) : -9999.0; }

json byte_values(const std::string& bytes) {
  json values = json::array();
  for (const char c : bytes) values.push_back(static_cast<int>(static_cast<unsigned char>(c)));
  return values;
}

json completion_logprobs(const ChoiceText& choice) {
  if (!choice.has_logprobs) return nullptr;
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(), offsets = json::array();
  for (const LogprobEntry& entry : choice.logprobs) {
    tokens.push_back(entry.chosen.token);
    offsets.push_back(entry.text_offset);
    if (!entry.has_logprob) {
      token_logprobs.push_back(nullptr);
      top_logprobs.push_back(nullptr);
      continue;
    }
    token_logprobs.push_back(finite_logprob(entry.chosen.logprob));
    json top = json::object();
    for (const TokenAlternative& alternative : entry.top) {
      // Two alternatives may render to the same text (partial characters): keep the likelier one.
      if (!top.contains(alternative.token)) top[alternative.token] = finite_logprob(alternative.logprob);
    }
    top_logprobs.push_back(std::move(top));
  }
  return json{{"tokens", std::move(tokens)},
              {"token_logprobs", std::move(token_logprobs)},
              {"top_logprobs", std::move(top_logprobs)},
              {"text_offset", std::move(offsets)}};
}

json chat_logprobs(const ChoiceText& choice) {
  if (!choice.has_logprobs) return nullptr;
  json content = json::array();
  for (const LogprobEntry& entry : choice.logprobs) {
    json top = json::array();
    for (const TokenAlternative& alternative : entry.top) {
      top.push_back({{"token", alternative.token},
                     {"logprob", finite_logprob(alternative.logprob)},
                     {"bytes", byte_values(alternative.bytes)}});
    }
    content.push_back({{"token", entry.chosen.token},
                       {"logprob", finite_logprob(entry.chosen.logprob)},
                       {"bytes", byte_values(entry.chosen.bytes)},
                       {"top_logprobs", std::move(top)}});
  }
  return json{{"content", std::move(content)}, {"refusal", nullptr}};
}

json finish_reason_value(const ChoiceText& choice) {
  return choice.finish_reason.empty() ? json(nullptr) : json(choice.finish_reason);
}

json usage_value(const Usage& usage) {
  return json{{"prompt_tokens", usage.prompt_tokens},
              {"completion_tokens", usage.completion_tokens},
              {"total_tokens", usage.prompt_tokens + usage.completion_tokens}};
}

json envelope(const ResponseMeta& meta, const char* object) {
  return json{{"id", meta.id}, {"object", object}, {"created", meta.created}, {"model", meta.model}};
}

}  // namespace

json completion_response(const ResponseMeta& meta, const std::vector<ChoiceText>& choices, const Usage& usage) {
  json response = envelope(meta, "text_completion");
  json list = json::array();
  for (const ChoiceText& choice : choices) {
    json entry = {{"index", choice.index},
                  {"text", choice.text},
                  {"logprobs", completion_logprobs(choice)},
                  {"finish_reason", finish_reason_value(choice)}};
    if (choice.has_token_ids) {
      entry["prompt_token_ids"] = choice.prompt_token_ids;
      entry["token_ids"] = choice.token_ids;
    }
    list.push_back(std::move(entry));
  }
  response["choices"] = std::move(list);
  response["usage"] = usage_value(usage);
  return response;
}

namespace {

json chat_message(const ChoiceText& choice) {
  // With tool calls and no text, content is null (as OpenAI answers).
  json content = choice.text.empty() && !choice.tool_calls.empty() ? json(nullptr) : json(choice.text);
  json message = {{"role", "assistant"}, {"content", std::move(content)}};
  if (!choice.reasoning.empty()) {
    message["reasoning_content"] = choice.reasoning;
    message["reasoning"] = choice.reasoning;
  }
  if (!choice.tool_calls.empty()) {
    json calls = json::array();
    for (const ToolCallDelta& call : choice.tool_calls) {
      calls.push_back({{"id", call.id},
                       {"type", "function"},
                       {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
    }
    message["tool_calls"] = std::move(calls);
  }
  return message;
}

// A streamed piece of a call: the first carries id, type and name; later ones only arguments text.
json tool_call_delta(const ToolCallDelta& call) {
  json piece = {{"index", call.index}};
  json function = json::object();
  if (!call.id.empty()) {
    piece["id"] = call.id;
    piece["type"] = "function";
    function["name"] = call.name;
  }
  function["arguments"] = call.arguments;
  piece["function"] = std::move(function);
  return piece;
}

}  // namespace

json chat_response(const ResponseMeta& meta, const std::vector<ChoiceText>& choices, const Usage& usage) {
  json response = envelope(meta, "chat.completion");
  json list = json::array();
  for (const ChoiceText& choice : choices) {
    json entry = {{"index", choice.index},
                  {"message", chat_message(choice)},
                  {"logprobs", chat_logprobs(choice)},
                  {"finish_reason", finish_reason_value(choice)}};
    if (choice.has_token_ids) entry["token_ids"] = choice.token_ids;
    list.push_back(std::move(entry));
  }
  // Every choice of a chat request has the same prompt: its ids once, at the top (as vLLM).
  if (!choices.empty() && choices.front().has_token_ids)
    response["prompt_token_ids"] = choices.front().prompt_token_ids;
  response["choices"] = std::move(list);
  response["usage"] = usage_value(usage);
  return response;
}

json completion_chunk(const ResponseMeta& meta, const ChoiceText& delta, bool usage_field) {
  json chunk = envelope(meta, "text_completion");
  json entry = {{"index", delta.index},
                {"text", delta.text},
                {"logprobs", completion_logprobs(delta)},
                {"finish_reason", finish_reason_value(delta)}};
  if (delta.has_token_ids) {
    if (!delta.prompt_token_ids.empty()) entry["prompt_token_ids"] = delta.prompt_token_ids;
    entry["token_ids"] = delta.token_ids;
  }
  chunk["choices"] = json::array({std::move(entry)});
  if (usage_field) chunk["usage"] = nullptr;
  return chunk;
}

json chat_chunk(const ResponseMeta& meta, const ChoiceText& delta, bool usage_field) {
  json chunk = envelope(meta, "chat.completion.chunk");
  json message = json::object();
  if (delta.first) message["role"] = "assistant";
  if (!delta.text.empty() || delta.first) message["content"] = delta.text;
  if (!delta.reasoning.empty()) {
    message["reasoning_content"] = delta.reasoning;
    message["reasoning"] = delta.reasoning;
  }
  if (!delta.tool_calls.empty()) {
    json calls = json::array();
    for (const ToolCallDelta& call : delta.tool_calls) calls.push_back(tool_call_delta(call));
    message["tool_calls"] = std::move(calls);
  }
  json entry = {{"index", delta.index},
                {"delta", std::move(message)},
                {"logprobs", chat_logprobs(delta)},
                {"finish_reason", finish_reason_value(delta)}};
  if (delta.has_token_ids) {
    if (!delta.prompt_token_ids.empty()) chunk["prompt_token_ids"] = delta.prompt_token_ids;
    entry["token_ids"] = delta.token_ids;
  }
  chunk["choices"] = json::array({std::move(entry)});
  if (usage_field) chunk["usage"] = nullptr;
  return chunk;
}

json usage_chunk(const ResponseMeta& meta, bool chat, const Usage& usage) {
  json chunk = envelope(meta, chat ? "chat.completion.chunk" : "text_completion");
  chunk["choices"] = json::array();
  chunk["usage"] = usage_value(usage);
  return chunk;
}

json models_response(const std::string& model, int64_t created, int64_t max_model_len) {
  json entry = {{"id", model},
                {"object", "model"},
                {"created", created},
                {"owned_by", "metrale"},
                {"root", model},
                {"parent", nullptr},
                {"max_model_len", max_model_len}};
  return json{{"object", "list"}, {"data", json::array({std::move(entry)})}};
}

std::string dump_json(const json& value) { return value.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string sse_event(const json& data) { return "data: " + dump_json(data) + "\n\n"; }

std::string sse_done() { return "data: [DONE]\n\n"; }

std::string make_response_id(std::string_view prefix) {
  thread_local std::mt19937_64 generator{std::random_device{}()};
  return fmt::format("{}{:016x}{:08x}", prefix, generator(), static_cast<uint32_t>(generator()));
}

}  // namespace metrale::server
