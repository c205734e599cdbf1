#include "text/chat_template.h"

#include <utility>
#include <vector>

#include "core/error.h"
#include "text/jinja_interpreter.h"
#include "text/jinja_lexer.h"
#include "text/jinja_parser.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

namespace metrale {

struct ChatTemplate::Program {
  std::string source;  // the template as parsed (ill-formed UTF-8 repaired); positions refer to it
  std::vector<text::jinja::NodePtr> statements;
};

ChatTemplate::ChatTemplate(std::string_view source, std::string bos_token, std::string eos_token)
    : program_(std::make_unique<Program>()), bos_token_(std::move(bos_token)), eos_token_(std::move(eos_token)) {
  program_->source = text::to_valid_utf8_lossy(source);
  program_->statements = text::jinja::parse(text::jinja::tokenize(program_->source), program_->source);
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

ChatTemplate ChatTemplate::from_tokenizer(const Tokenizer& tokenizer) {
  if (tokenizer.chat_template().empty()) {
    raise(ErrorCode::kNotFound, "the model has no chat template (tokenizer_config.json or chat_template.jinja)");
  }
  const auto token_text = [&](std::optional<int32_t> id) {
    return id ? std::string(tokenizer.token_bytes(*id)) : std::string();
  };
  return ChatTemplate(tokenizer.chat_template(), token_text(tokenizer.bos_token_id()),
                      token_text(tokenizer.eos_token_id()));
}

std::string ChatTemplate::render(const ChatTemplateInputs& inputs) const {
  using text::jinja::Value;
  if (!inputs.extra.is_null() && !inputs.extra.is_object()) {
    raise(ErrorCode::kInvalidArgument, "chat template kwargs must be a JSON object");
  }
  text::jinja::RenderContext context;
  context.now = inputs.now;
  auto& variables = context.variables;
  const auto set = [&](std::string name, Value value) {
    for (auto& [key, existing] : variables) {
      if (key == name) {
        existing = std::move(value);
        return;
      }
    }
    variables.emplace_back(std::move(name), std::move(value));
  };
  set("messages", Value::from_json(inputs.messages));
  set("add_generation_prompt", Value::boolean(inputs.add_generation_prompt));
  set("tools", Value::from_json(inputs.tools));
  set("documents", Value::null());
  set("bos_token", Value::string(bos_token_));
  set("eos_token", Value::string(eos_token_));
  if (inputs.extra.is_object()) {
    for (auto it = inputs.extra.begin(); it != inputs.extra.end(); ++it) set(it.key(), Value::from_json(it.value()));
  }
  return text::jinja::render(program_->statements, program_->source, context);
}

}  // namespace metrale
