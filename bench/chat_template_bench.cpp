// Chat-template rendering speed: a 20-message Qwen3 conversation rendered many times with the
// template parsed once, as the server does per request.
//   build/bin/metrale_chat_template_bench [runs]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "core/strings.h"
#include "text/chat_template.h"

int main(int argc, char** argv) {
  const int runs = argc > 1 ? std::atoi(argv[1]) : 2000;
  const std::string source =
      metrale::read_file(std::filesystem::path(METRALE_SOURCE_DIR) / "tests/text/chat_templates/qwen3.jinja");
  const metrale::ChatTemplate chat(source, "", "<|im_end|>");
  metrale::ChatTemplateInputs inputs;
  inputs.messages.push_back({{"role", "system"}, {"content", "You are a helpful assistant."}});
  for (int i = 0; i < 19; ++i) {
    inputs.messages.push_back({{"role", i % 2 == 0 ? "user" : "assistant"},
                               {"content", "Message number " + std::to_string(i) + " with some ordinary text in it, "
                                           "long enough to look like a real turn of a chat conversation."}});
  }
  size_t bytes = chat.render(inputs).size();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < runs; ++i) bytes += chat.render(inputs).size();
  const double micros = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  std::printf("20-message Qwen3 chat template render: %.1f us per render (%d runs, %zu bytes)\n", micros / runs, runs,
              bytes / static_cast<size_t>(runs + 1));
  return 0;
}
