#include "text/reasoning_parser.h"

#include <algorithm>
#include <utility>

#include "core/error.h"

namespace metrale {
namespace {

// The length of the longest suffix of `text` that is a proper prefix of `tag` (a tag that may be
// completed by the next piece of text).
size_t partial_tag_suffix(std::string_view text, std::string_view tag) {
  for (size_t length = std::min(text.size(), tag.size() - 1); length > 0; --length) {
    if (text.substr(text.size() - length) == tag.substr(0, length)) return length;
  }
  return 0;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

}  // namespace

ReasoningParser::ReasoningParser(bool starts_in_reasoning, std::string open_tag, std::string close_tag)
    : open_tag_(std::move(open_tag)),
      close_tag_(std::move(close_tag)),
      state_(starts_in_reasoning ? State::kReasoning : State::kStart) {
  if (open_tag_.empty() || close_tag_.empty()) {
    raise(ErrorCode::kInvalidArgument, "reasoning parser: the think tags must not be empty");
  }
}

ReasoningDelta ReasoningParser::feed(std::string_view text) {
  ReasoningDelta delta;
  pending_.append(text);
  while (!pending_.empty()) {
    if (state_ == State::kStart) {
      const size_t first = static_cast<size_t>(
          std::find_if(pending_.begin(), pending_.end(), [](char c) { return !is_space(c); }) - pending_.begin());
      const std::string_view rest = std::string_view(pending_).substr(first);
      if (rest.empty()) return delta;  // only whitespace so far: undecided
      if (rest.size() < open_tag_.size() && open_tag_.compare(0, rest.size(), rest) == 0) return delta;
      if (rest.substr(0, open_tag_.size()) == open_tag_) {
        pending_.erase(0, first + open_tag_.size());
        state_ = State::kReasoning;
      } else {
        state_ = State::kContent;
      }
      continue;
    }
    if (state_ == State::kContent) {
      delta.content += pending_;
      pending_.clear();
      return delta;
    }
    const size_t close = pending_.find(close_tag_);
    if (close != std::string::npos) {
      delta.reasoning.append(pending_, 0, close);
      pending_.erase(0, close + close_tag_.size());
      state_ = State::kContent;
      continue;
    }
    const size_t held = partial_tag_suffix(pending_, close_tag_);
    delta.reasoning.append(pending_, 0, pending_.size() - held);
    pending_.erase(0, pending_.size() - held);
    return delta;
  }
  return delta;
}

ReasoningDelta ReasoningParser::finish() {
  ReasoningDelta delta;
  if (state_ == State::kReasoning) {
    delta.reasoning = std::move(pending_);
  } else {
    delta.content = std::move(pending_);
  }
  pending_.clear();
  state_ = State::kContent;
  return delta;
}

}  // namespace metrale
