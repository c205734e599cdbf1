#include "server/response_events.h"

#include <fmt/format.h>

#include <ctime>

namespace metrale::server {

using json = nlohmann::ordered_json;

namespace {

json or_null(const std::optional<std::string>& value) {
  return value ? json(*value) : json(nullptr);
}

bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

json usage_object(const ResponseUsage& usage) {
  return json{{"input_tokens", usage.input_tokens},
              {"input_tokens_details", {{"cached_tokens", 0}}},
              {"output_tokens", usage.output_tokens},
              {"output_tokens_details", {{"reasoning_tokens", usage.reasoning_tokens}}},
              {"total_tokens", usage.input_tokens + usage.output_tokens}};
}

json text_part(const char* type, const std::string& text) {
  json part = {{"type", type}};
  if (std::string_view(type) == "output_text") {
    part["annotations"] = json::array();
    part["logprobs"] = json::array();
  }
  part["text"] = text;
  return part;
}

}  // namespace

json response_object(const ResponseIdentity& identity, const ResponsesRequest& request) {
  json text = request.text.is_object() ? request.text : json::object();
  if (!text.contains("format") || text["format"].is_null()) text["format"] = {{"type", "text"}};
  if (!text.contains("verbosity") || text["verbosity"].is_null()) text["verbosity"] = "medium";
  json reasoning = {{"effort", nullptr}, {"summary", nullptr}};
  if (request.reasoning.is_object()) {
    for (const auto& [key, value] : request.reasoning.items()) reasoning[key] = value;
  }
  return json{
      {"id", identity.id},
      {"object", "response"},
      {"created_at", identity.created_at},
      {"status", "in_progress"},
      {"background", false},
      {"error", nullptr},
      {"incomplete_details", nullptr},
      {"instructions", or_null(request.instructions)},
      {"max_output_tokens", request.params.max_tokens ? json(*request.params.max_tokens) : json(nullptr)},
      {"max_tool_calls", nullptr},
      {"model", identity.model},
      {"output", json::array()},
      {"parallel_tool_calls", request.parallel_tool_calls},
      {"previous_response_id", or_null(request.previous_response_id)},
      {"prompt_cache_key", or_null(request.prompt_cache_key)},
      {"reasoning", std::move(reasoning)},
      {"safety_identifier", or_null(request.safety_identifier)},
      {"service_tier", request.service_tier.value_or("default")},
      {"store", request.store},
      // As sent; else the server's default (the model's generation_config).
      {"temperature", request.temperature.value_or(request.params.sampling.temperature)},
      {"text", std::move(text)},
      {"tool_choice", request.tool_choice_json},
      {"tools", request.tools},
      {"top_logprobs", 0},
      {"top_p", request.top_p.value_or(request.params.sampling.top_p)},
      {"truncation", "disabled"},
      {"usage", nullptr},
      {"user", or_null(request.user)},
      {"metadata", request.metadata},
  };
}

ResponseEventBuilder::ResponseEventBuilder(json base, std::optional<ToolCallFormat> tool_format,
                                           std::vector<ToolDefinition> tools, ToolCallParserOptions parser)
    : response_(std::move(base)) {
  if (tool_format) tool_parser_.emplace(*tool_format, std::move(tools), parser);
  const std::string id = response_["id"].get<std::string>();
  const size_t underscore = id.find('_');
  id_stem_ = underscore == std::string::npos ? id : id.substr(underscore + 1);
}

json ResponseEventBuilder::event(const char* type, json fields) {
  json event = {{"type", type}, {"sequence_number", sequence_++}};
  for (auto& [key, value] : fields.items()) event[key] = std::move(value);
  return event;
}

std::string ResponseEventBuilder::item_id(const char* prefix) {
  return fmt::format("{}_{}{:04x}", prefix, id_stem_, items_made_++);
}

std::vector<json> ResponseEventBuilder::start() {
  std::vector<json> events;
  events.push_back(event("response.created", {{"response", response_}}));
  events.push_back(event("response.in_progress", {{"response", response_}}));
  return events;
}

void ResponseEventBuilder::open_item(json item, Open kind, std::vector<json>& events) {
  close_item(events);
  open_ = kind;
  item_ = std::move(item);
  text_.clear();
  const size_t index = response_["output"].size();
  events.push_back(event("response.output_item.added", {{"output_index", index}, {"item", item_}}));
  if (kind == Open::kReasoning || kind == Open::kMessage) {
    const char* part_type = kind == Open::kReasoning ? "reasoning_text" : "output_text";
    events.push_back(event(
        "response.content_part.added",
        {{"item_id", item_["id"]}, {"output_index", index}, {"content_index", 0}, {"part", text_part(part_type, "")}}));
  }
}

void ResponseEventBuilder::close_item(std::vector<json>& events, const char* status) {
  if (open_ == Open::kNone) return;
  const size_t index = response_["output"].size();
  const json id = item_["id"];
  if (open_ == Open::kReasoning || open_ == Open::kMessage) {
    const bool reasoning = open_ == Open::kReasoning;
    const char* part_type = reasoning ? "reasoning_text" : "output_text";
    json done = {{"item_id", id}, {"output_index", index}, {"content_index", 0}, {"text", text_}};
    if (!reasoning) done["logprobs"] = json::array();
    events.push_back(event(reasoning ? "response.reasoning_text.done" : "response.output_text.done", std::move(done)));
    json part = text_part(part_type, text_);
    events.push_back(event("response.content_part.done",
                           {{"item_id", id}, {"output_index", index}, {"content_index", 0}, {"part", part}}));
    item_["content"] = json::array({std::move(part)});
  } else {
    events.push_back(event("response.function_call_arguments.done",
                           {{"item_id", id}, {"output_index", index}, {"name", item_["name"]}, {"arguments", text_}}));
    item_["arguments"] = text_;
  }
  item_["status"] = status;
  events.push_back(event("response.output_item.done", {{"output_index", index}, {"item", item_}}));
  response_["output"].push_back(std::move(item_));
  item_ = nullptr;
  open_ = Open::kNone;
  open_call_index_ = -1;
}

void ResponseEventBuilder::add_reasoning(const std::string& text, std::vector<json>& events) {
  if (text.empty()) return;
  if (open_ != Open::kReasoning) {
    open_item({{"id", item_id("rs")},
               {"type", "reasoning"},
               {"status", "in_progress"},
               {"summary", json::array()},
               {"content", json::array()}},
              Open::kReasoning, events);
  }
  text_ += text;
  events.push_back(event(
      "response.reasoning_text.delta",
      {{"item_id", item_["id"]}, {"output_index", response_["output"].size()}, {"content_index", 0}, {"delta", text}}));
}

void ResponseEventBuilder::add_text(std::string text, std::vector<json>& events) {
  if (open_ != Open::kMessage) {
    size_t first = 0;
    while (first < text.size() && is_space(text[first])) ++first;
    text.erase(0, first);
    if (text.empty()) return;
    open_item({{"id", item_id("msg")},
               {"type", "message"},
               {"status", "in_progress"},
               {"content", json::array()},
               {"role", "assistant"}},
              Open::kMessage, events);
  }
  if (text.empty()) return;
  text_ += text;
  events.push_back(event("response.output_text.delta", {{"item_id", item_["id"]},
                                                        {"output_index", response_["output"].size()},
                                                        {"content_index", 0},
                                                        {"delta", text},
                                                        {"logprobs", json::array()}}));
}

void ResponseEventBuilder::add_call_piece(const ToolCallDelta& piece, std::vector<json>& events) {
  if (open_ != Open::kFunctionCall || piece.index != open_call_index_) {
    open_item({{"id", item_id("fc")},
               {"type", "function_call"},
               {"status", "in_progress"},
               {"arguments", ""},
               {"call_id", piece.id},
               {"name", piece.name}},
              Open::kFunctionCall, events);
    open_call_index_ = piece.index;
  }
  if (piece.arguments.empty()) return;
  text_ += piece.arguments;
  events.push_back(
      event("response.function_call_arguments.delta",
            {{"item_id", item_["id"]}, {"output_index", response_["output"].size()}, {"delta", piece.arguments}}));
}

void ResponseEventBuilder::add_tool_calls(const ToolParseDelta& delta, std::vector<json>& events) {
  add_text(delta.content, events);
  for (const ToolCallDelta& piece : delta.tool_calls) add_call_piece(piece, events);
}

std::vector<json> ResponseEventBuilder::feed(const std::string& reasoning, const std::string& content) {
  std::vector<json> events;
  if (finished_) return events;
  add_reasoning(reasoning, events);
  if (content.empty()) return events;
  if (tool_parser_) {
    add_tool_calls(tool_parser_->feed(content), events);
  } else {
    add_text(content, events);
  }
  return events;
}

std::vector<json> ResponseEventBuilder::finish(const std::string& finish_reason, const ResponseUsage& usage) {
  std::vector<json> events;
  if (finished_) return events;
  if (tool_parser_) add_tool_calls(tool_parser_->finish(), events);
  close_item(events, finish_reason == "stop" ? "completed" : "incomplete");
  finished_ = true;
  response_["usage"] = usage_object(usage);
  const char* type = "response.completed";
  if (finish_reason == "stop") {
    response_["status"] = "completed";
    response_["completed_at"] = static_cast<int64_t>(std::time(nullptr));
  } else if (finish_reason == "length") {
    response_["status"] = "incomplete";
    response_["incomplete_details"] = {{"reason", "max_output_tokens"}};
    type = "response.incomplete";
  } else {
    response_["status"] = "failed";
    const bool aborted = finish_reason == "abort";
    response_["error"] = {{"code", "server_error"},
                          {"message", aborted ? "the generation was aborted (the server is shutting down)"
                                              : "the engine failed while running this response (the server log has "
                                                "the details)"}};
    type = "response.failed";
  }
  events.push_back(event(type, {{"response", response_}}));
  return events;
}

}  // namespace metrale::server
