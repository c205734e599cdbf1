#include "text/tool_calls/tool_call_parser.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <utility>

#include "core/error.h"
#include "text/tool_calls/formats.h"

namespace metrale {
namespace {

using text::tool_calls::Markers;
using text::tool_calls::ParsedCall;
using text::tool_calls::ToolIndex;

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

// The length of the longest suffix of `text` that is a proper prefix of `marker`.
size_t partial_suffix(std::string_view text, std::string_view marker) {
  for (size_t length = std::min(text.size(), marker.size() - 1); length > 0; --length) {
    if (text.substr(text.size() - length) == marker.substr(0, length)) return length;
  }
  return 0;
}

// Splits `text` into its part up to the last non-space character and the trailing whitespace.
std::pair<std::string_view, std::string_view> split_trailing_space(std::string_view text) {
  size_t end = text.size();
  while (end > 0 && is_space(text[end - 1])) --end;
  return {text.substr(0, end), text.substr(end)};
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::string call_id(uint64_t seed, int32_t index) {
  static constexpr std::string_view kAlphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
  std::string id = "call_";
  uint64_t state = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(index) + 1));
  for (int i = 0; i < 24; ++i) {
    if (i % 10 == 0) state = splitmix64(state);
    id += kAlphabet[state % kAlphabet.size()];
    state /= kAlphabet.size();
  }
  return id;
}

}  // namespace

// The parser's state machine. Invariant: every byte fed is, at any time, exactly one of: emitted
// as content, consumed by an emitted call (or dropped as separating whitespace, or as a call past
// options.max_calls), or held in
// held_space_ / separator_ / raw_ / body_ / pending_.
struct ToolCallParser::State {
  enum class Phase : uint8_t {
    kContent,      // plain text; looking for the start of a call (or of a section)
    kSection,      // inside a section, between calls
    kCall,         // inside a call, looking for its end
    kPassThrough,  // after an internal failure: everything is content
  };

  ToolCallFormat format;
  Markers markers;
  ToolIndex tools;
  ToolCallParserOptions options;

  Phase phase = Phase::kContent;
  std::string pending_;     // input not yet looked at (a possible partial marker)
  std::string held_space_;  // trailing whitespace of the content, which may precede a call
  std::string separator_;   // the whitespace before the call or section being read
  std::string raw_;         // the text of the markup read so far that is not yet a call (section begin, call begin)
  std::string body_;        // the call's body read so far
  bool section_has_call_ = false;  // a call of the current section was emitted: its begin marker is spent
  bool after_call_ = false;        // the last thing attributed was a call: leading whitespace is dropped
  int32_t num_calls_ = 0;

  State(ToolCallFormat f, std::vector<ToolDefinition> t, ToolCallParserOptions o)
      : format(f), markers(text::tool_calls::markers_of(f)), tools(std::move(t)), options(o) {}

  bool has_sections() const { return !markers.section_begin.empty(); }
  std::string_view start_marker() const { return has_sections() ? markers.section_begin : markers.call_begin; }

  void emit_content(ToolParseDelta& delta, std::string_view text) {
    if (text.empty()) return;
    delta.content.append(text);
    after_call_ = false;
  }

  // Gives back the markup held for the current attempt as content (the attempt failed).
  void release_raw(ToolParseDelta& delta) {
    std::string text = std::move(separator_);
    text += raw_;
    text += body_;
    separator_.clear();
    raw_.clear();
    body_.clear();
    emit_content(delta, text);
  }

  void emit_call(ToolParseDelta& delta, ParsedCall call) {
    if (options.max_calls > 0 && num_calls_ >= options.max_calls) {
      // Past the limit: the call is consumed and dropped, as the separating whitespace is.
      separator_.clear();
      raw_.clear();
      body_.clear();
      after_call_ = true;
      return;
    }
    ToolCallDelta start;
    start.index = num_calls_;
    start.id = call_id(options.id_seed, num_calls_);
    start.name = std::move(call.name);
    delta.tool_calls.push_back(std::move(start));
    ToolCallDelta arguments;
    arguments.index = num_calls_;
    arguments.arguments = std::move(call.arguments);
    delta.tool_calls.push_back(std::move(arguments));
    ++num_calls_;
    separator_.clear();
    raw_.clear();
    body_.clear();
    after_call_ = true;
  }

