// Structured outputs for the server: the grammar a request's output must follow (response_format
// json_object / json_schema, tool_choice "required" or a named function), compiled for the model's
// vocabulary and cached, and the per-choice TokenConstraint the engine applies (server/
// grammar_constraint.h).
//
// Precedence: a forced tool call (tool_choice "required" or named) decides the grammar; otherwise
// response_format does; "auto" and "none" constrain nothing. A schema outside the supported subset
// (docs/serving.md lists it) is a 400 naming the keyword and where it is.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/token_constraint.h"
#include "server/grammar_constraint.h"
#include "server/openai_protocol.h"
#include "text/grammar/compiled_grammar.h"
#include "text/grammar/tokenizer_info.h"
#include "text/tokenizer.h"
#include "text/tool_calls/tool_call_parser.h"

namespace metrale::server {

// What decides a request's grammar.
struct OutputConstraintSpec {
  ResponseFormat response_format;
  ToolChoice tool_choice;
  std::vector<ToolDefinition> tools;
  bool parallel_tool_calls = true;
};

class StructuredOutputs {
 public:
  // `vocab_size`: the width of the model's logits; `stop_token_ids`: the model's EOS ids (a
  // complete output ends with one of them).
  StructuredOutputs(Tokenizer tokenizer, int64_t vocab_size, std::vector<int32_t> stop_token_ids,
                    std::optional<ToolCallFormat> tool_format);

  // The grammar of `spec`, compiled (cached by its text), or null when the output is free.
  // Thread-safe. Throws ApiError 400 for an unsupported or malformed schema, or a forced tool call
  // on a model with no known tool-call format.
  std::shared_ptr<const grammar::CompiledGrammar> grammar_for(const OutputConstraintSpec& spec);
  // A fresh constraint of one choice.
  std::shared_ptr<TokenConstraint> constraint(std::shared_ptr<const grammar::CompiledGrammar> grammar,
                                              const GrammarConstraintOptions& options);

  std::optional<ToolCallFormat> tool_format() const { return tool_format_; }

 private:
  const std::shared_ptr<const grammar::TokenizerInfo>& tokenizer_info();
  const std::shared_ptr<const ConstraintVocabulary>& vocabulary();

  Tokenizer tokenizer_;
  int64_t vocab_size_;
  std::vector<int32_t> stop_token_ids_;
  std::optional<ToolCallFormat> tool_format_;

  std::once_flag info_once_;
  std::shared_ptr<const grammar::TokenizerInfo> info_;
  std::once_flag vocabulary_once_;
  std::shared_ptr<const ConstraintVocabulary> vocabulary_;

  // Compiled grammars by key, most recently used first; bounded.
  static constexpr size_t kMaxCached = 64;
  std::mutex cache_mutex_;
  std::list<std::pair<std::string, std::shared_ptr<const grammar::CompiledGrammar>>> cache_;
  std::unordered_map<std::string, decltype(cache_)::iterator> cache_index_;
};

}  // namespace metrale::server
