// The prefill budget (engine/prefill_budget.h) from synthetic step timings, and the scheduler's
// prefill limit: a step with decode rows carries at most the limit's prefill tokens; a step
// without decode rows is not limited.
#include "engine/prefill_budget.h"

#include <gtest/gtest.h>

#include <deque>
#include <memory>
#include <vector>

#include "cache/cache_manager.h"
#include "common/cache_specs.h"
#include "engine/scheduler.h"

namespace metrale {
namespace {

TEST(PrefillBudget, UnmeasuredStepsAreNotLimited) {
  PrefillBudget budget(3.0, 256, 8192);
  EXPECT_EQ(budget.limit(0), 8192);
  EXPECT_EQ(budget.limit(64), 8192);
  budget.record(64, 0, 0.020);  // decode measured, prefill cost not yet
  EXPECT_EQ(budget.limit(64), 8192);
  EXPECT_LT(budget.seconds_per_prefill_token(), 0.0);
}

TEST(PrefillBudget, LimitKeepsTheMixedStepWithinTheRatio) {
  PrefillBudget budget(3.0, 256, 8192);
  // Decode-only steps of 64 sequences: 20 ms. Mixed steps: 20 ms + 10 us per prefill token.
  for (int i = 0; i < 20; ++i) budget.record(64, 0, 0.020);
  for (int i = 0; i < 20; ++i) budget.record(64, 4096, 0.020 + 4096 * 10e-6);
  EXPECT_NEAR(budget.decode_seconds(64), 0.020, 1e-9);
  EXPECT_NEAR(budget.seconds_per_prefill_token(), 10e-6, 1e-9);
  // 3 x 20 ms allows 40 ms of prefill: 4000 tokens.
  EXPECT_NEAR(static_cast<double>(budget.limit(64)), 4000.0, 1.0);
  // Buckets: 33..64 sequences share the measurement; an unmeasured bucket takes the nearest one.
  EXPECT_NEAR(static_cast<double>(budget.limit(40)), 4000.0, 1.0);
  EXPECT_NEAR(static_cast<double>(budget.limit(3)), 4000.0, 1.0);
  // Steps without decode rows: no limit.
  EXPECT_EQ(budget.limit(0), 8192);
}

TEST(PrefillBudget, SlowPrefillStillGetsTheMinimumAndCheapPrefillTheWholeBudget) {
  PrefillBudget slow(2.0, 256, 8192);
  slow.record(8, 0, 0.001);
  slow.record(8, 1000, 1.001);  // 1 ms per token: 1 ms of room would allow 1 token
  EXPECT_EQ(slow.limit(8), 256);
  PrefillBudget cheap(4.0, 256, 8192);
  cheap.record(8, 0, 0.010);
  cheap.record(8, 8192, 0.011);
  EXPECT_EQ(cheap.limit(8), 8192);
  // Garbage timings are ignored.
  cheap.record(8, 100, -1.0);
  cheap.record(8, 100, std::numeric_limits<double>::infinity());
  EXPECT_EQ(cheap.limit(8), 8192);
}

std::unique_ptr<Sequence> make_sequence(int64_t id, int64_t prompt, int64_t computed) {
  auto sequence = std::make_unique<Sequence>();
  sequence->id = id;
  sequence->arrival = id;
  sequence->tokens.assign(static_cast<size_t>(prompt), 7);
  sequence->num_prompt = prompt;
  sequence->num_computed = computed;
  return sequence;
}

TEST(SchedulerPrefillLimit, CutsPrefillOnlyWhenSomeSequenceDecodes) {
  const std::vector<CacheSpec> specs = {testing::keys_and_values(1, 4)};
  for (const bool with_decoder : {true, false}) {
    SCOPED_TRACE(with_decoder ? "a decoding sequence runs" : "nothing decodes");
    CacheManager cache(specs, CacheConfig{4, 256}, Device::cpu());
    Scheduler scheduler(SchedulerConfig{8, 1024, 0});
    scheduler.set_prefill_limit(100);
    std::vector<std::unique_ptr<Sequence>> owned;
    std::vector<Sequence*> running;
    std::deque<Sequence*> waiting;
    if (with_decoder) {
      // A running sequence whose prompt of 9 tokens is cached but for its last: it decodes.
      owned.push_back(make_sequence(1, 9, 0));
      waiting.push_back(owned.back().get());
      SchedulePlan first = scheduler.schedule(running, waiting, cache);
      ASSERT_EQ(first.chunks.size(), 1u);
      owned.back()->num_computed = 8;
    }
    owned.push_back(make_sequence(2, 300, 0));
    waiting.push_back(owned.back().get());
    owned.push_back(make_sequence(3, 300, 0));
    waiting.push_back(owned.back().get());
    const SchedulePlan plan = scheduler.schedule(running, waiting, cache);
    int64_t prefill = 0, decode = 0;
    for (const ScheduledChunk& chunk : plan.chunks) (chunk.decodes() ? decode : prefill) += chunk.num_new;
    if (with_decoder) {
      EXPECT_EQ(decode, 1);
      EXPECT_EQ(prefill, 100);  // the first prompt's chunk is cut to the limit; the second waits
      EXPECT_EQ(waiting.size(), 1u);
    } else {
      EXPECT_EQ(decode, 0);
      EXPECT_EQ(prefill, 600);  // both prompts whole, under the token budget
      EXPECT_TRUE(waiting.empty());
    }
  }
}

}  // namespace
}  // namespace metrale
