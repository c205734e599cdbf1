// metrale chat: an interactive conversation in the terminal with the model's own chat template.
// Each line is a user turn; the reply streams as it is generated. /reset starts over, /exit (or
// end of input) leaves. Reasoning (<think> ... </think>) is shown dimmed, or hidden with
// --hide-reasoning. Works with stdin not a terminal too (no prompt, no colours), so it can be piped.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/error.h"
#include "core/strings.h"
#include "options.h"
#include "text/chat_template.h"
#include "text/reasoning_parser.h"
#include "text/tokenizer.h"

namespace metrale::cli {
namespace {

struct ChatOptions {
  EngineOptions engine;
  CLI::App* command = nullptr;
  std::string system;
  int max_tokens = 2048;
  SamplingParams sampling;
  std::optional<uint64_t> seed;
  bool hide_reasoning = false;
  bool no_thinking = false;
};

constexpr const char* kDim = "\x1b[2m";
constexpr const char* kReset = "\x1b[0m";

void write_out(std::string_view text) {
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
}

int run_chat(const ChatOptions& options) {
  const auto model_dir = resolve_model_dir(options.engine);
  const Tokenizer tokenizer = Tokenizer::from_dir(model_dir);
  if (tokenizer.chat_template().empty())
    raise(ErrorCode::kInvalidArgument, "the model in {} has no chat template", model_dir.string());
  const ChatTemplate chat_template = ChatTemplate::from_tokenizer(tokenizer);
  const bool uses_think = tokenizer.chat_template().find("<think>") != std::string::npos;

  SamplingParams sampling = sampling_from_flags(*options.command, options.sampling, model_dir);
  sampling.seed = options.seed;

  auto engine = make_engine(options.engine);
  const int64_t context = engine->plan().max_model_len;
  const bool interactive = ::isatty(STDIN_FILENO) != 0;
  const bool colour = ::isatty(STDOUT_FILENO) != 0;

  nlohmann::json messages = nlohmann::json::array();
  const auto reset = [&] {
    messages = nlohmann::json::array();
    if (!options.system.empty()) messages.push_back({{"role", "system"}, {"content", options.system}});
  };
  reset();
  if (interactive) write_out("metrale chat: /reset starts over, /exit leaves\n");

  std::string line;
  for (;;) {
    if (interactive) write_out("> ");
    if (!std::getline(std::cin, line)) break;
    const std::string input = trim(line);
    if (input.empty()) continue;
    if (input == "/exit" || input == "/quit") break;
    if (input == "/reset") {
      reset();
      write_out("(conversation reset)\n");
      continue;
    }
    messages.push_back({{"role", "user"}, {"content", input}});
    ChatTemplateInputs inputs;
    inputs.messages = messages;
    if (options.no_thinking) inputs.extra["enable_thinking"] = false;
    const std::string prompt = chat_template.render(inputs);
    Request request;
    request.prompt = tokenizer.encode(prompt, /*add_special_tokens=*/false);
    const int64_t room = context - static_cast<int64_t>(request.prompt.size());
    if (room < 1) {
      messages.erase(messages.end() - 1);
      write_out("(the conversation fills the model's context: /reset to start over)\n");
      continue;
    }
    request.max_tokens = static_cast<int32_t>(std::min<int64_t>(options.max_tokens, room));
    request.sampling = sampling;
    if (sampling.seed) request.sampling.seed = *sampling.seed + messages.size();
    const int64_t id = engine->add_request(std::move(request));

    const size_t open = prompt.rfind("<think>");
    const size_t close = prompt.rfind("</think>");
    ReasoningParser reasoning(open != std::string::npos && (close == std::string::npos || close < open));
    IncrementalDetokenizer detokenizer(tokenizer, /*skip_special_tokens=*/true);
    std::string content;
    bool in_reasoning_output = false;  // dim colour is on
    const auto show = [&](const ReasoningDelta& delta) {
      if (!delta.reasoning.empty() && !options.hide_reasoning) {
        if (colour && !in_reasoning_output) write_out(kDim);
        in_reasoning_output = true;
        write_out(delta.reasoning);
      }
      if (!delta.content.empty()) {
        if (colour && in_reasoning_output) write_out(kReset);
        in_reasoning_output = false;
        write_out(delta.content);
        content += delta.content;
      }
    };
    while (engine->has_unfinished()) {
      for (const TokenEvent& event : step_or_throw(*engine)) {
        if (event.request_id != id || event.sampled.token < 0) continue;
        // The end-of-turn token is not part of the reply.
        if (event.finish_reason == FinishReason::kStop) continue;
        const std::string piece = detokenizer.push(event.sampled.token);
        if (uses_think) show(reasoning.feed(piece));
        else show(ReasoningDelta{"", piece});
      }
    }
    const std::string rest = detokenizer.flush();
    if (uses_think) {
      show(reasoning.feed(rest));
      show(reasoning.finish());
    } else {
      show(ReasoningDelta{"", rest});
    }
    if (colour && in_reasoning_output) write_out(kReset);
    write_out("\n");
    engine->release(id);
    messages.push_back({{"role", "assistant"}, {"content", content}});
  }
  return kExitOk;
}

}  // namespace

void register_chat(CLI::App& root, Action& action) {
  auto options = std::make_shared<ChatOptions>();
  CLI::App* command = root.add_subcommand("chat", "Chat with the model in the terminal (its chat template, streaming)");
  options->command = command;
  add_model_option(*command, options->engine);
  command->add_option("--system", options->system, "a system message that opens the conversation");
  command->add_option("--max-tokens,-n", options->max_tokens, "tokens per reply at most")
      ->capture_default_str()->check(CLI::Range(1, 1 << 24));
  add_sampling_options(*command, options->sampling);
  command->add_option("--seed", options->seed, "random seed (same seed, same replies)");
  command->add_flag("--hide-reasoning", options->hide_reasoning, "do not print the model's <think> reasoning");
  command->add_flag("--no-thinking", options->no_thinking, "ask the template to turn thinking off (enable_thinking=false)");
  add_engine_options(*command, options->engine);
  command->callback([options, &action] { action = [options] { return run_chat(*options); }; });
}

}  // namespace metrale::cli
