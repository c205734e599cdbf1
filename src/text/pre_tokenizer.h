// The pre-tokenizer of a byte-level BPE tokenizer.json: zero or more Split steps (a regex or a
// literal, with one of HF's five delimiter behaviours, optionally inverted) followed by ByteLevel
// (optional prefix space, optional GPT-2 regex split). ByteLevel's byte-to-alphabet mapping is
// not materialised here: the BPE model maps bytes to its initial symbols directly.
#pragma once

#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "text/regex.h"

namespace metrale::text {

// What happens to the delimiters (the matched parts) of a Split. Names and semantics are those
// of HF tokenizers' SplitDelimiterBehavior.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Reusable buffers for one pre-tokenization; keep one per thread to avoid allocations.
struct PreTokenizeScratch {
  std::vector<std::string_view> current;
  std::vector<std::string_view> next;
  std::vector<ByteRange> matches;
  std::deque<std::string> prefixed;  // pieces that ByteLevel's add_prefix_space had to copy
};

class PreTokenizer {
 public:
  // Parses the "pre_tokenizer" object of tokenizer.json. Throws kUnsupported unless it is a
  // ByteLevel, or a Sequence (nested Sequences are flattened) of Splits ending with one ByteLevel.
  static PreTokenizer from_json(const nlohmann::json& spec);

  // Splits normalized text into pre-tokens, appended to `pieces` in order. Empty pieces are
  // dropped. A piece views `text` or a string owned by `scratch` (valid until its next use).
  void split(std::string_view text, PreTokenizeScratch& scratch, std::vector<std::string_view>& pieces) const;

 private:
  struct SplitStep {
    Regex regex;  // a String pattern is compiled as the escaped literal, as HF does
    SplitBehavior behavior;
    bool invert;
  };
  static void apply_split(const SplitStep& step, std::string_view piece, std::vector<ByteRange>& matches,
                          std::vector<std::string_view>& out);
  // ByteLevel's add_prefix_space, applied to scratch.current.
  void prefix_spaces(PreTokenizeScratch& scratch) const;

  std::vector<SplitStep> steps_;  // the Split steps, then ByteLevel's GPT-2 split when use_regex
  size_t byte_level_step_ = 0;    // index of the first step that belongs to ByteLevel
  bool add_prefix_space_ = false;
};

}  // namespace metrale::text