  // Each step consumes some of pending_ and returns true, or returns false when it needs more input.
  bool step_content(ToolParseDelta& delta) {
    if (after_call_) {
      const size_t text = pending_.find_first_not_of(" \t\r\n");
      pending_.erase(0, text == std::string::npos ? pending_.size() : text);
      if (pending_.empty()) return false;
    }
    const std::string_view marker = start_marker();
    const size_t at = pending_.find(marker);
    if (at != std::string::npos) {
      const auto [text, space] = split_trailing_space(std::string_view(pending_).substr(0, at));
      if (!text.empty()) {
        emit_content(delta, held_space_);
        held_space_.clear();
        emit_content(delta, text);
      }
      separator_ = std::move(held_space_);
      held_space_.clear();
      separator_.append(space);
      raw_.assign(marker);
      pending_.erase(0, at + marker.size());
      section_has_call_ = false;
      phase = has_sections() ? Phase::kSection : Phase::kCall;
      return true;
    }
    const size_t keep = partial_suffix(pending_, marker);
    const auto [text, space] = split_trailing_space(std::string_view(pending_).substr(0, pending_.size() - keep));
    if (!text.empty()) {
      emit_content(delta, held_space_);
      held_space_.clear();
      emit_content(delta, text);
    }
    held_space_.append(space);
    pending_.erase(0, pending_.size() - keep);
    return false;
  }

  bool step_section(ToolParseDelta& delta) {
    const size_t text = pending_.find_first_not_of(" \t\r\n");
    const size_t space = text == std::string::npos ? pending_.size() : text;
    if (!section_has_call_) raw_.append(pending_, 0, space);
    pending_.erase(0, space);
    if (pending_.empty()) return false;
    if (pending_.starts_with(markers.call_begin)) {
      raw_.append(markers.call_begin);
      pending_.erase(0, markers.call_begin.size());
      phase = Phase::kCall;
      return true;
    }
    if (pending_.starts_with(markers.section_end)) {
      pending_.erase(0, markers.section_end.size());
      if (section_has_call_) {
        after_call_ = true;
      } else {
        raw_.append(markers.section_end);
        release_raw(delta);
      }
      phase = Phase::kContent;
      return true;
    }
    const std::string_view head =
        std::string_view(pending_).substr(0, std::max(markers.call_begin.size(), markers.section_end.size()));
    if (head.size() == pending_.size() &&
        (markers.call_begin.starts_with(head) || markers.section_end.starts_with(head))) {
      return false;  // a marker may still be arriving
    }
    // Anything else ends the section; it is content.
    if (!section_has_call_) release_raw(delta);
    phase = Phase::kContent;
    return true;
  }

  bool step_call(ToolParseDelta& delta) {
    // Scan only the part of the body a marker can newly end in.
    const size_t longest = std::max({markers.call_end.size(), markers.call_begin.size(), markers.section_begin.size()});
    const size_t from = body_.size() >= longest ? body_.size() - longest + 1 : 0;
    body_.append(pending_);
    pending_.clear();
    const size_t end = body_.find(markers.call_end, from);
    // A new call (or section) starting before this one ended: this one was never closed.
    size_t restart = body_.find(markers.call_begin, from);
    if (has_sections()) restart = std::min(restart, body_.find(markers.section_begin, from));
    if (restart != std::string::npos && (end == std::string::npos || restart < end)) {
      pending_.assign(body_, restart);
      body_.resize(restart);
      release_raw(delta);
      // A call begin keeps the section open (its begin marker, if not yet spent, went out as content).
      phase = has_sections() && pending_.starts_with(markers.call_begin) ? Phase::kSection : Phase::kContent;
      return true;
    }
    if (end == std::string::npos) return false;
    pending_.assign(body_, end + markers.call_end.size());
    body_.resize(end);
    std::optional<ParsedCall> call = text::tool_calls::parse_call_body(format, body_, tools);
    if (call) {
      emit_call(delta, std::move(*call));
      if (has_sections()) section_has_call_ = true;
    } else {
      body_.append(markers.call_end);
      release_raw(delta);
    }
    phase = has_sections() ? Phase::kSection : Phase::kContent;
    return true;
  }

