// Splits generated text into reasoning (between <think> and </think>) and the answer, incrementally,
// as the server streams it. Models whose template opens the think block in the prompt (Qwen3.5 and
// GLM-4.7+ with thinking on, DeepSeek V3.1+ in thinking mode) generate only the closing tag:
// construct with starts_in_reasoning. When thinking is off (the prompt already holds
// "<think></think>"), construct without it.
//
// Rules: an opening tag counts only at the start of the output (after whitespace, which is dropped);
// there is one reasoning block, and everything after its closing tag is content, tags included.
// Output without any tag is all content; reasoning never closed stays reasoning (a truncated
// thought). The text between the tags is passed on as generated (no trimming).
#pragma once

#include <cstdint>
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
  enum class State : uint8_t {
    kStart,      // nothing but whitespace seen; an opening tag may still come
    kReasoning,  // inside the think block
    kContent,    // after the think block, or output without one
  };

  std::string open_tag_;
  std::string close_tag_;
  State state_;
  std::string pending_;  // text held back: leading whitespace / a possible partial tag
};

}  // namespace metrale
