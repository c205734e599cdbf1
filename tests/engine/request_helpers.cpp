#include "engine/request_helpers.h"

#include <gtest/gtest.h>

#include <utility>

namespace metrale::testing {

Request make_request(std::vector<int32_t> prompt, int32_t max_tokens, float temperature, std::optional<uint64_t> seed) {
  Request request;
  request.prompt = std::move(prompt);
  request.max_tokens = max_tokens;
  request.ignore_eos = true;
  request.sampling.temperature = temperature;
  request.sampling.seed = seed;
  return request;
}

void PrintTo(const Generated& generated, std::ostream* out) {
  for (const int32_t token : generated.tokens) *out << token << ' ';
  if (generated.finish == FinishReason::kError) *out << "(error: " << generated.error << ")";
}

void record(const std::vector<TokenEvent>& events, std::map<int64_t, Generated>& outputs) {
  for (const TokenEvent& event : events) {
    Generated& generated = outputs[event.request_id];
    if (generated.finish != FinishReason::kNone) ++generated.events_after_finish;
    if (event.sampled.token >= 0) {
      generated.tokens.push_back(event.sampled.token);
      generated.logprobs.push_back(event.sampled.logprob);
      for (const auto& [token, logprob] : event.sampled.top_logprobs) generated.logprobs.push_back(logprob);
    }
    if (event.finished()) {
      generated.finish = event.finish_reason;
      generated.error = event.error;
    }
  }
}

std::map<int64_t, Generated> run_to_completion(Engine& engine, const std::function<void(const Engine&)>& after_step,
                                               std::map<int64_t, Generated> outputs, int max_steps) {
  const bool failed_before = ::testing::Test::HasFailure();
  for (int step = 0; engine.has_unfinished(); ++step) {
    if (step >= max_steps) {
      ADD_FAILURE() << "the engine makes no progress (" << max_steps << " steps)";
      break;
    }
    record(engine.step(), outputs);
    if (after_step) after_step(engine);
    if (!failed_before && ::testing::Test::HasFailure()) break;  // one failing step, not thousands
  }
  return outputs;
}

std::map<int64_t, std::vector<int32_t>> tokens_of(const std::map<int64_t, Generated>& outputs) {
  std::map<int64_t, std::vector<int32_t>> tokens;
  for (const auto& [id, generated] : outputs)
    if (!generated.tokens.empty()) tokens[id] = generated.tokens;
  return tokens;
}

void expect_cache_integrity(const Engine& engine) { EXPECT_NO_THROW(engine.cache().check_integrity()); }

::testing::AssertionResult fixture_exists(const std::filesystem::path& path) {
  if (std::filesystem::exists(path)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "missing test fixture " << path
                                       << " (checked into the repository: restore it)";
}

}  // namespace metrale::testing
