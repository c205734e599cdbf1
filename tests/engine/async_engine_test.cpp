// AsyncEngine on a tiny random model: requests submitted from many threads get the tokens the
// single-threaded Engine gives them alone; admission reports validation errors on the stream; a
// group is all or nothing; cancel frees the cache; a full queue refuses; shutdown drains or aborts.
#include "engine/async_engine.h"

#include <gtest/gtest.h>

#include <map>
#include <thread>

#include "engine/request_helpers.h"
#include "engine/test_models_helpers.h"
#include "model/registry.h"

namespace metrale {
namespace {

using testing::make_request;
using testing::TinyQwen3Options;
using testing::write_tiny_qwen3;
using namespace std::chrono_literals;

const std::filesystem::path& model_dir() {
  static const std::filesystem::path dir = write_tiny_qwen3(TinyQwen3Options{}, "async_engine");
  return dir;
}

std::unique_ptr<Engine> make_engine(EngineConfig config = {}) {
  return std::make_unique<Engine>(load_model(model_dir(), Device::cpu()), config);
}

// Everything a stream delivered, per request index.
struct Collected {
  std::vector<StreamEvent> events;
  std::map<int32_t, std::vector<int32_t>> tokens;
  std::map<int32_t, FinishReason> finish;
  bool admitted = false;
  std::optional<StreamEvent> error;
};

// Reads a stream to its end (or fails the test after 60 s).
Collected collect(RequestStream& stream, int stop_after_tokens = -1, std::function<void()> on_stop = nullptr) {
  Collected collected;
  const auto deadline = SteadyClock::now() + 60s;
  int seen = 0;
  while (!stream.ended()) {
    if (SteadyClock::now() > deadline) {
      ADD_FAILURE() << "stream " << stream.id() << " did not end";
      break;
    }
    for (StreamEvent& event : stream.wait(100ms)) {
      switch (event.kind) {
        case StreamEvent::Kind::kAdmitted: collected.admitted = true; break;
        case StreamEvent::Kind::kToken:
          collected.tokens[event.index].push_back(event.sampled.token);
          if (++seen == stop_after_tokens && on_stop) on_stop();
          [[fallthrough]];
        case StreamEvent::Kind::kFinished:
          if (event.finish_reason != FinishReason::kNone) collected.finish[event.index] = event.finish_reason;
          break;
        case StreamEvent::Kind::kError: collected.error = event; break;
      }
      collected.events.push_back(std::move(event));
    }
  }
  return collected;
}

// The tokens a request gets when it runs alone in a fresh engine.
std::vector<int32_t> run_alone(const Request& request) {
  auto engine = make_engine();
  const int64_t id = engine->add_request(request);
  return testing::run_to_completion(*engine)[id].tokens;
}

void wait_until(const std::function<bool()>& condition) {
  const auto deadline = SteadyClock::now() + 30s;
  while (!condition()) {
    ASSERT_LT(SteadyClock::now(), deadline) << "condition never became true";
    std::this_thread::sleep_for(5ms);
  }
}

TEST(AsyncEngine, ThreadsGetTheTokensOfRequestsRunAlone) {
  std::vector<Request> requests;
  for (int i = 0; i < 12; ++i) {
    std::vector<int32_t> prompt;
    for (int j = 0; j <= i % 5 + 2; ++j) prompt.push_back((i * 13 + j * 7) % 90 + 3);
    requests.push_back(make_request(prompt, 6 + i % 4, i % 2 ? 0.8f : 0.0f, 100 + i));
  }
  std::vector<std::vector<int32_t>> alone;
  for (const Request& request : requests) alone.push_back(run_alone(request));

  AsyncEngine engine(make_engine(), AsyncEngineConfig{});
  std::vector<std::vector<int32_t>> together(requests.size());
  std::vector<std::thread> threads;
  for (size_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < requests.size(); i += 4) {
        SubmitResult result = engine.submit({requests[i]});
        ASSERT_EQ(result.status, SubmitStatus::kAccepted);
        Collected collected = collect(*result.stream);
        EXPECT_TRUE(collected.admitted);
        EXPECT_EQ(collected.finish[0], FinishReason::kLength);
        together[i] = collected.tokens[0];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (size_t i = 0; i < requests.size(); ++i) EXPECT_EQ(together[i], alone[i]) << "request " << i;

  // Counters are published after the events of a step are routed: wait for them.
  wait_until([&] { return engine.stats().finished_length == static_cast<int64_t>(requests.size()); });
  const AsyncEngineStats stats = engine.stats();
  EXPECT_EQ(stats.engine.kv_blocks_used, 0);
  EXPECT_EQ(stats.num_running, 0);
  EXPECT_EQ(stats.num_waiting, 0);
  EXPECT_GT(stats.engine.generated_tokens, 0);
}

TEST(AsyncEngine, GroupEventsCarryTheirIndex) {
  AsyncEngine engine(make_engine(), AsyncEngineConfig{});
  std::vector<Request> group = {make_request({5, 6, 7}, 3), make_request({8, 9}, 5, 0.9f, 1),
                                make_request({5, 6, 7}, 4)};
  SubmitResult result = engine.submit(group);
  ASSERT_EQ(result.status, SubmitStatus::kAccepted);
  EXPECT_EQ(result.stream->num_requests(), 3u);
  const Collected collected = collect(*result.stream);
  ASSERT_FALSE(collected.events.empty());
  EXPECT_EQ(collected.events.front().kind, StreamEvent::Kind::kAdmitted);
  EXPECT_EQ(collected.tokens.at(0).size(), 3u);
  EXPECT_EQ(collected.tokens.at(1).size(), 5u);
  EXPECT_EQ(collected.tokens.at(2).size(), 4u);
  // The same greedy prompt: one is a prefix of the other.
  EXPECT_TRUE(std::equal(collected.tokens.at(0).begin(), collected.tokens.at(0).end(), collected.tokens.at(2).begin()));
  EXPECT_EQ(collected.tokens.at(1), run_alone(group[1]));
  for (int32_t i = 0; i < 3; ++i) EXPECT_EQ(collected.finish.at(i), FinishReason::kLength);
  // Event times never go backwards.
  for (size_t i = 1; i < collected.events.size(); ++i) EXPECT_LE(collected.events[i - 1].time, collected.events[i].time);
}

TEST(AsyncEngine, InvalidRequestRejectsItsWholeGroup) {
  AsyncEngine engine(make_engine(), AsyncEngineConfig{});
  SubmitResult result = engine.submit({make_request({5, 6}, 4), make_request({5, 1000}, 4)});  // 1000 >= vocab
  ASSERT_EQ(result.status, SubmitStatus::kAccepted);
  const Collected rejected = collect(*result.stream);
  ASSERT_TRUE(rejected.error.has_value());
  EXPECT_EQ(rejected.error->error_kind, StreamErrorKind::kInvalidRequest);
  EXPECT_NE(rejected.error->error_message.find("vocabulary"), std::string::npos) << rejected.error->error_message;
  EXPECT_FALSE(rejected.admitted);
  EXPECT_TRUE(rejected.tokens.empty());
  SubmitResult empty = engine.submit({make_request({}, 4)});
  EXPECT_TRUE(collect(*empty.stream).error.has_value());

  // The engine keeps serving.
  SubmitResult next = engine.submit({make_request({5, 6}, 4)});
  const Collected served = collect(*next.stream);
  EXPECT_EQ(served.tokens.at(0).size(), 4u);
  wait_until([&] { return engine.stats().rejected == 3 && engine.stats().engine.kv_blocks_used == 0; });
}

TEST(AsyncEngine, CancelAbortsAndFreesTheCache) {
  AsyncEngine engine(make_engine(), AsyncEngineConfig{});
  SubmitResult result = engine.submit({make_request({5, 6, 7, 8}, 100000), make_request({9, 10}, 100000)});
  ASSERT_EQ(result.status, SubmitStatus::kAccepted);
  const int64_t stream_id = result.stream->id();
  // Cancel request 1 alone after a few tokens, then the whole group.
  int tokens_seen = 0;
  std::vector<StreamEvent> events;
  bool cancelled_one = false;
  const auto deadline = SteadyClock::now() + 30s;
  while (!result.stream->ended() && SteadyClock::now() < deadline) {
    for (StreamEvent& event : result.stream->wait(50ms)) {
      if (event.kind == StreamEvent::Kind::kToken) ++tokens_seen;
      events.push_back(std::move(event));
    }
    if (tokens_seen >= 6 && !cancelled_one) {
      engine.cancel(stream_id, 1);
      cancelled_one = true;
    }
    const bool one_done = std::any_of(events.begin(), events.end(), [](const StreamEvent& e) {
      return e.index == 1 && e.finish_reason == FinishReason::kAbort;
    });
    if (one_done) engine.cancel(stream_id);
  }
  ASSERT_TRUE(result.stream->ended());
  int aborted = 0;
  for (const StreamEvent& event : events) {
    if (event.kind == StreamEvent::Kind::kFinished) {
      EXPECT_EQ(event.finish_reason, FinishReason::kAbort);
      ++aborted;
    }
  }
  EXPECT_EQ(aborted, 2);
  wait_until([&] { return engine.stats().finished_abort == 2; });
  EXPECT_EQ(engine.stats().engine.kv_blocks_used, 0);
  EXPECT_EQ(engine.stats().num_running, 0);
  engine.cancel(stream_id);  // a finished stream: ignored
  engine.cancel(12345);      // an unknown one too
}

TEST(AsyncEngine, FullQueueRefuses) {
  EngineConfig config;
  config.scheduler.max_num_seqs = 1;
  AsyncEngineConfig async_config;
  async_config.max_queued_requests = 1;
  AsyncEngine engine(make_engine(config), async_config);
  EXPECT_EQ(engine.max_num_seqs(), 1);
  SubmitResult running = engine.submit({make_request({5, 6}, 100000)});
  ASSERT_EQ(running.status, SubmitStatus::kAccepted);
  // Wait for its first token: it holds the only running slot.
  bool has_token = false;
  while (!has_token) {
    for (const StreamEvent& event : running.stream->wait(1s)) has_token |= event.kind == StreamEvent::Kind::kToken;
  }
  SubmitResult waiting = engine.submit({make_request({7, 8}, 4)});
  EXPECT_EQ(waiting.status, SubmitStatus::kAccepted);
  SubmitResult refused = engine.submit({make_request({9}, 4)});
  EXPECT_EQ(refused.status, SubmitStatus::kQueueFull);
  EXPECT_EQ(refused.stream, nullptr);
  EXPECT_EQ(engine.submit({make_request({9}, 4), make_request({9}, 4)}).status, SubmitStatus::kQueueFull);
  wait_until([&] { return engine.stats().num_waiting == 1 && engine.stats().num_running == 1; });
  EXPECT_EQ(engine.stats().refused_queue_full, 2);

  engine.cancel(running.stream->id());
  const Collected second = collect(*waiting.stream);  // runs once the slot is free
  EXPECT_EQ(second.tokens.at(0).size(), 4u);
  collect(*running.stream);
  EXPECT_EQ(engine.submit({make_request({9}, 2)}).status, SubmitStatus::kAccepted);
}

TEST(AsyncEngine, ShutdownAbortsRunningRequests) {
  AsyncEngine engine(make_engine(), AsyncEngineConfig{});
  SubmitResult result = engine.submit({make_request({5, 6, 7}, 100000)});
  ASSERT_EQ(result.status, SubmitStatus::kAccepted);
  while (result.stream->wait(1s).empty()) {
  }
  engine.shutdown(/*drain=*/false);
  const Collected collected = collect(*result.stream);
  EXPECT_EQ(collected.finish.at(0), FinishReason::kAbort);
  EXPECT_EQ(engine.submit({make_request({5}, 2)}).status, SubmitStatus::kShuttingDown);
  engine.shutdown(/*drain=*/false);  // idempotent
}

TEST(AsyncEngine, ShutdownDrainFinishesAcceptedRequests) {
  auto engine = std::make_unique<AsyncEngine>(make_engine(), AsyncEngineConfig{});
  SubmitResult a = engine->submit({make_request({5, 6, 7}, 8)});
  SubmitResult b = engine->submit({make_request({9, 10}, 5, 0.7f, 3)});
  engine->shutdown(/*drain=*/true);
  const Collected first = collect(*a.stream);
  const Collected second = collect(*b.stream);
  EXPECT_EQ(first.tokens.at(0).size(), 8u);
  EXPECT_EQ(second.tokens.at(0), run_alone(make_request({9, 10}, 5, 0.7f, 3)));
  EXPECT_EQ(first.finish.at(0), FinishReason::kLength);
  engine.reset();  // the destructor after an explicit shutdown joins nothing twice
}

TEST(RequestStream, TakeReturnsQueuedEventsWithoutWaiting) {
  RequestStream stream(7, 1);
  EXPECT_TRUE(stream.take().empty());
  StreamEvent first;
  first.kind = StreamEvent::Kind::kToken;
  first.index = 0;
  StreamEvent second = first;
  second.index = 1;
  stream.push(first);
  stream.push(second);
  const std::vector<StreamEvent> taken = stream.take();
  ASSERT_EQ(taken.size(), 2u);
  EXPECT_EQ(taken[0].index, 0);
  EXPECT_EQ(taken[1].index, 1);
  EXPECT_TRUE(stream.take().empty());
  EXPECT_FALSE(stream.ended());
  stream.close();
  EXPECT_TRUE(stream.ended());
}

}  // namespace
}  // namespace metrale
