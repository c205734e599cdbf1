// metrale score: runs a token sequence through the engine and reports the logits of every position
// (as .npy) and the sequence's perplexity. --chunk N feeds it as consecutive forwards of N tokens,
// so N = 1 exercises the decode path and other values chunked prefill.
#include <cmath>
#include <iostream>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "core/error.h"
#include "core/npy.h"
#include "core/strings.h"
#include "model/config.h"
#include "options.h"
#include "text/tokenizer.h"

namespace metrale::cli {
namespace {

struct ScoreOptions {
  EngineOptions engine;
  std::string tokens;
  std::string text;
  std::string out;
  int chunk = 0;
};

int run_score(const ScoreOptions& options) {
  if (options.tokens.empty() == options.text.empty()) raise(ErrorCode::kInvalidArgument, "give either --tokens or --text");
  std::vector<int32_t> ids;
  if (!options.tokens.empty()) {
    ids = parse_token_ids(options.tokens, "--tokens", load_model_config(resolve_model_dir(options.engine)).vocab_size);
  } else {
    ids = Tokenizer::from_dir(resolve_model_dir(options.engine)).encode(options.text, true);
  }
  if (ids.empty()) raise(ErrorCode::kInvalidArgument, "nothing to score");
  EngineOptions engine_options = options.engine;
  // The whole sequence must fit one request: size the step and context to it when not given.
  engine_options.max_num_seqs = 1;
  auto engine = make_engine(engine_options, options.chunk);
  Request request;
  request.prompt = ids;
  request.max_tokens = 0;
  request.return_prompt_logits = true;
  const int64_t id = engine->add_request(std::move(request));
  while (engine->has_unfinished()) step_or_throw(*engine);
  const Sequence& sequence = engine->sequence(id);
  const int64_t count = static_cast<int64_t>(ids.size());
  const int64_t vocab = engine->model().config().vocab_size;
  if (!options.out.empty()) {
    const int64_t shape[] = {count, vocab};
    write_npy_f32(options.out, sequence.prompt_logits, shape);
  }
  // Mean negative log-likelihood of tokens 1..T-1 given their prefixes.
  double nll = 0.0;
  for (int64_t t = 0; t + 1 < count; ++t) {
    const float* row = sequence.prompt_logits.data() + t * vocab;
    double max_logit = row[0];
    for (int64_t v = 1; v < vocab; ++v) max_logit = std::max<double>(max_logit, row[v]);
    double sum = 0.0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - max_logit);
    nll += max_logit + std::log(sum) - row[ids[static_cast<size_t>(t + 1)]];
  }
  const int64_t predicted = std::max<int64_t>(count - 1, 0);
  const double mean_nll = predicted > 0 ? nll / static_cast<double>(predicted) : 0.0;
  nlohmann::json summary = {{"num_tokens", count}, {"num_predicted", predicted}, {"mean_nll", mean_nll},
                            {"perplexity", std::exp(mean_nll)}};
  if (!options.out.empty()) summary["logits"] = options.out;
  std::cout << summary.dump() << "\n";
  return kExitOk;
}

}  // namespace

void register_score(CLI::App& root, Action& action) {
  auto options = std::make_shared<ScoreOptions>();
  CLI::App* command = root.add_subcommand("score", "Compute the logits of every position of a sequence");
  add_model_option(*command, options->engine);
  command->add_option("--tokens", options->tokens, "comma-separated token ids");
  command->add_option("--text", options->text, "text to tokenize and score");
  command->add_option("--out,-o", options->out, "write the logits [T, vocab] as a float32 .npy file");
  command->add_option("--chunk", options->chunk, "feed the sequence N tokens per forward (1: decode path)")
      ->check(CLI::NonNegativeNumber);
  add_engine_options(*command, options->engine);
  command->callback([options, &action] { action = [options] { return run_score(*options); }; });
}

}  // namespace metrale::cli
