// Speculative decoding through the engine (engine/speculator.h): greedy outputs identical with and
// without drafts (n-gram and MTP) on every architecture, with prefix hits, chunked prefill,
// preemption and several sequences batched; sampled outputs with the distribution of plain
// sampling; the recurrent state after verify + commit equal to plain decoding's; plausible
// acceptance of the demo model's MTP head.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <span>

#include "engine/engine.h"
#include "engine/request_helpers.h"
#include "engine/speculator.h"
#include "model/config.h"
#include "model/registry.h"
#include "runtime/buffer.h"
#include "runtime/stream.h"
#include "test_models_helpers.h"

namespace metrale {

// Reaches into the engine for tests that need a decision the controller would not make.
class EngineTestAccess {
 public:
  static void run_plain(Engine& engine, int64_t steps) { engine.speculative_->force_plain_steps(steps); }
  static bool mtp_stash_empty(const Engine& engine) { return engine.speculative_->mtp_stash_empty(); }
  static void run_ragged(Engine& engine, int64_t steps) { engine.speculative_->force_ragged_steps(steps); }
};

namespace {

// The unoptimised ASan+UBSan build checks memory, which few runs exercise as well as many: there the
// demo-model tests run one engine setup and the statistical test only a handful of samples (the
// Release run checks the statistics).
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitizedBuild = true;
#else
constexpr bool kSanitizedBuild = false;
#endif

const std::filesystem::path kGoldens = std::filesystem::path(METRALE_TEST_DATA_DIR) / "goldens";
const std::filesystem::path kDemo = std::filesystem::path(METRALE_SOURCE_DIR) / "models" / "demo";

using testing::Generated;
using testing::record;

// Steps `engine` until every request finished; `outputs` may hold the events of earlier steps.
std::map<int64_t, Generated> run(Engine& engine, std::map<int64_t, Generated> outputs = {}) {
  outputs = testing::run_to_completion(engine, {}, std::move(outputs));
  EXPECT_NO_THROW(engine.cache().check_integrity());
  EXPECT_EQ(engine.cache().pool().num_used(), 0);
  return outputs;
}

// Greedy requests report top logprobs by default, which keeps acceptance on the host (whole logits
// rows); with top_logprobs 0 a fixed-layout verify accepts from its argmax rows and MTP drafts in
// one chained step (Engine::accept_greedy_rows, Engine::run_mtp_drafter_fixed).
Request greedy(std::vector<int32_t> prompt, int32_t max_tokens, int32_t top_logprobs = 3) {
  Request request = testing::make_request(std::move(prompt), max_tokens);
  request.sampling.top_logprobs = top_logprobs;
  return request;
}

// Prompts with repeats, so that n-gram lookup finds drafts; the second shares a long prefix with the
// first (a prefix hit when both run in one engine).
std::vector<std::vector<int32_t>> prompts(int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto random = [&](size_t count) {
    std::vector<int32_t> tokens(count);
    for (auto& token : tokens) token = static_cast<int32_t>(3 + rng() % static_cast<uint64_t>(vocab - 3));
    return tokens;
  };
  std::vector<std::vector<int32_t>> out;
  std::vector<int32_t> phrase = random(6);
  std::vector<int32_t> first = random(5);
  for (int i = 0; i < 4; ++i) first.insert(first.end(), phrase.begin(), phrase.end());
  out.push_back(first);
  std::vector<int32_t> second(first.begin(), first.begin() + 20);
  const auto tail = random(7);
  second.insert(second.end(), tail.begin(), tail.end());
  out.push_back(second);
  out.push_back(random(11));
  std::vector<int32_t> fourth = random(3);
  for (int i = 0; i < 3; ++i) fourth.insert(fourth.end(), phrase.begin() + 2, phrase.end());
  out.push_back(fourth);
  return out;
}

using ModelFactory = std::function<std::unique_ptr<Model>()>;

// Variants of the engine set-up a speculative run must not be able to tell apart.
struct EngineSetup {
  const char* name;
  bool prefix_caching;
  int32_t num_kv_blocks;  // 0: planned; small: preemption
  int32_t max_prefill_chunk;
  int32_t max_num_batched_tokens;
  uint64_t swap_space_bytes = 0;  // > 0: preemption swaps to the host tier
};

constexpr EngineSetup kSetups[] = {
    {"batched+prefix", true, 0, 0, 2048},
    {"chunked", false, 0, 5, 2048},
    {"tight-budget+preemption", false, 14, 0, 12},
    {"tight-budget+swap", false, 14, 0, 12, 64ull << 20},
};

// `plain_every` > 0: every that many steps the next half of them run plain with the MTP head off
// (EngineTestAccess), whatever the controller would choose. `ragged`: every verify runs in the
// ragged layout with per-sequence draft counts (EngineTestAccess::run_ragged).
std::map<int64_t, Generated> generate(const ModelFactory& factory, const EngineSetup& setup,
                                      SpeculativeConfig speculative,
                                      const std::vector<std::vector<int32_t>>& prompt_set, int32_t max_tokens,
                                      EngineStats* stats = nullptr, int32_t top_logprobs = 3,
                                      Device device = Device::cpu(), int32_t plain_every = 0, bool ragged = false,
                                      const std::function<void(Request&)>& adjust = {}) {
  EngineConfig config;
  config.enable_prefix_caching = setup.prefix_caching;
  config.num_kv_blocks = setup.num_kv_blocks;
  config.swap_space_bytes = setup.swap_space_bytes;
  config.scheduler.preemption_mode = PreemptionMode::kSwap;
  config.block_size = 4;
  config.scheduler.max_prefill_chunk = setup.max_prefill_chunk;
  config.scheduler.max_num_batched_tokens = setup.max_num_batched_tokens;
  config.scheduler.max_num_seqs = 8;
  config.max_model_len = 256;
  config.speculative = speculative;
  if (device.is_cuda()) {
    config.num_kv_blocks = setup.num_kv_blocks > 0 ? setup.num_kv_blocks : 512;
    config.gpu_memory_utilization = 0.5;
  }
  Engine engine(factory(), config);
  if (ragged) EngineTestAccess::run_ragged(engine, int64_t{1} << 40);
  std::vector<int64_t> ids;
  std::map<int64_t, Generated> early;  // events of the steps before the last request is added
  for (const auto& prompt : prompt_set) {
    Request request = greedy(prompt, max_tokens, top_logprobs);
    if (adjust) adjust(request);
    ids.push_back(engine.add_request(request));
    // The second request shares the first's prefix: admit it after the first has cached it.
    if (setup.prefix_caching && ids.size() == 1) {
      for (int i = 0; i < 3; ++i) record(engine.step(), early);
    }
  }
  for (int step = 0; plain_every > 0 && engine.has_unfinished() && step < 20000; ++step) {
    if (step % plain_every == 0) EngineTestAccess::run_plain(engine, plain_every / 2);
    record(engine.step(), early);
  }
  auto outputs = run(engine, std::move(early));
  if (stats) *stats = engine.stats();
  std::map<int64_t, Generated> by_index;
  for (size_t i = 0; i < ids.size(); ++i) by_index[static_cast<int64_t>(i)] = outputs[ids[i]];
  return by_index;
}

void expect_same(const std::map<int64_t, Generated>& actual, const std::map<int64_t, Generated>& expected,
                 const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (const auto& [index, generated] : expected) {
    const Generated& other = actual.at(index);
    EXPECT_EQ(other.tokens, generated.tokens) << what << ", request " << index;
    ASSERT_EQ(other.logprobs.size(), generated.logprobs.size()) << what << ", request " << index;
    for (size_t i = 0; i < generated.logprobs.size(); ++i)
      EXPECT_NEAR(other.logprobs[i], generated.logprobs[i], 2e-3) << what << ", request " << index << " logprob " << i;
  }
}

SpeculativeConfig spec_config(SpeculativeMethod method, int32_t drafts, bool adaptive = false) {
  SpeculativeConfig config;
  config.method = method;
  config.num_drafts = drafts;
  config.ngram_min = 1;
  config.ngram_max = 3;
  config.adaptive = adaptive;
  return config;
}

ModelFactory golden_model(const std::string& name) {
  return [name] { return load_model(kGoldens / name / "model", Device::cpu()); };
}

bool can_verify(const Model& model) { return model.capabilities().supports_verify; }

// ---- Unit pieces

TEST(StepCostFeature, RoutedWeightsGrowWithTheRowsUntilEveryExpertIsRead) {
  ASSERT_TRUE(testing::fixture_exists(kGoldens / "qwen3_tied" / "model"));
  ASSERT_TRUE(testing::fixture_exists(kGoldens / "qwen3_moe" / "model"));
  // A dense model reads all its weights for any row.
  const auto dense = golden_model("qwen3_tied")();
  EXPECT_EQ(dense->routed_weight_bytes(1), 0.0);
  EXPECT_EQ(dense->routed_weight_bytes(64), 0.0);
  // One row selects top_k of E experts per MoE layer; many rows every expert.
  const auto moe = golden_model("qwen3_moe")();
  const ModelConfig& c = moe->config();
  const auto experts = static_cast<double>(c.get_int("num_local_experts", c.get_int("num_experts", 0)));
  const auto top_k = static_cast<double>(c.get_int("num_experts_per_tok"));
  ASSERT_GT(experts, top_k);
  const double one = moe->routed_weight_bytes(1), two = moe->routed_weight_bytes(2);
  const double all = moe->routed_weight_bytes(1 << 20);
  EXPECT_GT(one, 0.0);
  EXPECT_NEAR(one / all, top_k / experts, 1e-9);
  EXPECT_GT(two, one);
  EXPECT_LT(two, 2.0 * one);  // two rows share some experts
  EXPECT_NEAR(moe->routed_weight_bytes(4096) / all, 1.0, 1e-9);
}

TEST(NgramDrafter, ProposesWhatFollowedTheLatestLongestMatch) {
  // Suffix [7, 8] occurs at 1 and 5; the latest earlier one (5) is followed by 4, 7, 8.
  const std::vector<int32_t> tokens = {1, 7, 8, 2, 3, 7, 8, 4, 7, 8};
  EXPECT_EQ(propose_ngram_drafts(tokens, 1, 3, 2), (std::vector<int32_t>{4, 7}));
  // Longest first: [4, 7, 8] never occurred earlier, [7, 8] did.
  EXPECT_EQ(propose_ngram_drafts(tokens, 2, 3, 5), (std::vector<int32_t>{4, 7, 8}));
  EXPECT_TRUE(propose_ngram_drafts(std::vector<int32_t>{1, 2, 3, 4}, 1, 3, 4).empty());
  // Near the end fewer tokens follow.
  EXPECT_EQ(propose_ngram_drafts(std::vector<int32_t>{5, 6, 5}, 1, 1, 4), (std::vector<int32_t>{6, 5}));
}

// Rejection sampling reproduces p whatever q is: the exact output probabilities, integrated over a
// fine grid of both uniforms.
TEST(RejectionSampling, OutputFollowsTheTargetDistribution) {
  const std::vector<float> p = {0.5f, 0.2f, 0.3f, 0.0f};
  const std::vector<std::vector<float>> qs = {{}, {0.1f, 0.6f, 0.2f, 0.1f}, {0.5f, 0.2f, 0.3f, 0.0f}};
  for (const auto& q : qs) {
    for (int32_t draft = 0; draft < 3; ++draft) {
      const double draft_q = q.empty() ? 1.0 : q[static_cast<size_t>(draft)];
      std::vector<double> mass(p.size(), 0.0);
      constexpr int kGrid = 400;
      for (int a = 0; a < kGrid; ++a) {
        for (int b = 0; b < kGrid; ++b) {
          bool accepted = false;
          const int32_t token = rejection_sample(p, q, draft, (a + 0.5f) / kGrid, (b + 0.5f) / kGrid, accepted);
          mass[static_cast<size_t>(token)] += 1.0 / (kGrid * kGrid);
        }
      }
      // With drafts drawn from q, the output is sum_d q(d) P(token | d); with a one-hot q it is P(token | d).
      (void)draft_q;
      if (q.empty()) {
        for (size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(mass[i], p[i], 4e-3) << "one-hot draft " << draft << " token " << i;
      }
    }
    if (!q.empty()) {
      std::vector<double> total(p.size(), 0.0);
      for (int32_t draft = 0; draft < 4; ++draft) {
        constexpr int kGrid = 300;
        for (int a = 0; a < kGrid; ++a) {
          for (int b = 0; b < kGrid; ++b) {
            bool accepted = false;
            const int32_t token = rejection_sample(p, q, draft, (a + 0.5f) / kGrid, (b + 0.5f) / kGrid, accepted);
            total[static_cast<size_t>(token)] += q[static_cast<size_t>(draft)] / (kGrid * kGrid);
          }
        }
      }
      for (size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(total[i], p[i], 5e-3) << "token " << i;
    }
  }
}

// ---- Greedy equivalence

// Each case: the golden model's factory and the prompts every test of the suite feeds it; cases whose
// recurrent layers cannot verify are skipped, a missing fixture fails.
class GreedyEquivalence : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    name = GetParam();
    ASSERT_TRUE(testing::fixture_exists(kGoldens / name / "model"));
    factory = golden_model(name);
    const auto probe = factory();
    if (!can_verify(*probe)) GTEST_SKIP() << name << ": the model's recurrent layers cannot verify yet";
    prompt_set = prompts(probe->config().vocab_size, 11);
  }

  std::string name;
  ModelFactory factory;
  std::vector<std::vector<int32_t>> prompt_set;
};

TEST_P(GreedyEquivalence, NgramGivesThePlainTokens) {
  for (const EngineSetup& setup : kSetups) {
    const auto plain = generate(factory, setup, {}, prompt_set, 14);
    const auto plain_argmax = generate(factory, setup, {}, prompt_set, 14, nullptr, 0);
    for (const int32_t drafts : {1, 3}) {
      EngineStats stats;
      const auto spec = generate(factory, setup, spec_config(SpeculativeMethod::kNgram, drafts), prompt_set, 14, &stats);
      expect_same(spec, plain, name + " " + setup.name + " ngram k=" + std::to_string(drafts));
      // Acceptance from the verify's argmax rows (no top logprobs asked).
      const auto argmax =
          generate(factory, setup, spec_config(SpeculativeMethod::kNgram, drafts), prompt_set, 14, nullptr, 0);
      expect_same(argmax, plain_argmax, name + " " + setup.name + " ngram argmax k=" + std::to_string(drafts));
      EXPECT_GT(stats.drafted_tokens, 0) << setup.name;
      EXPECT_GT(stats.verify_steps, 0) << setup.name;
      EXPECT_LE(stats.accepted_tokens, stats.drafted_tokens);
      if (std::string(setup.name) == "tight-budget+preemption") {
        EXPECT_GT(stats.num_preemptions, 0);
      }
    }
  }
}

TEST_P(GreedyEquivalence, NgramInTheRaggedLayoutGivesThePlainTokens) {
  // Per-sequence draft counts (0 included) without padding rows, as the controller's ragged layout
  // and its probes run them.
  const EngineSetup& setup = kSetups[0];
  const auto plain = generate(factory, setup, {}, prompt_set, 14);
  EngineStats stats;
  const auto ragged = generate(factory, setup, spec_config(SpeculativeMethod::kNgram, 3), prompt_set, 14, &stats, 3,
                               Device::cpu(), 0, /*ragged=*/true);
  expect_same(ragged, plain, name + " ngram ragged");
  EXPECT_GT(stats.verify_steps, 0);
  // The adaptive controller (with the model's cost feature) decides its own layouts: same tokens.
  const auto adaptive =
      generate(factory, setup, spec_config(SpeculativeMethod::kNgram, 3, /*adaptive=*/true), prompt_set, 14);
  expect_same(adaptive, plain, name + " ngram adaptive");
}

TEST_P(GreedyEquivalence, NgramSamplesWhatPlainDecodingSamples) {
  // Sampled requests: each verify row draws with plain decoding's uniform for its token and keeps
  // a draft when the draw is the draft, so the seeded output is plain decoding's, token for token
  // (on the device path without top logprobs, and on the host path with them).
  uint64_t next_seed = 100;
  const auto sampled = [&next_seed](Request& request) {
    request.sampling.temperature = 0.8f;
    request.sampling.top_p = 0.95f;
    request.sampling.seed = next_seed++;
  };
  const EngineSetup& setup = kSetups[0];
  for (const int32_t top_logprobs : {0, 2}) {
    next_seed = 100;
    const auto plain = generate(factory, setup, {}, prompt_set, 14, nullptr, top_logprobs, Device::cpu(), 0, false,
                                sampled);
    next_seed = 100;
    EngineStats stats;
    const auto spec = generate(factory, setup, spec_config(SpeculativeMethod::kNgram, 3), prompt_set, 14, &stats,
                               top_logprobs, Device::cpu(), 0, false, sampled);
    expect_same(spec, plain, name + " sampled ngram, top logprobs " + std::to_string(top_logprobs));
    EXPECT_GT(stats.verify_steps, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Goldens, GreedyEquivalence,
                         ::testing::Values("qwen3_tied", "qwen3_untied", "qwen3_moe", "qwen3_next", "qwen3_5",
                                           "qwen3_5_moe", "qwen4_exp", "glm5_next"));

// A tiny random glm5_next (KDA, DSA with a full and a shared indexer, dense and MoE layers, mHC
// streams) with its MTP head: n-gram and MTP speculation give the plain tokens, through prefix hits
// (the latent, indexer and pool blocks shared, the KDA slots restored), chunked prefill and
// preemption; DSA is sparse beyond position index_topk + kp - 2 = 10.
ModelFactory tiny_glm5_next() {
  return [] {
    const nlohmann::json config = {
        {"model_type", "glm5_next_text"}, {"vocab_size", 61}, {"hidden_size", 32}, {"num_hidden_layers", 4},
        {"num_attention_heads", 2}, {"q_lora_rank", 16}, {"kv_lora_rank", 16}, {"qk_nope_head_dim", 8},
        {"qk_rope_head_dim", 0}, {"v_head_dim", 8}, {"index_n_heads", 8}, {"index_head_dim", 8},
        {"index_topk", 8}, {"index_kpool", 4}, {"linear_num_heads", 2}, {"linear_head_dim", 8},
        {"intermediate_size", 40}, {"moe_intermediate_size", 12}, {"n_routed_experts", 4},
        {"num_experts_per_tok", 2}, {"n_shared_experts", 1},
        {"layer_types", {"linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention",
                         "linear_attention"}},
        {"mlp_layer_types", {"dense", "sparse", "dense", "sparse"}}, {"index_topk_pattern", "FFSF"},
        {"num_nextn_predict_layers", 1}, {"max_position_embeddings", 512}, {"eos_token_id", 2}};
    return make_random_model(parse_model_config(config, "/virtual/glm5_next/config.json"), Device::cpu(), 9);
  };
}

TEST(SpeculativeGlm5Next, NgramAndMtpGiveThePlainTokens) {
  const ModelFactory factory = tiny_glm5_next();
  const auto probe = factory();
  ASSERT_TRUE(can_verify(*probe));
  ASSERT_TRUE(probe->has_mtp());
  auto prompt_set = prompts(probe->config().vocab_size, 13);
  // The second prompt extends the whole first one, past its state checkpoint (its last block
  // boundary): a prefix hit restores the KDA slots as well as the paged DSA caches.
  prompt_set[1] = prompt_set[0];
  prompt_set[1].insert(prompt_set[1].end(), {5, 9, 14, 22, 31});
  const std::span<const EngineSetup> setups(kSetups, kSanitizedBuild ? 1 : std::size(kSetups));
  for (const EngineSetup& setup : setups) {
    EngineStats plain_stats;
    const auto plain = generate(factory, setup, {}, prompt_set, 14, &plain_stats);
    if (setup.prefix_caching) {
      EXPECT_GT(plain_stats.prefix_cache_hits, 0) << setup.name;
      EXPECT_GT(plain_stats.hybrid_state_restores, 0) << setup.name;
    }
    if (std::string(setup.name) == "tight-budget+preemption") {
      EXPECT_GT(plain_stats.num_preemptions, 0);
    }
    if (setup.swap_space_bytes > 0) {
      EXPECT_GT(plain_stats.swapped_out_sequences, 0) << setup.name;
      EXPECT_GT(plain_stats.swapped_out_slots, 0) << setup.name;  // the KDA slots travel too
    }
    for (const auto method : {SpeculativeMethod::kNgram, SpeculativeMethod::kMtp}) {
      const std::string what = std::string("glm5_next ") + setup.name + " " + std::string(speculative_method_name(method));
      EngineStats stats;
      const auto spec = generate(factory, setup, spec_config(method, 3), prompt_set, 14, &stats);
      expect_same(spec, plain, what);
      EXPECT_GT(stats.verify_steps, 0) << what;
    }
  }
}

// The engine's own test model with exact integer state (tests/engine/test_models_helpers.h): it
// throws when a slot does not hold the state of exactly the sequence's cached tokens, so a commit
// that kept a rejected draft's state cannot go unnoticed.
TEST(SpeculativeEngine, FakeHybridKeepsExactStateThroughVerifies) {
  const ModelFactory factory = [] { return testing::make_fake_hybrid_model({}); };
  const auto probe = factory();
  if (!can_verify(*probe)) GTEST_SKIP() << "the fake hybrid model has no verify support";
  const auto prompt_set = prompts(probe->config().vocab_size, 5);
  for (const EngineSetup& setup : kSetups) {
    const auto plain = generate(factory, setup, {}, prompt_set, 20);
    EngineStats stats;
    const auto spec = generate(factory, setup, spec_config(SpeculativeMethod::kNgram, 4), prompt_set, 20, &stats);
    expect_same(spec, plain, std::string("fake hybrid ") + setup.name);
    EXPECT_GT(stats.drafted_tokens, 0) << setup.name;
    // This model's text never repeats, so n-gram drafts are all rejected. Replayed acceptance
    // (benchmark mode: drafts kept at random, outputs no longer the model's) exercises every kept
    // count; the model throws on the first step whose slot is not the state of its cached tokens.
    SpeculativeConfig replay = spec_config(SpeculativeMethod::kNgram, 4);
    replay.replay_accept_rate = 0.6;
    EngineStats replay_stats;
    EXPECT_NO_THROW(generate(factory, setup, replay, prompt_set, 20, &replay_stats)) << setup.name;
    EXPECT_GT(replay_stats.accepted_tokens, 0) << setup.name;
    EXPECT_LT(replay_stats.accepted_tokens, replay_stats.drafted_tokens) << setup.name;
    // The same through acceptance from the verify's argmax rows and the fixed-layout commit.
    EngineStats argmax_stats;
    EXPECT_NO_THROW(generate(factory, setup, replay, prompt_set, 20, &argmax_stats, 0)) << setup.name;
    EXPECT_GT(argmax_stats.accepted_tokens, 0) << setup.name;
  }
}

// ---- The demo model: n-gram and MTP

// The demo model is checked in: a test that needs it fails without it.
::testing::AssertionResult have_demo() { return testing::fixture_exists(kDemo / "model.safetensors"); }

std::vector<std::vector<int32_t>> demo_prompts() {
  // Token ids of the demo tokenizer are not needed: any ids are valid input, and repeats help n-gram.
  return prompts(8192, 3);
}

TEST(SpeculativeDemo, NgramAndMtpGiveThePlainTokens) {
  ASSERT_TRUE(have_demo());
  const ModelFactory factory = [] { return load_model(kDemo, Device::cpu()); };
  const auto probe = factory();
  if (!can_verify(*probe)) GTEST_SKIP() << "qwen3_5's recurrent layers cannot verify yet";
  const auto prompt_set = demo_prompts();
  const std::span<const EngineSetup> setups(kSetups, kSanitizedBuild ? 1 : std::size(kSetups));
  for (const EngineSetup& setup : setups) {
    if (setup.swap_space_bytes > 0) continue;  // the tiny models cover swapping; the demo model is slow
    const auto plain = generate(factory, setup, {}, prompt_set, 16);
    const auto plain_argmax = generate(factory, setup, {}, prompt_set, 16, nullptr, 0);
    for (const auto method : {SpeculativeMethod::kNgram, SpeculativeMethod::kMtp}) {
      const std::string what = std::string("demo ") + setup.name + " " + std::string(speculative_method_name(method));
      EngineStats stats;
      const auto spec = generate(factory, setup, spec_config(method, 3), prompt_set, 16, &stats);
      expect_same(spec, plain, what);
      EXPECT_GT(stats.verify_steps, 0);
      // Argmax-row acceptance and (MTP) the fixed-layout draft chain.
      EngineStats argmax_stats;
      const auto argmax = generate(factory, setup, spec_config(method, 3), prompt_set, 16, &argmax_stats, 0);
      expect_same(argmax, plain_argmax, what + " argmax");
      EXPECT_GT(argmax_stats.verify_steps, 0);
      if (method == SpeculativeMethod::kMtp) {
        // The chained drafts are the head's: it accepts about as often as the host-side chain.
        EXPECT_GT(argmax_stats.accepted_tokens, stats.accepted_tokens / 2) << what;
        // The head paused every few steps: its keys stashed or written at once, flushed before it
        // runs again, across prefix hits, chunked prefill and preemption.
        const auto paused = generate(factory, setup, spec_config(method, 3), prompt_set, 16, nullptr, 0, Device::cpu(),
                                     /*plain_every=*/6);
        expect_same(paused, plain_argmax, what + " paused");
      }
    }
  }
}

// The demo's MTP head was trained for one step: about 0.65 of single drafts are accepted on its
// own text (models/demo/README.md). Greedy continuations of a held-out snippet.
TEST(SpeculativeDemo, MtpAcceptanceIsPlausible) {
  ASSERT_TRUE(have_demo());
  auto model = load_model(kDemo, Device::cpu());
  if (!can_verify(*model)) GTEST_SKIP() << "qwen3_5's recurrent layers cannot verify yet";
  // The reference snippet's ids (train_log.json reference.input_ids) would be ideal; prompts from
  // the model's own greedy text serve as well: run plain first, then continue from its output.
  EngineConfig config;
  config.speculative = spec_config(SpeculativeMethod::kMtp, 1);
  config.max_model_len = 512;
  Engine engine(std::move(model), config);
  std::vector<int64_t> ids;
  for (int i = 0; i < 4; ++i) {
    Request request = greedy({static_cast<int32_t>(100 + 37 * i), static_cast<int32_t>(200 + 11 * i), 300}, 48);
    ids.push_back(engine.add_request(request));
  }
  run(engine);
  const EngineStats stats = engine.stats();
  ASSERT_GT(stats.drafted_tokens, 50);
  const double rate = static_cast<double>(stats.accepted_tokens) / static_cast<double>(stats.drafted_tokens);
  EXPECT_GT(rate, 0.35) << stats.accepted_tokens << " of " << stats.drafted_tokens;
  EXPECT_LE(rate, 1.0);
}

// While the MTP head is off (plain steps) the engine writes only its keys: decode steps' in batches
// from the stash (here also when the stash fills), prefill steps' at once. When the head runs again
// its cache must hold what it would have written itself had it never stopped (up to the rounding of
// the trunk's hidden states, which verify and decode rows compute in different shapes).
void expect_mtp_keys_while_head_off_equal_the_heads(Device device, double tolerance) {
  struct Run {
    std::vector<int32_t> tokens;
    std::vector<float> keys, values;  // the MTP layer's cache rows of positions [0, computed)
    int64_t computed = 0;
  };
  const std::vector<int32_t> prompt = {100, 237, 311, 17, 42, 42, 9, 640, 55, 1200, 3, 77, 8, 19, 260, 14, 90, 5};
  const auto generate_with = [&](bool pauses) {
    EngineConfig config;
    config.speculative = spec_config(SpeculativeMethod::kMtp, 2);
    config.max_model_len = 256;
    config.scheduler.max_num_seqs = 1;            // a stash of 16 rows: a 20-step pause fills it
    config.scheduler.max_num_batched_tokens = 8;  // a prompt of three prefill steps
    config.kv_cache_bytes = 64ull << 20;
    auto model = load_model(kDemo, device);
    const size_t mtp_cache = model->cache_specs().size();
    Engine engine(std::move(model), config);
    const int64_t id = engine.add_request(greedy(prompt, 200, 0));
    if (pauses) EngineTestAccess::run_plain(engine, 2);  // the first two prefill steps
    std::map<int64_t, Generated> outputs;
    for (int step = 0; step < 400; ++step) {
      if (pauses && step == 10) EngineTestAccess::run_plain(engine, 5);
      if (pauses && step == 24) EngineTestAccess::run_plain(engine, 20);
      record(engine.step(), outputs);
      if (engine.sequence(id).num_output() >= 60 && EngineTestAccess::mtp_stash_empty(engine) && step > 50) break;
    }
    Run result;
    result.tokens = outputs[id].tokens;
    const Sequence& sequence = engine.sequence(id);
    EXPECT_FALSE(sequence.finished());
    EXPECT_EQ(sequence.mtp_missed, 0);
    result.computed = sequence.mtp_computed;
    const BlockCache& cache = engine.cache().block_caches()[mtp_cache];
    const Tensor& keys = cache.tensors[0];  // {k, v} per token
    const auto table = engine.cache().block_table(id);
    const int64_t block_size = keys.size(1), row = keys.size(2) * keys.size(3);
    const size_t row_bytes = static_cast<size_t>(row) * keys.element_size();
    std::vector<char> bytes(row_bytes);
    const auto read_row = [&](const Tensor& tensor, int64_t slot, std::vector<float>& into) {
      copy_bytes(bytes.data(), Device::cpu(), static_cast<const char*>(tensor.data()) + slot * row_bytes,
                 tensor.device(), row_bytes);
      for (int64_t i = 0; i < row; ++i)
        into.push_back(load_as_f32(tensor.dtype(), bytes.data(), static_cast<size_t>(i)));
    };
    for (int64_t p = 0; p < result.computed; ++p) {
      const int64_t slot = table[static_cast<size_t>(p / block_size)] * block_size + p % block_size;
      read_row(cache.tensors[0], slot, result.keys);
      read_row(cache.tensors[1], slot, result.values);
    }
    return result;
  };
  const Run head = generate_with(false), paused = generate_with(true);
  const size_t n = std::min(head.tokens.size(), paused.tokens.size());
  ASSERT_GE(n, 60u);
  const auto prefix = [n](const std::vector<int32_t>& tokens) {
    return std::vector<int32_t>(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(n));
  };
  // bf16 verify and decode rows may round a near-tie the other way (see below): keys are compared
  // up to the first differing token.
  size_t same = 0;
  while (same < n && head.tokens[same] == paused.tokens[same]) ++same;
  if (device.is_cpu()) {
    EXPECT_EQ(prefix(paused.tokens), prefix(head.tokens));
  }
  const int64_t positions = std::min({head.computed, paused.computed, static_cast<int64_t>(prompt.size() + same)});
  ASSERT_GT(positions, static_cast<int64_t>(prompt.size()) + (device.is_cpu() ? 50 : 10));
  const size_t width = head.keys.size() / static_cast<size_t>(head.computed);
  double worst = 0.0;
  for (size_t i = 0; i < static_cast<size_t>(positions) * width; ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(head.keys[i] - paused.keys[i])));
    worst = std::max(worst, static_cast<double>(std::abs(head.values[i] - paused.values[i])));
  }
  EXPECT_LT(worst, tolerance) << "MTP keys over " << positions << " positions";
  ::testing::Test::RecordProperty("worst_mtp_key_difference", std::to_string(worst));
}

TEST(SpeculativeDemo, MtpKeysWrittenWhileTheHeadIsOffEqualTheHeads) {
  ASSERT_TRUE(have_demo());
  expect_mtp_keys_while_head_off_equal_the_heads(Device::cpu(), 1e-3);
}

// ---- The GPU: verify, commit and MTP graphs

// Greedy tokens with speculation against plain decoding on the GPU. bf16 steps of different shapes
// (a verify row against a decode row) may round a near-tie the other way, so a request may diverge,
// but only where plain decoding's two best tokens are within `tie` of each other (logprob); after
// that point the two continuations are unrelated and are not compared.
void expect_same_up_to_near_ties(const std::map<int64_t, Generated>& spec,
                                 const std::map<int64_t, Generated>& plain_top2, const std::string& what,
                                 int* diverged) {
  constexpr double tie = 0.1;
  for (const auto& [index, reference] : plain_top2) {
    const std::vector<int32_t>& tokens = spec.at(index).tokens;
    // Plain runs report [logprob, top-1, top-2] per token.
    ASSERT_EQ(reference.logprobs.size(), 3 * reference.tokens.size()) << what;
    const size_t n = std::min(tokens.size(), reference.tokens.size());
    size_t i = 0;
    while (i < n && tokens[i] == reference.tokens[i]) ++i;
    if (i == n) {
      EXPECT_EQ(tokens.size(), reference.tokens.size()) << what << ", request " << index;
      continue;
    }
    ++*diverged;
    const double gap = reference.logprobs[3 * i + 1] - reference.logprobs[3 * i + 2];
    EXPECT_LT(gap, tie) << what << ", request " << index << " diverges at token " << i << " where plain decoding's "
                        << "best token leads by " << gap;
  }
}

TEST(SpeculativeGpu, GraphedVerifyAndMtpGiveThePlainTokens) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  // Every model is a checked-in fixture: a missing one fails the test rather than shrinking it.
  ASSERT_TRUE(have_demo());
  std::vector<std::pair<std::string, ModelFactory>> models;
  models.emplace_back("demo", [] { return load_model(kDemo, Device::cuda(0)); });
  for (const char* name : {"qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"}) {
    ASSERT_TRUE(testing::fixture_exists(kGoldens / name / "model"));
    models.emplace_back(name, [name] { return load_model(kGoldens / name / "model", Device::cuda(0)); });
  }
  for (const auto& [name, factory] : models) {
    const auto probe = factory();
    const bool mtp = probe->has_mtp();
    const auto prompt_set = prompts(probe->config().vocab_size, 17);
    for (const EngineSetup& setup : kSetups) {
      const auto plain = generate(factory, setup, {}, prompt_set, 24, nullptr, 2, Device::cuda(0));
      int diverged = 0, runs = 0;
      for (const auto method : {SpeculativeMethod::kNgram, SpeculativeMethod::kMtp}) {
        if (method == SpeculativeMethod::kMtp && !mtp) continue;
        for (const int32_t drafts : {1, 3}) {
          const std::string what = name + " " + setup.name + " " + std::string(speculative_method_name(method)) +
                                   " k=" + std::to_string(drafts);
          EngineStats stats;
          const auto spec =
              generate(factory, setup, spec_config(method, drafts), prompt_set, 24, &stats, 0, Device::cuda(0));
          expect_same_up_to_near_ties(spec, plain, what, &diverged);
          EXPECT_GT(stats.verify_steps, 0) << what;
          runs += static_cast<int>(prompt_set.size());
        }
      }
      EXPECT_LE(diverged, runs / 4) << name << " " << setup.name << ": too many near-tie divergences";
    }
  }
}

TEST(SpeculativeGpu, MtpKeysWrittenWhileTheHeadIsOffEqualTheHeads) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  ASSERT_TRUE(have_demo());
  // bf16 keys (|k| up to ~10 after the norm's weight) from hidden states that verify and decode
  // rows round differently; a wrong row or position differs by whole units.
  expect_mtp_keys_while_head_off_equal_the_heads(Device::cuda(0), 0.25);
}

