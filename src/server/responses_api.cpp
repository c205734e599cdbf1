#include "server/responses_api.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <set>
#include <string_view>

#include "server/request_fields.h"

namespace metrale::server {

using json = nlohmann::ordered_json;

namespace {

using request_fields::field;
using request_fields::get_bool;
using request_fields::get_integer;
using request_fields::get_number;
using request_fields::get_string;
using request_fields::wrong_type;

ApiError unsupported(const std::string& key, const std::string& what) {
  return invalid_request(fmt::format("'{}': {} is not supported by this server", key, what), key);
}

std::string required_string(const json& object, const std::string& key, const std::string& param) {
  std::optional<std::string> value = get_string(object, key, param);
  if (!value) throw invalid_request(fmt::format("'{}' is required", param), param);
  return *value;
}

// Fields of the Responses API this server does not implement: present with a value other than the
// default, they are a 400 naming them.
void refuse_unsupported_fields(const json& body) {
  if (get_bool(body, "background").value_or(false)) throw unsupported("background", "background mode");
  for (const char* key : {"conversation", "prompt", "context_management", "max_tool_calls"}) {
    if (field(body, key) != nullptr) throw unsupported(key, fmt::format("'{}'", key));
  }
  if (const json* include = field(body, "include")) {
    if (!include->is_array()) throw wrong_type("include", "a list of strings", *include);
    if (!include->empty()) {
      throw unsupported("include",
                        fmt::format("including {}", (*include)[0].is_string() ? (*include)[0].get<std::string>()
                                                                              : std::string("extra output data")));
    }
  }
  if (auto truncation = get_string(body, "truncation", "truncation"); truncation && *truncation != "disabled")
    throw unsupported("truncation", fmt::format("truncation \"{}\"", *truncation));
  if (auto top = get_integer(body, "top_logprobs"); top && *top != 0) throw unsupported("top_logprobs", "top_logprobs");
  // Chat-completions fields sent here by mistake: say which API they belong to.
  for (const char* key : {"messages", "max_tokens", "max_completion_tokens", "response_format", "n"}) {
    if (field(body, key) != nullptr) {
      throw invalid_request(fmt::format("'{}' is a /v1/chat/completions field; /v1/responses takes input, "
                                        "max_output_tokens and text.format",
                                        key),
                            key);
    }
  }
}

// The text of content parts of the given types (input_text, output_text, reasoning_text, ...).
std::string join_text_parts(const json& parts, const std::string& param,
                            std::initializer_list<std::string_view> types) {
  std::string text;
  for (size_t j = 0; j < parts.size(); ++j) {
    const json& part = parts[j];
    const std::string part_param = fmt::format("{}[{}]", param, j);
    if (!part.is_object()) throw wrong_type(part_param, "an object", part);
    const std::string type = required_string(part, "type", part_param + ".type");
    bool known = false;
    for (const std::string_view allowed : types) known = known || type == allowed;
    if (!known) {
      if (type == "input_image" || type == "input_file" || type == "input_audio")
        throw unsupported(part_param, fmt::format("a content part of type \"{}\"", type));
      throw invalid_request(fmt::format("'{}.type' \"{}\" is not a content part this item may hold", part_param, type),
                            part_param + ".type");
    }
    if (type == "refusal") {
      text += required_string(part, "refusal", part_param + ".refusal");
    } else {
      text += required_string(part, "text", part_param + ".text");
    }
  }
  return text;
}

json normalize_message(const json& item, const std::string& param) {
  const std::string role = required_string(item, "role", param + ".role");
  if (role != "user" && role != "assistant" && role != "system" && role != "developer")
    throw invalid_request(
        fmt::format("'{}.role' must be user, assistant, system or developer, got \"{}\"", param, role),
        param + ".role");
  const json* content = field(item, "content");
  if (content == nullptr) throw invalid_request(fmt::format("'{}.content' is required", param), param + ".content");
  const bool assistant = role == "assistant";
  const char* text_type = assistant ? "output_text" : "input_text";
  json parts = json::array();
  if (content->is_string()) {
    json part = {{"type", text_type}, {"text", content->get<std::string>()}};
    if (assistant) part["annotations"] = json::array();
    parts.push_back(std::move(part));
  } else if (content->is_array()) {
    // Validates the parts (text kinds only); kept as sent.
    (void)join_text_parts(*content, param + ".content", {"input_text", "output_text", "text", "refusal"});
    parts = *content;
  } else {
    throw wrong_type(param + ".content", "a string or a list of content parts", *content);
  }
  json normalized = {{"type", "message"}, {"role", role}, {"content", std::move(parts)}};
  if (auto id = get_string(item, "id", param + ".id")) normalized["id"] = *id;
  return normalized;
}

json normalize_item(const json& item, const std::string& param) {
  if (!item.is_object()) throw wrong_type(param, "an object", item);
  // Messages may omit their type (EasyInputMessage).
  const std::string type = get_string(item, "type", param + ".type").value_or("message");
  if (type == "message") return normalize_message(item, param);
  if (type == "function_call") {
    json call = {{"type", "function_call"},
                 {"call_id", required_string(item, "call_id", param + ".call_id")},
                 {"name", required_string(item, "name", param + ".name")},
                 {"arguments", required_string(item, "arguments", param + ".arguments")}};
    if (auto id = get_string(item, "id", param + ".id")) call["id"] = *id;
    return call;
  }
  if (type == "function_call_output") {
    const std::string call_id = required_string(item, "call_id", param + ".call_id");
    const json* output = field(item, "output");
    if (output == nullptr) throw invalid_request(fmt::format("'{}.output' is required", param), param + ".output");
    std::string text;
    if (output->is_string()) {
      text = output->get<std::string>();
    } else if (output->is_array()) {
      text = join_text_parts(*output, param + ".output", {"input_text", "output_text", "text"});
    } else {
      throw wrong_type(param + ".output", "a string or a list of content parts", *output);
    }
    json result = {{"type", "function_call_output"}, {"call_id", call_id}, {"output", std::move(text)}};
    if (auto id = get_string(item, "id", param + ".id")) result["id"] = *id;
    return result;
  }
  if (type == "reasoning") {
    std::string text;
    if (const json* content = field(item, "content"); content != nullptr && content->is_array() && !content->empty()) {
      text = join_text_parts(*content, param + ".content", {"reasoning_text"});
    } else if (const json* summary = field(item, "summary"); summary != nullptr) {
      if (!summary->is_array()) throw wrong_type(param + ".summary", "a list of summary parts", *summary);
      text = join_text_parts(*summary, param + ".summary", {"summary_text"});
    }
    json reasoning = {{"type", "reasoning"},
                      {"summary", json::array()},
                      {"content", json::array({json{{"type", "reasoning_text"}, {"text", std::move(text)}}})}};
    if (auto id = get_string(item, "id", param + ".id")) reasoning["id"] = *id;
    return reasoning;
  }
  if (type == "item_reference") throw unsupported(param, "an item_reference (send the item itself)");
  throw unsupported(param + ".type", fmt::format("an input item of type \"{}\"", type));
}

json normalize_input(const json& body, const ProtocolLimits& limits) {
  const json* input = field(body, "input");
  if (input == nullptr) throw invalid_request("'input' is required", "input");
  if (input->is_string()) {
    return json::array(
        {json{{"type", "message"},
              {"role", "user"},
              {"content", json::array({json{{"type", "input_text"}, {"text", input->get<std::string>()}}})}}});
  }
  if (!input->is_array()) throw wrong_type("input", "a string or a list of items", *input);
  if (input->size() > limits.max_messages)
    throw invalid_request(fmt::format("'input' may hold at most {} items", limits.max_messages), "input");
  json items = json::array();
  for (size_t i = 0; i < input->size(); ++i) items.push_back(normalize_item((*input)[i], fmt::format("input[{}]", i)));
  return items;
}

json parse_tools(const json& body, const ProtocolLimits& limits) {
  json tools = json::array();
  const json* list = field(body, "tools");
  if (list == nullptr) return tools;
  if (!list->is_array()) throw wrong_type("tools", "a list of tools", *list);
  if (list->size() > limits.max_tools)
    throw invalid_request(fmt::format("'tools' may hold at most {} tools", limits.max_tools), "tools");
  std::set<std::string> names;
  for (size_t i = 0; i < list->size(); ++i) {
    const json& tool = (*list)[i];
    const std::string param = fmt::format("tools[{}]", i);
    if (!tool.is_object()) throw wrong_type(param, "an object", tool);
    const std::string type = required_string(tool, "type", param + ".type");
    if (type != "function") throw unsupported(param + ".type", fmt::format("the built-in tool \"{}\"", type));
    const std::string name = required_string(tool, "name", param + ".name");
    if (name.empty()) throw invalid_request(fmt::format("'{}.name' must not be empty", param), param + ".name");
    if (!names.insert(name).second)
      throw invalid_request(fmt::format("'{}.name': the function '{}' is declared twice", param, name),
                            param + ".name");
    json entry = {{"type", "function"}, {"name", name}};
    if (auto description = get_string(tool, "description", param + ".description")) entry["description"] = *description;
    const json* parameters = field(tool, "parameters");
    if (parameters != nullptr && !parameters->is_object())
      throw wrong_type(param + ".parameters", "a JSON schema object", *parameters);
    entry["parameters"] = parameters != nullptr ? *parameters : json::object();
    const json* strict = field(tool, "strict");
    if (strict != nullptr && !strict->is_boolean()) throw wrong_type(param + ".strict", "a boolean", *strict);
    entry["strict"] = strict != nullptr ? strict->get<bool>() : true;
    tools.push_back(std::move(entry));
  }
  return tools;
}

ResponseToolChoice parse_tool_choice(const json& value, const json& tools) {
  ResponseToolChoice choice;
  if (value.is_string()) {
    const std::string mode = value.get<std::string>();
    if (mode == "auto") return choice;
    if (mode == "none")
      choice.mode = ResponseToolChoice::Mode::kNone;
    else if (mode == "required")
      choice.mode = ResponseToolChoice::Mode::kRequired;
    else
      throw invalid_request(fmt::format("'tool_choice' must be auto, none, required or a function, got \"{}\"", mode),
                            "tool_choice");
    if (choice.mode == ResponseToolChoice::Mode::kRequired && tools.empty())
      throw invalid_request("'tool_choice' \"required\" needs at least one function in 'tools'", "tool_choice");
    return choice;
  }
  if (!value.is_object()) throw wrong_type("tool_choice", "a string or an object", value);
  const std::string type = required_string(value, "type", "tool_choice.type");
  if (type != "function") throw unsupported("tool_choice.type", fmt::format("tool_choice of type \"{}\"", type));
  choice.mode = ResponseToolChoice::Mode::kFunction;
  choice.function = required_string(value, "name", "tool_choice.name");
  bool declared = false;
  for (const json& tool : tools) declared = declared || tool["name"] == choice.function;
  if (!declared)
    throw invalid_request(
        fmt::format("'tool_choice' names the function '{}', which 'tools' does not declare", choice.function),
        "tool_choice.name");
  return choice;
}

ResponseTextFormat parse_text_format(const json& text) {
  ResponseTextFormat format;
  const json* value = field(text, "format");
  if (value == nullptr) return format;
  if (!value->is_object()) throw wrong_type("text.format", "an object", *value);
  const std::string type = required_string(*value, "type", "text.format.type");
  if (type == "text") return format;
  if (type == "json_object") {
    format.kind = ResponseTextFormat::Kind::kJsonObject;
    return format;
  }
  if (type != "json_schema")
    throw invalid_request(fmt::format("'text.format.type' must be text, json_object or json_schema, got \"{}\"", type),
                          "text.format.type");
  format.kind = ResponseTextFormat::Kind::kJsonSchema;
  format.name = required_string(*value, "name", "text.format.name");
  format.description = get_string(*value, "description", "text.format.description").value_or("");
  const json* schema = field(*value, "schema");
  if (schema == nullptr) throw invalid_request("'text.format.schema' is required", "text.format.schema");
  if (!schema->is_object()) throw wrong_type("text.format.schema", "a JSON schema object", *schema);
  format.schema = *schema;
  const json* strict = field(*value, "strict");
  if (strict != nullptr && !strict->is_boolean()) throw wrong_type("text.format.strict", "a boolean", *strict);
  format.strict = strict != nullptr && strict->get<bool>();
  return format;
}

// `stop`, a metrale extension (not in the OpenAI Responses API): strings that end the output, as on
// /v1/chat/completions (the output ends before them, status "completed").
void parse_stop(const json& body, const ProtocolLimits& limits, std::vector<std::string>& stop) {
  const json* value = field(body, "stop");
  if (value == nullptr) return;
  if (value->is_string()) {
    stop.push_back(value->get<std::string>());
  } else if (value->is_array()) {
    for (const json& item : *value) {
      if (!item.is_string()) throw wrong_type("stop", "a string or a list of strings", item);
      stop.push_back(item.get<std::string>());
    }
  } else {
    throw wrong_type("stop", "a string or a list of strings", *value);
  }
  if (static_cast<int32_t>(stop.size()) > limits.max_stop_strings)
    throw invalid_request(fmt::format("'stop' may hold at most {} strings", limits.max_stop_strings), "stop");
  for (const std::string& text : stop) {
    if (text.empty()) throw invalid_request("'stop' strings must not be empty", "stop");
    if (text.size() > limits.max_stop_bytes)
      throw invalid_request(fmt::format("'stop' strings may be at most {} bytes long", limits.max_stop_bytes), "stop");
  }
}

void parse_sampling(const json& body, ResponsesRequest& request) {
  SamplingParams& sampling = request.params.sampling;
  if (auto value = get_number(body, "temperature")) {
    if (!(std::isfinite(*value) && *value >= 0.0 && *value <= 2.0))
      throw invalid_request(fmt::format("'temperature' must be in [0, 2], got {}", *value), "temperature");
    sampling.temperature = static_cast<float>(*value);
    request.temperature = *value;
  }
  if (auto value = get_number(body, "top_p")) {
    if (!(*value > 0.0 && *value <= 1.0))
      throw invalid_request(fmt::format("'top_p' must be in (0, 1], got {}", *value), "top_p");
    sampling.top_p = static_cast<float>(*value);
    request.top_p = *value;
  }
  if (auto value = get_integer(body, "max_output_tokens")) {
    if (*value < 1)
      throw invalid_request(fmt::format("'max_output_tokens' must be at least 1, got {}", *value), "max_output_tokens");
    request.params.max_tokens = *value;
  }
}

}  // namespace

ResponsesRequest parse_responses_request(const json& body, const SamplingParams& defaults,
                                         const ProtocolLimits& limits) {
  refuse_unsupported_fields(body);
  ResponsesRequest request;
  request.params.sampling = defaults;
  request.params.sampling.seed.reset();
  request.params.sampling.top_logprobs = 0;
  if (auto model = get_string(body, "model", "model")) request.params.model = *model;
  if (auto stream = get_bool(body, "stream")) request.params.stream = *stream;
  parse_sampling(body, request);
  parse_stop(body, limits, request.params.stop);

  request.instructions = get_string(body, "instructions", "instructions");
  request.input_items = normalize_input(body, limits);
  request.tools = parse_tools(body, limits);
  if (const json* choice = field(body, "tool_choice")) {
    request.tool_choice = parse_tool_choice(*choice, request.tools);
    request.tool_choice_json = *choice;
  }
  if (const json* text = field(body, "text")) {
    if (!text->is_object()) throw wrong_type("text", "an object", *text);
    request.text_format = parse_text_format(*text);
    request.text = *text;
  }
  if (const json* reasoning = field(body, "reasoning")) {
    if (!reasoning->is_object()) throw wrong_type("reasoning", "an object", *reasoning);
    request.reasoning = *reasoning;
  }
  request.previous_response_id = get_string(body, "previous_response_id", "previous_response_id");
  if (auto store = get_bool(body, "store")) request.store = *store;
  if (auto parallel = get_bool(body, "parallel_tool_calls")) request.parallel_tool_calls = *parallel;
  if (const json* metadata = field(body, "metadata")) {
    if (!metadata->is_object()) throw wrong_type("metadata", "an object of strings", *metadata);
    for (const auto& [key, value] : metadata->items()) {
      if (!value.is_string()) throw wrong_type("metadata." + key, "a string", value);
    }
    request.metadata = *metadata;
  }
  request.user = get_string(body, "user", "user");
  request.safety_identifier = get_string(body, "safety_identifier", "safety_identifier");
  request.prompt_cache_key = get_string(body, "prompt_cache_key", "prompt_cache_key");
  request.service_tier = get_string(body, "service_tier", "service_tier");
  if (const json* options = field(body, "stream_options"); options != nullptr && !options->is_object())
    throw wrong_type("stream_options", "an object", *options);
  return request;
}

json chat_tools(const json& response_tools) {
  json tools = json::array();
  for (const json& tool : response_tools) {
    json function = {{"name", tool["name"]}};
    if (tool.contains("description")) function["description"] = tool["description"];
    function["parameters"] = tool.value("parameters", json::object());
    tools.push_back({{"type", "function"}, {"function", std::move(function)}});
  }
  return tools;
}

namespace {

// Builds the chat messages item by item; assistant turns are merged as the templates expect them
// (content, reasoning_content and tool_calls on one message).
class MessageBuilder {
 public:
  void add(const json& item) {
    const std::string type = item["type"].get<std::string>();
    if (type == "message") {
      const std::string role = item["role"].get<std::string>();
      const std::string text =
          join_text_parts(item["content"], "content", {"input_text", "output_text", "text", "refusal"});
      if (role == "assistant") {
        json& message = open_assistant(/*for_content=*/true);
        message["content"] = message["content"].get<std::string>() + text;
      } else {
        close_assistant();
        messages_.push_back({{"role", role == "developer" ? "system" : role}, {"content", text}});
      }
    } else if (type == "reasoning") {
      close_assistant();
      pending_reasoning_ += item["content"][0]["text"].get<std::string>();
    } else if (type == "function_call") {
      json& message = open_assistant(/*for_content=*/false);
      if (!message.contains("tool_calls")) message["tool_calls"] = json::array();
      message["tool_calls"].push_back({{"id", item["call_id"]},
                                       {"type", "function"},
                                       {"function", {{"name", item["name"]}, {"arguments", item["arguments"]}}}});
    } else if (type == "function_call_output") {
      close_assistant();
      messages_.push_back({{"role", "tool"}, {"tool_call_id", item["call_id"]}, {"content", item["output"]}});
    }
  }

