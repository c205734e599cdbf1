// Chat templates: a Jinja-subset interpreter that renders the `chat_template` shipped with a model
// (tokenizer_config.json or chat_template.jinja) the way transformers' apply_chat_template does,
// byte for byte equal to @huggingface/jinja for the templates of Qwen3, Qwen3.5, GLM and DeepSeek.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace metrale {

class Tokenizer;

struct ChatTemplateInputs {
  nlohmann::json messages = nlohmann::json::array();  // [{role, content, tool_calls?, reasoning_content?, ...}]
  nlohmann::json tools;                               // null or an array of tool definitions
  bool add_generation_prompt = true;
  // Extra template variables (request `chat_template_kwargs`, e.g. {"enable_thinking": false});
  // they override the defaults below.
  nlohmann::json extra = nlohmann::json::object();
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
  // (including the template's own raise_exception) with its message.
  std::string render(const ChatTemplateInputs& inputs) const;

 private:
  struct Program;
  std::unique_ptr<Program> program_;
  std::string bos_token_;
  std::string eos_token_;
};

}  // namespace metrale