// ---- Sampling: the distribution with speculation is the model's

// Joint counts of the first three sampled tokens over many seeds.
std::map<std::vector<int32_t>, int> sample_counts(const ModelFactory& factory, SpeculativeConfig speculative,
                                                  const std::vector<int32_t>& prompt, int runs, uint64_t seed_base,
                                                  int32_t top_k = 3) {
  EngineConfig config;
  config.speculative = speculative;
  config.scheduler.max_num_seqs = 64;
  config.max_model_len = 128;
  config.enable_prefix_caching = true;
  Engine engine(factory(), config);
  std::map<int64_t, std::vector<int32_t>> outputs;
  for (int i = 0; i < runs; ++i) {
    Request request;
    request.prompt = prompt;
    request.max_tokens = 3;
    request.ignore_eos = true;
    request.sampling.temperature = 0.9f;
    request.sampling.top_k = top_k;
    request.sampling.seed = seed_base + static_cast<uint64_t>(i);
    engine.add_request(request);
  }
  for (int guard = 0; engine.has_unfinished() && guard < 100000; ++guard)
    for (const TokenEvent& event : engine.step())
      if (event.sampled.token >= 0) outputs[event.request_id].push_back(event.sampled.token);
  std::map<std::vector<int32_t>, int> counts;
  for (const auto& [id, tokens] : outputs) ++counts[tokens];
  return counts;
}

