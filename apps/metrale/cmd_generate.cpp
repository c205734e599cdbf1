// metrale generate: text (or token ids) in, generated text out. Several --prompt flags run together
// in one continuously batched engine.
#include <cstdio>
#include <iostream>
#include <optional>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/error.h"
#include "core/strings.h"
#include "model/config.h"
#include "options.h"
#include "text/tokenizer.h"

namespace metrale::cli {
namespace {

struct GenerateOptions {
  EngineOptions engine;
  CLI::App* command = nullptr;  // to ask which sampling flags the user gave
  std::vector<std::string> prompts;
  std::string prompt_ids;
  int max_tokens = 64;
  SamplingParams sampling;
  std::optional<uint64_t> seed;
  bool ignore_eos = false;
  std::string stop_token_ids;
  bool json = false;
};

int run_generate(const GenerateOptions& options) {
  if (options.prompts.empty() == options.prompt_ids.empty()) {
    raise(ErrorCode::kInvalidArgument, "give either --prompt or --prompt-ids");
  }
  const auto model_dir = resolve_model_dir(options.engine);
  std::optional<Tokenizer> tokenizer;
  const bool need_tokenizer = !options.prompts.empty() || std::filesystem::exists(model_dir / "tokenizer.json");
  if (need_tokenizer) tokenizer = Tokenizer::from_dir(model_dir);

  // Ids are checked against the vocabulary here, as the server does, before the model loads.
  const int64_t vocab_size = load_model_config(model_dir).vocab_size;
  std::vector<std::vector<int32_t>> prompts;
  if (!options.prompt_ids.empty()) prompts.push_back(parse_token_ids(options.prompt_ids, "--prompt-ids", vocab_size));
  const std::vector<int32_t> stop_token_ids = parse_token_ids(options.stop_token_ids, "--stop-token-ids", vocab_size);
  for (const auto& text : options.prompts) prompts.push_back(tokenizer->encode(text, /*add_special_tokens=*/true));

  const SamplingParams sampling = sampling_from_flags(*options.command, options.sampling, model_dir);

  auto engine = make_engine(options.engine);
  std::vector<int64_t> ids;
  for (auto& prompt : prompts) {
    Request request;
    request.prompt = std::move(prompt);
    request.sampling = sampling;
    request.sampling.seed = options.seed;
    request.max_tokens = options.max_tokens;
    request.ignore_eos = options.ignore_eos;
    request.stop_token_ids = stop_token_ids;
    ids.push_back(engine->add_request(std::move(request)));
  }

  // One prompt streams to the terminal as tokens arrive; several are printed when all are done.
  const bool stream = !options.json && ids.size() == 1 && tokenizer.has_value();
  std::optional<IncrementalDetokenizer> detokenizer;
  if (stream) detokenizer.emplace(*tokenizer, /*skip_special_tokens=*/true);
  while (engine->has_unfinished()) {
    for (const TokenEvent& event : step_or_throw(*engine)) {
      if (stream && event.sampled.token >= 0) {
        const std::string piece = detokenizer->push(event.sampled.token);
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      }
    }
  }
  if (stream) {
    const std::string rest = detokenizer->flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    std::fputc('\n', stdout);
    return kExitOk;
  }

  nlohmann::json results = nlohmann::json::array();
  for (const int64_t id : ids) {
    const Sequence& sequence = engine->sequence(id);
    const std::vector<int32_t> output(sequence.output().begin(), sequence.output().end());
    const std::string text = tokenizer ? tokenizer->decode(output, /*skip_special_tokens=*/true) : std::string();
    if (options.json) {
      results.push_back({{"token_ids", output},
                         {"text", text},
                         {"finish_reason", std::string(finish_reason_name(sequence.finish_reason))}});
    } else if (tokenizer) {
      std::cout << text << "\n";
    } else {
      std::cout << nlohmann::json(output).dump() << "\n";
    }
  }
  if (options.json) {
    std::cout << (results.size() == 1 ? results[0] : results).dump(-1, ' ', false,
                                                                   nlohmann::json::error_handler_t::replace)
              << "\n";
  }
  return kExitOk;
}

}  // namespace

void register_generate(CLI::App& root, Action& action) {
  auto options = std::make_shared<GenerateOptions>();
  CLI::App* command = root.add_subcommand("generate", "Generate text from a prompt");
  options->command = command;
  add_model_option(*command, options->engine);
  command->add_option("--prompt,-p", options->prompts, "prompt text (repeat for a batch of prompts)");
  command->add_option("--prompt-ids", options->prompt_ids, "prompt as comma-separated token ids");
  command->add_option("--max-tokens,-n", options->max_tokens, "tokens to generate")
      ->capture_default_str()->check(CLI::Range(1, 1 << 24));
  add_sampling_options(*command, options->sampling);
  command->add_option("--seed", options->seed, "random seed (same seed, same tokens)");
  command->add_flag("--ignore-eos", options->ignore_eos, "keep generating after an end-of-sequence token");
  command->add_option("--stop-token-ids", options->stop_token_ids, "comma-separated ids that end generation");
  command->add_flag("--json", options->json, "print {token_ids, text, finish_reason} as JSON");
  add_engine_options(*command, options->engine);
  command->callback([options, &action] { action = [options] { return run_generate(*options); }; });
}

}  // namespace metrale::cli
