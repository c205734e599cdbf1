#include "text/grammar/fuzz.h"

#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "text/grammar/compiled_grammar.h"
#include "text/grammar/json_schema.h"
#include "text/grammar/matcher.h"

namespace metrale::grammar {
namespace {

std::shared_ptr<const TokenizerInfo> fuzz_vocabulary() {
  static const std::shared_ptr<const TokenizerInfo> vocabulary = [] {
    std::vector<std::string> tokens = {"<eos>"};
    for (int c = 0x20; c < 0x7f; ++c) tokens.emplace_back(1, static_cast<char>(c));
    for (const char* piece : {"\n", "é", "\xe6", "\x97\xa5", "{\"", "\":", "\", \"", "\"}", "},", "]}", "true", "null",
                              "12", "-1", "0.5", "e+", "\\n", "\\u00", "  "}) {
      tokens.emplace_back(piece);
    }
    return TokenizerInfo::from_tokens(tokens, {0}, {0});
  }();
  return vocabulary;
}

}  // namespace

int fuzz_json_schema_grammar(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t split = input.find('\0');
  if (split == std::string_view::npos) return 0;
  const nlohmann::ordered_json schema = nlohmann::ordered_json::parse(input.substr(0, split), nullptr, false);
  if (schema.is_discarded()) return 0;
  std::shared_ptr<const CompiledGrammar> grammar;
  try {
    GrammarCompileOptions options;
    options.limits.max_nfa_states = 200'000;
    options.limits.max_dfa_states = 20'000;
    grammar = compile_grammar(json_schema_grammar(schema), fuzz_vocabulary(), options);
  } catch (const Error&) {
    return 0;
  }
  GrammarMatcher matcher(grammar);
  const TokenizerInfo& vocabulary = grammar->tokenizer();
  std::vector<uint32_t> bitmask(static_cast<size_t>(matcher.bitmask_words()));
  std::string text;
  for (size_t i = split + 1; i < size && !matcher.is_terminated(); ++i) {
    matcher.fill_next_token_bitmask(bitmask);
    std::vector<int32_t> allowed;
    for (int32_t token = 0; token < vocabulary.num_tokens(); ++token) {
      if ((bitmask[static_cast<size_t>(token) >> 5] >> (token & 31)) & 1) allowed.push_back(token);
    }
    if (allowed.empty()) std::abort();  // a dead end: the grammar can neither go on nor stop
    const int32_t token = allowed[data[i] % allowed.size()];
    if (!matcher.accept_token(token)) std::abort();  // the mask allowed a token accept refuses
    if (!matcher.is_terminated()) text += vocabulary.token_bytes(token);
  }
  if (matcher.is_terminated() && nlohmann::ordered_json::parse(text, nullptr, false).is_discarded()) std::abort();
  return 0;
}

}  // namespace metrale::grammar
