// Failure containment (Engine::step) through the fault-injection switch (engine/fault_injection.h):
// for each site, with and without speculation, a fault fails exactly the requests of its step
// (each ends with a kError event, no event after it; at most the two that run at a time, every one
// in progress among them), every other request and every request added
// afterwards gives exactly the greedy tokens it gives without faults, the cache's books balance
// after every step, and the engine keeps serving. A failed recovery leaves an engine that says it
// cannot serve, and why. The expected tokens come from the same engine set-up without faults.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cctype>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>

#include "engine/async_engine.h"
#include "engine/engine.h"
#include "engine/fault_injection.h"
#include "engine/request_helpers.h"
#include "engine/test_models_helpers.h"
#include "model/registry.h"

namespace metrale {
namespace {

using testing::Generated;
using ModelFactory = std::function<std::unique_ptr<Model>()>;

const std::filesystem::path kDemo = std::filesystem::path(METRALE_SOURCE_DIR) / "models" / "demo";

TEST(FaultInjector, ParsesSitesAndThrowsAtTheNthOccurrence) {
  FaultInjector injector = FaultInjector::parse("verify:2, commit:1");
  EXPECT_TRUE(injector.armed());
  EXPECT_EQ(injector.describe(), "verify:2,commit:1");
  EXPECT_NO_THROW(injector.hit(FaultSite::kVerify));
  EXPECT_NO_THROW(injector.hit(FaultSite::kForward));
  EXPECT_THROW(injector.hit(FaultSite::kCommit), Error);
  EXPECT_NO_THROW(injector.hit(FaultSite::kCommit));
  try {
    injector.hit(FaultSite::kVerify);
    ADD_FAILURE() << "the second verify did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInternal);
    EXPECT_NE(std::string(e.what()).find("fault injected at verify (occurrence 2"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(injector.hit(FaultSite::kVerify));
  EXPECT_FALSE(FaultInjector::parse("").armed());
  for (const char* bad : {"verify", "verify:0", "nowhere:1", "forward:x", "sample:1:2"})
    EXPECT_THROW(FaultInjector::parse(bad), Error) << bad;
}

struct FaultSetup {
  std::string name;
  ModelFactory factory;
  SpeculativeMethod method = SpeculativeMethod::kNone;
  int32_t top_logprobs = 0;  // 0: greedy acceptance from argmax rows (and MTP's fixed-layout chain)
  int64_t vocab = 0;
};

// Prompts with repeats (n-gram drafts from the first decode step on).
std::vector<std::vector<int32_t>> prompts(int64_t vocab) {
  std::mt19937_64 rng(29);
  std::vector<std::vector<int32_t>> out;
  for (int p = 0; p < 3; ++p) {
    std::vector<int32_t> phrase(5), prompt;
    for (auto& token : phrase) token = static_cast<int32_t>(3 + rng() % static_cast<uint64_t>(vocab - 3));
    for (int i = 0; i < 3; ++i) prompt.insert(prompt.end(), phrase.begin(), phrase.end());
    prompt.push_back(phrase[0]);
    out.push_back(prompt);
  }
  return out;
}

EngineConfig config_for(const FaultSetup& setup, std::string faults) {
  EngineConfig config;
  config.scheduler.max_num_seqs = 2;  // the third request waits while the first two run
  config.max_model_len = 128;
  config.block_size = 4;
  config.kv_cache_bytes = 64ull << 20;
  config.fault_injection = std::move(faults);
  if (setup.method != SpeculativeMethod::kNone) {
    config.speculative.method = setup.method;
    config.speculative.num_drafts = 3;
    config.speculative.adaptive = false;  // verify whenever there are drafts
  }
  return config;
}

Request greedy(std::vector<int32_t> prompt, int32_t top_logprobs) {
  Request request = testing::make_request(std::move(prompt), 12);
  request.sampling.top_logprobs = top_logprobs;
  return request;
}

struct Outcome {
  std::vector<Generated> requests;  // by the order they were added: A, B, C, then D (A's prompt again)
  EngineStats stats;
  EngineHealth health;
  bool fault_seen = false;
  // The failed step: the requests in progress (admitted, unfinished) when it began.
  std::vector<size_t> in_progress;
};

// A and B run together, C waits for a slot; D (A's prompt) joins after the first failure, or at
// step 3 without one. The cache's books are checked after every step.
Outcome run_requests(const FaultSetup& setup, const std::string& faults) {
  Engine engine(setup.factory(), config_for(setup, faults));
  const auto prompt_set = prompts(setup.vocab);
  std::vector<int64_t> ids;
  for (const auto& prompt : prompt_set) ids.push_back(engine.add_request(greedy(prompt, setup.top_logprobs)));
  std::map<int64_t, Generated> outputs;
  Outcome outcome;
  for (int step = 0; engine.has_unfinished() && step < 2000; ++step) {
    std::vector<size_t> in_progress;
    for (size_t i = 0; i < ids.size(); ++i) {
      const Sequence& sequence = engine.sequence(ids[i]);
      if (!sequence.finished() && sequence.num_computed > 0) in_progress.push_back(i);
    }
    testing::record(engine.step(), outputs);
    testing::expect_cache_integrity(engine);
    const bool failed = std::any_of(outputs.begin(), outputs.end(),
                                    [](const auto& entry) { return entry.second.finish == FinishReason::kError; });
    if (ids.size() == prompt_set.size() && (failed || (faults.empty() && step == 2))) {
      outcome.fault_seen = failed;
      outcome.in_progress = in_progress;
      ids.push_back(engine.add_request(greedy(prompt_set[0], setup.top_logprobs)));
    }
  }
  EXPECT_FALSE(engine.has_unfinished());
  EXPECT_EQ(engine.cache().pool().num_used(), 0) << "finished requests still hold blocks";
  for (const int64_t id : ids) outcome.requests.push_back(outputs[id]);
  outcome.stats = engine.stats();
  outcome.health = engine.health();
  return outcome;
}

void expect_contained(const FaultSetup& setup, FaultSite site, int occurrence, const Outcome& reference) {
  const std::string faults = fmt::format("{}:{}", fault_site_name(site), occurrence);
  const std::string what = setup.name + " " + faults;
  const Outcome outcome = run_requests(setup, faults);
  ASSERT_TRUE(outcome.fault_seen) << what << ": the fault never happened";
  ASSERT_EQ(outcome.requests.size(), 4u) << what;
  ASSERT_EQ(reference.requests.size(), 4u);
  int failed = 0;
  for (const size_t i : outcome.in_progress) {
    EXPECT_EQ(outcome.requests[i].finish, FinishReason::kError) << what << ": request " << i << " was in the failed step";
  }
  for (size_t i = 0; i < outcome.requests.size(); ++i) {
    const Generated& got = outcome.requests[i];
    const Generated& expected = reference.requests[i];
    EXPECT_EQ(got.events_after_finish, 0) << what << ", request " << i;
    if (got.finish == FinishReason::kError) {
      ++failed;
      EXPECT_LT(i, 3u) << what << ": the request added after the failure failed";
      EXPECT_NE(got.error.find("fault injected at " + std::string(fault_site_name(site))), std::string::npos)
          << what << ": " << got.error;
      // What it emitted before its step failed is the start of what it emits without faults.
      ASSERT_LE(got.tokens.size(), expected.tokens.size()) << what;
      EXPECT_TRUE(std::equal(got.tokens.begin(), got.tokens.end(), expected.tokens.begin())) << what << ", request " << i;
      continue;
    }
    EXPECT_EQ(got.finish, FinishReason::kLength) << what << ", request " << i;
    EXPECT_EQ(got.tokens, expected.tokens) << what << ", request " << i;
  }
  // The step's requests: those in progress, and those it admitted (two run at a time).
  EXPECT_GE(failed, std::max<int>(1, static_cast<int>(outcome.in_progress.size()))) << what;
  EXPECT_LE(failed, 2) << what;
  EXPECT_EQ(outcome.stats.failed_requests, failed) << what;
  EXPECT_EQ(outcome.stats.failed_steps, 1) << what;
  EXPECT_TRUE(outcome.health.serving) << what << ": " << outcome.health.reason;
}

std::unique_ptr<Model> tiny_qwen3() {
  static const std::filesystem::path dir = testing::write_tiny_qwen3({}, "fault_injection");
  return load_model(dir, Device::cpu());
}

std::unique_ptr<Model> demo() { return load_model(kDemo, Device::cpu()); }

std::vector<FaultSetup> setups() {
  const auto fake_hybrid = [] { return testing::make_fake_hybrid_model({}); };
  return {
      {"qwen3 plain", tiny_qwen3, SpeculativeMethod::kNone, 2, 96},
      {"qwen3 ngram", tiny_qwen3, SpeculativeMethod::kNgram, 0, 96},
      {"qwen3 ngram top-logprobs", tiny_qwen3, SpeculativeMethod::kNgram, 2, 96},
      {"fake hybrid ngram", fake_hybrid, SpeculativeMethod::kNgram, 0, 61},
      {"demo mtp", demo, SpeculativeMethod::kMtp, 0, 8192},
      {"demo mtp top-logprobs", demo, SpeculativeMethod::kMtp, 2, 8192},
  };
}

class FaultContainment : public ::testing::TestWithParam<size_t> {};

TEST_P(FaultContainment, FailsTheStepsRequestsAndServesOn) {
  const FaultSetup setup = setups()[GetParam()];
  if (setup.method == SpeculativeMethod::kMtp) {
    ASSERT_TRUE(testing::fixture_exists(kDemo / "model.safetensors"));
  }
  const Outcome reference = run_requests(setup, "");
  ASSERT_FALSE(reference.fault_seen);
  for (const Generated& generated : reference.requests) ASSERT_EQ(generated.finish, FinishReason::kLength);
  if (setup.method != SpeculativeMethod::kNone) {
    ASSERT_GT(reference.stats.verify_steps, 1) << setup.name << ": the set-up must verify drafts";
  }
  std::vector<std::pair<FaultSite, int>> sites = {{FaultSite::kForward, 1}, {FaultSite::kForward, 3},
                                                  {FaultSite::kSample, 2}};
  if (setup.method != SpeculativeMethod::kNone) {
    sites.insert(sites.end(), {{FaultSite::kVerify, 1}, {FaultSite::kVerify, 2}, {FaultSite::kCommit, 2}});
  }
  if (setup.method == SpeculativeMethod::kMtp) sites.insert(sites.end(), {{FaultSite::kMtp, 1}, {FaultSite::kMtp, 3}});
  for (const auto& [site, occurrence] : sites) expect_contained(setup, site, occurrence, reference);
}

INSTANTIATE_TEST_SUITE_P(Models, FaultContainment, ::testing::Range<size_t>(0, 6), [](const auto& param_info) {
  std::string name = setups()[param_info.param].name;
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return name;
});

// A recovery that fails leaves an engine that cannot serve: every request fails with the reason,
// new ones are refused, and health() says why.
TEST(FaultContainment, AFailedRecoveryStopsServingAndSaysWhy) {
  const FaultSetup setup{"qwen3", tiny_qwen3, SpeculativeMethod::kNone, 0, 96};
  Engine engine(setup.factory(), config_for(setup, "forward:2,recover:1"));
  for (const auto& prompt : prompts(96)) engine.add_request(greedy(prompt, 0));
  const auto outputs = testing::run_to_completion(engine);
  ASSERT_EQ(outputs.size(), 3u);
  for (const auto& [id, generated] : outputs) {
    EXPECT_EQ(generated.finish, FinishReason::kError) << "request " << id;
    EXPECT_NE(generated.error.find("can no longer serve"), std::string::npos) << generated.error;
  }
  EXPECT_FALSE(engine.health().serving);
  EXPECT_NE(engine.health().reason.find("fault injected at recover"), std::string::npos) << engine.health().reason;
  EXPECT_NE(engine.health().reason.find("fault injected at forward"), std::string::npos) << engine.health().reason;
  EXPECT_THROW(engine.add_request(greedy(prompts(96)[0], 0)), Error);
}

// The same through the engine thread: a failed request's stream ends with an error, the next
// submission gets the tokens it gets alone, and health() follows the engine.
TEST(FaultContainment, AsyncEngineReportsTheFailureAndItsHealth) {
  using namespace std::chrono_literals;
  const FaultSetup setup{"qwen3", tiny_qwen3, SpeculativeMethod::kNone, 0, 96};
  const std::vector<int32_t> prompt = prompts(96)[1];
  std::vector<int32_t> alone;
  {
    Engine engine(setup.factory(), config_for(setup, ""));
    const int64_t id = engine.add_request(greedy(prompt, 0));
    alone = testing::run_to_completion(engine)[id].tokens;
  }
  const auto drain = [](RequestStream& stream, std::vector<int32_t>& tokens) -> std::optional<StreamEvent> {
    std::optional<StreamEvent> error;
    const auto deadline = SteadyClock::now() + 60s;
    while (!stream.ended() && SteadyClock::now() < deadline) {
      for (StreamEvent& event : stream.wait(100ms)) {
        if (event.kind == StreamEvent::Kind::kToken) tokens.push_back(event.sampled.token);
        if (event.kind == StreamEvent::Kind::kError) error = event;
      }
    }
    EXPECT_TRUE(stream.ended());
    return error;
  };
  for (const char* faults : {"forward:2", "forward:2,recover:1"}) {
    const bool recovers = std::string(faults).find("recover") == std::string::npos;
    AsyncEngine engine(std::make_unique<Engine>(setup.factory(), config_for(setup, faults)), {});
    EXPECT_TRUE(engine.health().serving);
    std::vector<int32_t> tokens;
    const auto error = drain(*engine.submit({greedy(prompt, 0)}).stream, tokens);
    ASSERT_TRUE(error.has_value()) << faults;
    EXPECT_EQ(error->error_kind, StreamErrorKind::kInternal);
    EXPECT_NE(error->error_message.find("fault injected at forward"), std::string::npos) << error->error_message;
    EXPECT_EQ(engine.health().serving, recovers) << faults;
    tokens.clear();
    const auto second = drain(*engine.submit({greedy(prompt, 0)}).stream, tokens);
    if (recovers) {
      EXPECT_FALSE(second.has_value()) << second->error_message;
      EXPECT_EQ(tokens, alone);
    } else {
      ASSERT_TRUE(second.has_value());
      EXPECT_NE(second->error_message.find("can no longer serve"), std::string::npos) << second->error_message;
      EXPECT_NE(engine.health().reason.find("fault injected at recover"), std::string::npos) << engine.health().reason;
    }
    engine.shutdown(/*drain=*/false);
    EXPECT_FALSE(engine.health().serving);
  }
}

}  // namespace
}  // namespace metrale