double total_variation(const std::map<std::vector<int32_t>, int>& a, const std::map<std::vector<int32_t>, int>& b,
                       int runs) {
  std::map<std::vector<int32_t>, double> difference;
  for (const auto& [key, count] : a) difference[key] += count;
  for (const auto& [key, count] : b) difference[key] -= count;
  double total = 0.0;
  for (const auto& [key, value] : difference) total += std::abs(value);
  return total / (2.0 * runs);
}

TEST(SpeculativeSampling, NgramKeepsTheSampledDistribution) {
  // A tiny vocabulary and top-k 3: few outcomes, so the joint law of three tokens is measurable.
  testing::TinyQwen3Options options;
  options.vocab_size = 12;
  const auto dir = testing::write_tiny_qwen3(options, "speculative_sampling");
  const ModelFactory factory = [dir] { return load_model(dir, Device::cpu()); };
  // A prompt of repeats: n-gram drafts for every step.
  const std::vector<int32_t> prompt = {3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4};
  constexpr int kRuns = 4000;
  const auto plain = sample_counts(factory, {}, prompt, kRuns, 1000);
  const auto plain_again = sample_counts(factory, {}, prompt, kRuns, 900000);
  const auto spec = sample_counts(factory, spec_config(SpeculativeMethod::kNgram, 3), prompt, kRuns, 500000);
  // At most 27 outcomes: two independent samples of 4000 differ by about sqrt(27 / 4000) / 2 in TV.
  const double noise = total_variation(plain, plain_again, kRuns);
  const double tv = total_variation(spec, plain, kRuns);
  EXPECT_LT(tv, 0.06) << "plain vs plain: " << noise;
  // The check can fail: a sampler that always took the draft would move mass by far more.
  EXPECT_LT(noise, 0.06);
}

