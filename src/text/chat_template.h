// Chat templates: a Jinja-subset interpreter that renders the `chat_template` shipped with a model
// (tokenizer_config.json or chat_template.jinja) the way transformers' apply_chat_template does,
// byte for byte equal to @huggingface/jinja for the templates of Qwen3, Qwen3.5, GLM and DeepSeek.
#pragma once

#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace metrale {

class Tokenizer;

// The JSON is ordered_json so that objects keep the key order of the request: `tojson` in a template
// (tool definitions, tool-call arguments) must print keys in the order the client sent them, as
// transformers does. Parse request bodies with nlohmann::ordered_json to keep it; a plain
// nlohmann::json converts implicitly but has already sorted its keys.
struct ChatTemplateInputs {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();  // [{role, content, tool_calls?, reasoning_content?, ...}]
  nlohmann::ordered_json tools;                                       // null or an array of tool definitions
  bool add_generation_prompt = true;
  // Extra template variables (request `chat_template_kwargs`, e.g. {"enable_thinking": false});
  // they override the variables above (messages, tools, add_generation_prompt, bos_token, ...).
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
  // The time strftime_now() formats, in local time; the current time when absent (tests pin it).
  std::optional<std::time_t> now;
};

class ChatTemplate {
 public:
  // Parses `source` once; throws kInvalidArgument with the line and column on a syntax error or an
  // unsupported construct. bos_token / eos_token are the strings the template sees.
  ChatTemplate(std::string_view source, std::string bos_token, std::string eos_token);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // The tokenizer's template and special tokens; throws kNotFound when the model has none.
  static ChatTemplate from_tokenizer(const Tokenizer& tokenizer);

  // Renders the conversation. Throws kInvalidArgument for a runtime error in the template
  // (including the template's own raise_exception) with its message. The template sees the
  // variables transformers.js's apply_chat_template passes: messages, add_generation_prompt, tools
  // (null when absent), documents (null), bos_token, eos_token, then `extra`.
  // Thread-safe: a ChatTemplate may render from many threads at once.
  std::string render(const ChatTemplateInputs& inputs) const;

  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }

 private:
  struct Program;
  std::unique_ptr<Program> program_;
  std::string bos_token_;
  std::string eos_token_;
};

}  // namespace metrale
