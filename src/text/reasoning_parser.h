// Splits generated text into reasoning (between <think> and </think>) and the answer, incrementally,
// as the server streams it. Models whose template opens the think block in the prompt (Qwen3 with
// thinking on, Qwen3.5, GLM) generate only the closing tag: construct with starts_in_reasoning.
#pragma once

#include <string>
#include <string_view>

namespace metrale {

struct ReasoningDelta {
  std::string reasoning;  // text that belongs to reasoning_content
  std::string content;    // text that belongs to content
};

class ReasoningParser {
 public:
  explicit ReasoningParser(bool starts_in_reasoning = false, std::string open_tag = "<think>",
                           std::string close_tag = "</think>");

  // Feeds the next piece of text; returns what can be attributed so far. A partial tag at the end of
  // the text is held back until the next feed() or finish().
  ReasoningDelta feed(std::string_view text);
  // Flushes what is held back at the end of generation.
  ReasoningDelta finish();

 private:
  std::string open_tag_;
  std::string close_tag_;
  bool in_reasoning_;
  bool seen_close_ = false;
  std::string pending_;
};

}  // namespace metrale