TEST(SpeculativeSampling, MtpKeepsTheSampledDistribution) {
  ASSERT_TRUE(have_demo());
  const ModelFactory factory = [] { return load_model(kDemo, Device::cpu()); };
  if (!can_verify(*factory())) GTEST_SKIP() << "qwen3_5's recurrent layers cannot verify yet";
  const std::vector<int32_t> prompt = {100, 200, 300, 400, 500};
  const int runs = kSanitizedBuild ? 20 : 600;
  const auto plain = sample_counts(factory, {}, prompt, runs, 1000, 2);
  const auto spec = sample_counts(factory, spec_config(SpeculativeMethod::kMtp, 2), prompt, runs, 700000, 2);
  if (kSanitizedBuild) GTEST_SKIP() << "statistics need the Release run's 600 samples";
  // At most 8 outcomes (top-k 2): two independent samples of 600 differ by about 0.065 in TV.
  EXPECT_LT(total_variation(spec, plain, runs), 0.12);
}

// ---- Recurrent state after verify + commit equals plain decoding's

std::vector<std::vector<float>> slot_states(const Engine& engine, int64_t seq_id) {
  std::vector<std::vector<float>> out;
  const int32_t slot = engine.cache().state_slot(seq_id);
  if (slot < 0) return out;
  const auto caches = engine.cache().block_caches();
  for (size_t i = 0; i < caches.size(); ++i) {
    for (size_t j = 0; j < caches[i].tensors.size(); ++j) {
      const Tensor& state = caches[i].tensors[j];
      if (engine.cache().specs()[i].tensors[j].paged() || state.dtype() != DType::kF32) continue;
      const int64_t per_slot = state.numel() / state.size(0);
      std::vector<float> host(static_cast<size_t>(per_slot));
      synchronize(state.device());
      copy_bytes(host.data(), Device::cpu(), state.data_as<const float>() + slot * per_slot, state.device(),
                 host.size() * sizeof(float));
      out.push_back(std::move(host));
    }
  }
  return out;
}