  void run(ToolParseDelta& delta) {
    while (true) {
      bool progressed = false;
      switch (phase) {
        case Phase::kContent:
          progressed = step_content(delta);
          break;
        case Phase::kSection:
          progressed = step_section(delta);
          break;
        case Phase::kCall:
          progressed = step_call(delta);
          break;
        case Phase::kPassThrough:
          emit_content(delta, pending_);
          pending_.clear();
          break;
      }
      if (!progressed) return;
    }
  }

  void finish(ToolParseDelta& delta) {
    switch (phase) {
      case Phase::kContent:
        // After a call, leading whitespace is already gone; what is left (a partial marker) is text.
        emit_content(delta, held_space_);
        emit_content(delta, pending_);
        break;
      case Phase::kSection:
        if (section_has_call_) {
          // The section was never closed; what follows its last call (whitespace already dropped) is content.
          emit_content(delta, pending_);
        } else {
          body_ += pending_;
          release_raw(delta);
        }
        break;
      case Phase::kCall:
        body_ += pending_;
        release_raw(delta);
        break;
      case Phase::kPassThrough:
        emit_content(delta, pending_);
        break;
    }
    held_space_.clear();
    pending_.clear();
    phase = Phase::kPassThrough;
  }

  // After an internal failure: everything held becomes content and the rest passes through.
  void fail(ToolParseDelta& delta) noexcept {
    try {
      std::string text = std::move(held_space_);
      text += separator_;
      text += raw_;
      text += body_;
      text += pending_;
      held_space_.clear();
      separator_.clear();
      raw_.clear();
      body_.clear();
      pending_.clear();
      delta.content += text;
    } catch (...) {
    }
    phase = Phase::kPassThrough;
  }
};

ToolCallParser::ToolCallParser(ToolCallFormat format, std::vector<ToolDefinition> tools, ToolCallParserOptions options)
    : state_(std::make_unique<State>(format, std::move(tools), options)) {}
ToolCallParser::~ToolCallParser() = default;
ToolCallParser::ToolCallParser(ToolCallParser&&) noexcept = default;
ToolCallParser& ToolCallParser::operator=(ToolCallParser&&) noexcept = default;

ToolParseDelta ToolCallParser::feed(std::string_view text) noexcept {
  ToolParseDelta delta;
  try {
    state_->pending_.append(text);
    state_->run(delta);
  } catch (...) {
    state_->fail(delta);
  }
  return delta;
}

ToolParseDelta ToolCallParser::finish() noexcept {
  ToolParseDelta delta;
  try {
    state_->finish(delta);
  } catch (...) {
    state_->fail(delta);
  }
  return delta;
}

int32_t ToolCallParser::num_calls() const {
  return state_->num_calls_;
}

void merge_tool_parse_delta(ToolParseResult& result, const ToolParseDelta& delta) {
  result.content += delta.content;
  for (const ToolCallDelta& piece : delta.tool_calls) {
    if (piece.index >= static_cast<int32_t>(result.tool_calls.size())) result.tool_calls.resize(piece.index + 1);
    ToolCall& call = result.tool_calls[piece.index];
    call.id += piece.id;
    call.name += piece.name;
    call.arguments += piece.arguments;
  }
}

ToolParseResult parse_tool_calls(ToolCallFormat format, const std::vector<ToolDefinition>& tools, std::string_view text,
                                 ToolCallParserOptions options) {
  ToolCallParser parser(format, tools, options);
  ToolParseResult result;
  merge_tool_parse_delta(result, parser.feed(text));
  merge_tool_parse_delta(result, parser.finish());
  return result;
}

}  // namespace metrale
