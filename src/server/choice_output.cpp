#include "server/choice_output.h"

#include <algorithm>

namespace metrale::server {

std::string finish_reason_string(FinishReason reason) { return std::string(finish_reason_name(reason)); }

int64_t count_code_points(std::string_view text) {
  return std::count_if(text.begin(), text.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
}

ChoiceOutput::ChoiceOutput(const Tokenizer& tokenizer, ChoiceOptions options)
    : tokenizer_(tokenizer),
      options_(std::move(options)),
      detokenizer_(tokenizer, options_.skip_special_tokens),
      stop_(options_.stop),
      output_(options_.reasoning ? std::optional<ReasoningParser>(std::in_place, options_.starts_in_reasoning)
                                 : std::nullopt,
              options_.tool_format
                  ? std::optional<ToolCallParser>(std::in_place, *options_.tool_format, options_.tools,
                                                  ToolCallParserOptions{options_.tool_id_seed, options_.max_tool_calls})
                  : std::nullopt) {
  accumulated_.index = options_.index;
  accumulated_.has_logprobs = options_.logprobs.has_value();
  accumulated_.has_token_ids = options_.return_token_ids;
  if (options_.return_token_ids) accumulated_.prompt_token_ids = options_.prompt_token_ids;
}

TokenAlternative ChoiceOutput::render(int32_t token, float logprob) const {
  TokenAlternative alternative;
  const int32_t ids[1] = {token};
  alternative.token = tokenizer_.decode(ids, /*skip_special_tokens=*/false);
  alternative.bytes = std::string(tokenizer_.token_bytes(token));
  alternative.logprob = logprob;
  return alternative;
}

void ChoiceOutput::emit(std::string text, bool final, ChoiceText& delta) {
  const auto add = [&](OutputDelta split) {
    delta.text += split.content;
    delta.reasoning += split.reasoning;
    for (ToolCallDelta& call : split.tool_calls) delta.tool_calls.push_back(std::move(call));
  };
  add(output_.feed(text));
  if (final) add(output_.finish());
}

std::string ChoiceOutput::final_reason(const std::string& reason) const {
  return reason == "stop" && output_.num_tool_calls() > 0 ? "tool_calls" : reason;
}

std::string ChoiceOutput::end_of_text() {
  StopStringMatcher::Result rest = stop_.feed(detokenizer_.flush());
  if (rest.matched) return std::move(rest.text);
  return std::move(rest.text) + stop_.flush().text;
}

void ChoiceOutput::accumulate(const ChoiceText& delta) {
  accumulated_.text += delta.text;
  accumulated_.reasoning += delta.reasoning;
  for (const ToolCallDelta& piece : delta.tool_calls) {
    auto call = std::find_if(accumulated_.tool_calls.begin(), accumulated_.tool_calls.end(),
                             [&](const ToolCallDelta& known) { return known.index == piece.index; });
    if (call == accumulated_.tool_calls.end()) {
      accumulated_.tool_calls.push_back(piece);
    } else {
      call->arguments += piece.arguments;
    }
  }
  accumulated_.logprobs.insert(accumulated_.logprobs.end(), delta.logprobs.begin(), delta.logprobs.end());
  accumulated_.token_ids.insert(accumulated_.token_ids.end(), delta.token_ids.begin(), delta.token_ids.end());
  accumulated_.finish_reason = delta.finish_reason;
}

void ChoiceOutput::on_prompt_logprobs(std::span<const int32_t> prompt, const std::vector<SampledToken>& logprobs) {
  if (!options_.logprobs) return;
  int64_t offset = 0;
  for (size_t i = 0; i < prompt.size() && i < logprobs.size(); ++i) {
    const SampledToken& described = logprobs[i];
    LogprobEntry entry;
    entry.chosen = render(prompt[i], described.logprob);
    entry.has_logprob = described.token >= 0;
    entry.text_offset = offset;
    const auto count = std::min<size_t>(described.top_logprobs.size(), static_cast<size_t>(*options_.logprobs));
    for (size_t k = 0; k < count; ++k)
      entry.top.push_back(render(described.top_logprobs[k].first, described.top_logprobs[k].second));
    offset += count_code_points(entry.chosen.token);
    prompt_entries_.push_back(std::move(entry));
  }
}

ChoiceText ChoiceOutput::on_token(const SampledToken& token, FinishReason finish, SteadyClock::time_point time) {
  ChoiceText delta;
  delta.index = options_.index;
  delta.has_logprobs = options_.logprobs.has_value();
  delta.has_token_ids = options_.return_token_ids;
  if (finished()) return delta;
  ++num_tokens_;
  if (options_.return_token_ids) {
    delta.token_ids.push_back(token.token);
    if (num_tokens_ == 1) delta.prompt_token_ids = options_.prompt_token_ids;
  }
  if (!first_token_) first_token_ = time;
  last_token_ = time;
  // A token that stops by EOS or a stop token id ends the output without being part of its text.
  const bool stop_token = finish == FinishReason::kStop;
  const std::string piece = stop_token ? std::string() : detokenizer_.push(token.token);
  if (!prompt_entries_.empty()) {
    delta.logprobs = std::move(prompt_entries_);
    prompt_entries_.clear();
  }
  if (options_.logprobs) {
    LogprobEntry entry;
    entry.chosen = render(token.token, token.logprob);
    entry.text_offset = options_.text_offset + code_points_;
    const auto count = std::min<size_t>(token.top_logprobs.size(), static_cast<size_t>(*options_.logprobs));
    for (size_t i = 0; i < count; ++i)
      entry.top.push_back(render(token.top_logprobs[i].first, token.top_logprobs[i].second));
    delta.logprobs.push_back(std::move(entry));
  }
  code_points_ += count_code_points(piece);
  StopStringMatcher::Result released = stop_.feed(piece);
  std::string text = std::move(released.text);
  if (released.matched) {
    finish_reason_ = "stop";
  } else if (finish != FinishReason::kNone) {
    text += end_of_text();
    finish_reason_ = stop_.matched() ? "stop" : finish_reason_string(finish);
  }
  emit(std::move(text), finished(), delta);
  if (finished()) finish_reason_ = final_reason(finish_reason_);
  delta.finish_reason = finish_reason_;
  accumulate(delta);
  return delta;
}

ChoiceText ChoiceOutput::on_end(FinishReason reason) { return end(finish_reason_string(reason)); }

ChoiceText ChoiceOutput::on_error() { return end("error"); }

ChoiceText ChoiceOutput::end(const std::string& finish_reason) {
  ChoiceText delta;
  delta.index = options_.index;
  delta.has_logprobs = options_.logprobs.has_value();
  delta.has_token_ids = options_.return_token_ids;
  if (finished()) return delta;
  // Text held back for a stop string that never came is still part of the output.
  std::string text = end_of_text();
  finish_reason_ = stop_.matched() ? "stop" : finish_reason;
  emit(std::move(text), /*final=*/true, delta);
  finish_reason_ = final_reason(finish_reason_);
  delta.finish_reason = finish_reason_;
  accumulate(delta);
  return delta;
}

}  // namespace metrale::server