  json take() {
    close_assistant();
    if (!pending_reasoning_.empty()) {
      // Reasoning with no answer after it: an assistant turn of reasoning alone.
      messages_.push_back({{"role", "assistant"}, {"content", ""}, {"reasoning_content", pending_reasoning_}});
      pending_reasoning_.clear();
    }
    return std::move(messages_);
  }

 private:
  // The assistant message the next piece belongs to: the open one, unless content follows its
  // tool calls (a new turn).
  json& open_assistant(bool for_content) {
    if (assistant_open_ && for_content && messages_.back().contains("tool_calls")) assistant_open_ = false;
    if (!assistant_open_) {
      json message = {{"role", "assistant"}, {"content", ""}};
      if (!pending_reasoning_.empty()) message["reasoning_content"] = pending_reasoning_;
      pending_reasoning_.clear();
      messages_.push_back(std::move(message));
      assistant_open_ = true;
    }
    return messages_.back();
  }
  void close_assistant() { assistant_open_ = false; }

  json messages_ = json::array();
  std::string pending_reasoning_;
  bool assistant_open_ = false;
};

}  // namespace

ChatRequest to_chat_request(const ResponsesRequest& request, const json& history) {
  ChatRequest chat;
  chat.params = request.params;
  MessageBuilder builder;
  if (request.instructions)
    builder.add({{"type", "message"},
                 {"role", "system"},
                 {"content", json::array({json{{"type", "input_text"}, {"text", *request.instructions}}})}});
  for (const json& item : history) builder.add(item);
  for (const json& item : request.input_items) builder.add(item);
  chat.messages = builder.take();
  if (request.tool_choice.mode != ResponseToolChoice::Mode::kNone && !request.tools.empty())
    chat.tools = chat_tools(request.tools);
  // reasoning.effort "none" / "minimal": the templates' switch for thinking.
  if (request.reasoning.is_object()) {
    const json* effort = field(request.reasoning, "effort");
    if (effort != nullptr && effort->is_string() && (*effort == "none" || *effort == "minimal"))
      chat.chat_template_kwargs["enable_thinking"] = false;
  }
  return chat;
}

}  // namespace metrale::server
