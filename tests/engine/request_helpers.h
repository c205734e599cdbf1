// Requests as the engine tests build them, and the one loop that runs them.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/request.h"

namespace metrale::testing {

// A request that generates exactly `max_tokens` tokens (EOS ignored): greedy at temperature 0, else
// sampled with `seed` (none: the engine draws one).
Request make_request(std::vector<int32_t> prompt, int32_t max_tokens, float temperature = 0.0f,
                     std::optional<uint64_t> seed = std::nullopt);

// Everything the engine emitted for one request.
struct Generated {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;  // per token: its logprob, then its top logprobs
  FinishReason finish = FinishReason::kNone;
  std::string error;            // FinishReason::kError
  int64_t events_after_finish = 0;  // events that followed the finishing one (none expected)
  bool operator==(const Generated&) const = default;
};

// The tokens, for test messages.
void PrintTo(const Generated& generated, std::ostream* out);

void record(const std::vector<TokenEvent>& events, std::map<int64_t, Generated>& outputs);
// Steps `engine` until every request finished (the test fails after `max_steps`), recording into
// `outputs` (which may hold the events of earlier steps); `after_step` runs after every step. The
// loop stops at the first step that fails the test.
std::map<int64_t, Generated> run_to_completion(Engine& engine, const std::function<void(const Engine&)>& after_step = {},
                                               std::map<int64_t, Generated> outputs = {}, int max_steps = 20000);
// The generated tokens of each request that generated any.
std::map<int64_t, std::vector<int32_t>> tokens_of(const std::map<int64_t, Generated>& outputs);
// A check for after_step: the cache's books balance.
void expect_cache_integrity(const Engine& engine);

// A fixture checked into the repository (a model directory, a golden case): the test fails,
// naming it, when it is missing, rather than passing having checked nothing.
::testing::AssertionResult fixture_exists(const std::filesystem::path& path);

}  // namespace metrale::testing