TEST(SpeculativeEngine, RecurrentStateAfterVerifyEqualsPlainDecoding) {
  for (const std::string name : {"qwen3_5", "qwen3_next"}) {
    ASSERT_TRUE(testing::fixture_exists(kGoldens / name / "model"));
    const ModelFactory factory = golden_model(name);
    if (!can_verify(*factory())) GTEST_SKIP() << name << ": recurrent layers cannot verify yet";
    const auto prompt = prompts(factory()->config().vocab_size, 21).front();
    // Step the speculative engine until its sequence reaches some length, then run a plain engine
    // to the same tokens (as a prompt: same state by the prefill/decode equivalence) and compare.
    EngineConfig config;
    config.enable_prefix_caching = false;
    config.speculative = spec_config(SpeculativeMethod::kNgram, 4);
    Engine spec(factory(), config);
    const int64_t id = spec.add_request(greedy(prompt, 40));
    int verifies_seen = 0;
    for (int guard = 0; guard < 200 && spec.has_unfinished() && verifies_seen < 6; ++guard) {
      const int64_t before = spec.stats().verify_steps;
      spec.step();
      if (spec.stats().verify_steps == before || !spec.has_unfinished()) continue;
      ++verifies_seen;
      const Sequence& sequence = spec.sequence(id);
      std::vector<int32_t> computed(sequence.tokens.begin(), sequence.tokens.begin() + sequence.num_computed);
      // Plain decoding of the same tokens: prompt = the first token, then force the rest one by one
      // is what a greedy run does only when the tokens are its own; they are (greedy equivalence),
      // so decode plainly to the same length.
      EngineConfig plain_config;
      plain_config.enable_prefix_caching = false;
      Engine plain(factory(), plain_config);
      const int64_t plain_id = plain.add_request(greedy(prompt, 40));
      while (plain.has_unfinished() && plain.sequence(plain_id).num_computed < sequence.num_computed) plain.step();
      ASSERT_EQ(plain.sequence(plain_id).num_computed, sequence.num_computed) << name;
      const auto expected = slot_states(plain, plain_id);
      const auto actual = slot_states(spec, id);
      ASSERT_EQ(actual.size(), expected.size());
      ASSERT_FALSE(expected.empty());
      for (size_t s = 0; s < expected.size(); ++s) {
        ASSERT_EQ(actual[s].size(), expected[s].size());
        for (size_t i = 0; i < expected[s].size(); ++i)
          ASSERT_NEAR(actual[s][i], expected[s][i], 1e-4) << name << " state " << s << " element " << i;
      }
    }
    EXPECT_GT(verifies_seen, 0) << name;
  }
}

}  // namespace
}  // namespace metrale
