#include "server/structured_output.h"

#include <fmt/format.h>

#include "core/error.h"
#include "text/grammar/json_schema.h"
#include "text/grammar/tool_call_grammar.h"

namespace metrale::server {

using json = nlohmann::ordered_json;

namespace {

bool forces_tool_call(const ToolChoice& choice) {
  return choice.mode == ToolChoiceMode::kRequired || choice.mode == ToolChoiceMode::kFunction;
}

}  // namespace

StructuredOutputs::StructuredOutputs(Tokenizer tokenizer, int64_t vocab_size, std::vector<int32_t> stop_token_ids,
                                     std::optional<ToolCallFormat> tool_format)
    : tokenizer_(std::move(tokenizer)),
      vocab_size_(vocab_size),
      stop_token_ids_(std::move(stop_token_ids)),
      tool_format_(tool_format) {}

const std::shared_ptr<const grammar::TokenizerInfo>& StructuredOutputs::tokenizer_info() {
  // Built on first use (a walk of the whole vocabulary): servers that never constrain pay nothing.
  std::call_once(info_once_, [&] {
    info_ = grammar::TokenizerInfo::from_tokenizer(tokenizer_, std::max<int64_t>(vocab_size_, tokenizer_.vocab_size()));
  });
  return info_;
}

const std::shared_ptr<const ConstraintVocabulary>& StructuredOutputs::vocabulary() {
  std::call_once(vocabulary_once_, [&] {
    auto vocabulary = std::make_shared<ConstraintVocabulary>();
    const auto single_token = [&](std::string_view text) -> std::optional<int32_t> {
      const std::vector<int32_t> ids = tokenizer_.encode(text, /*add_special_tokens=*/false);
      if (ids.size() == 1) return ids[0];
      return std::nullopt;
    };
    vocabulary->think_open = single_token("<think>");
    vocabulary->think_close = single_token("</think>");
    const int64_t known = std::min<int64_t>(tokenizer_.vocab_size(), vocab_size_);
    vocabulary->first_byte.assign(static_cast<size_t>(known), ConstraintVocabulary::kNoFirstByte);
    for (int64_t id = 0; id < known; ++id) {
      const auto token = static_cast<int32_t>(id);
      if (tokenizer_.is_special(token)) continue;
      const std::string_view bytes = tokenizer_.token_bytes(token);
      if (bytes.empty()) continue;
      vocabulary->first_byte[static_cast<size_t>(id)] = static_cast<uint8_t>(bytes[0]);
      if (bytes.size() == 1) vocabulary->byte_tokens.push_back(token);
    }
    vocabulary->stop_token_ids = stop_token_ids_;
    if (vocabulary->stop_token_ids.empty()) {
      if (auto eos = tokenizer_.eos_token_id()) vocabulary->stop_token_ids.push_back(*eos);
    }
    vocabulary_ = std::move(vocabulary);
  });
  return vocabulary_;
}

std::shared_ptr<const grammar::CompiledGrammar> StructuredOutputs::grammar_for(const OutputConstraintSpec& spec) {
  const bool tool_call = forces_tool_call(spec.tool_choice);
  if (!tool_call && spec.response_format.type == ResponseFormatType::kText) return nullptr;
  const char* param = tool_call ? "tool_choice" : "response_format";
  if (tool_call && !tool_format_) {
    throw invalid_request(
        "this model has no known tool-call format, so tool_choice \"required\" or a named function cannot be "
        "enforced; start the server with --tool-call-parser NAME",
        param);
  }
  // The grammar's identity: what it is built from.
  std::string key;
  if (tool_call) {
    json tools = json::array();
    for (const ToolDefinition& tool : spec.tools) tools.push_back({tool.name, tool.parameters});
    key = fmt::format("tools|{}|{}|{}|{}", tool_call_format_name(*tool_format_), spec.tool_choice.function,
                      spec.parallel_tool_calls, dump_json(tools));
  } else if (spec.response_format.type == ResponseFormatType::kJsonObject) {
    key = "json_object";
  } else {
    key = "json_schema|" + dump_json(spec.response_format.schema);
  }
  {
    std::lock_guard lock(cache_mutex_);
    if (auto found = cache_index_.find(key); found != cache_index_.end()) {
      cache_.splice(cache_.begin(), cache_, found->second);
      return found->second->second;
    }
  }
  std::shared_ptr<const grammar::CompiledGrammar> compiled;
  try {
    grammar::Grammar built;
    if (tool_call) {
      grammar::ToolCallGrammarOptions options;
      if (spec.tool_choice.mode == ToolChoiceMode::kFunction) options.function = spec.tool_choice.function;
      options.parallel = spec.parallel_tool_calls;
      built = grammar::tool_call_grammar(*tool_format_, spec.tools, options);
    } else if (spec.response_format.type == ResponseFormatType::kJsonObject) {
      built = grammar::json_object_grammar();
    } else {
      built = grammar::json_schema_grammar(spec.response_format.schema);
    }
    compiled = grammar::compile_grammar(built, tokenizer_info());
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kUnsupported || e.code() == ErrorCode::kInvalidArgument) {
      throw invalid_request(fmt::format("{}: {}", tool_call ? "tools" : "response_format.json_schema.schema", e.what()),
                            tool_call ? "tools" : "response_format");
    }
    throw;
  }
  std::lock_guard lock(cache_mutex_);
  if (cache_index_.find(key) == cache_index_.end()) {
    cache_.emplace_front(key, compiled);
    cache_index_[key] = cache_.begin();
    if (cache_.size() > kMaxCached) {
      cache_index_.erase(cache_.back().first);
      cache_.pop_back();
    }
  }
  return compiled;
}

std::shared_ptr<TokenConstraint> StructuredOutputs::constraint(std::shared_ptr<const grammar::CompiledGrammar> grammar,
                                                               const GrammarConstraintOptions& options) {
  return std::make_shared<GrammarConstraint>(std::move(grammar), vocabulary(), options);
}

}  // namespace metrale::server
