// AsyncEngine: the thread-safe front of the single-threaded Engine. One engine thread owns the
// Engine (and so the device, the scheduler and the caches); any thread may submit requests, cancel
// them and read their tokens back from a per-submission RequestStream.
//
// Nothing blocks the engine thread on a reader: a stream is an unbounded queue that the engine
// thread appends to and the reader drains at its own pace. Submissions go through a queue to the
// engine thread, which validates them (Engine::add_request) and reports the verdict as the first
// event of the stream, so a caller learns of a bad request before it commits to a response.
//
// Admission control: a submission is refused at once (SubmitStatus::kQueueFull) when the requests
// that would have to wait exceed max_queued_requests, so an overloaded server answers 429 instead
// of queueing without bound.
//
// Failures: a request the engine fails (a failed step, see Engine::step) ends its whole group's
// stream with kError(kInternal); the other groups run on. health() says whether the engine still
// serves (EngineHealth): not once it failed for good, or once it is shutting down.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/engine.h"

namespace metrale {

using SteadyClock = std::chrono::steady_clock;

enum class StreamErrorKind {
  kInvalidRequest,  // the engine rejected the request (Engine::add_request threw kInvalidArgument)
  kShuttingDown,    // the engine stopped before the request could run
  kInternal,        // the engine failed while running it
  kUnavailable,     // the engine can no longer serve (Engine::add_request threw kUnavailable)
};

// One event of a stream. A submission of N requests (a group: n choices, several prompts) shares
// one stream; `index` says which request of the group the event belongs to.
struct StreamEvent {
  enum class Kind {
    kAdmitted,  // every request of the group passed validation and is queued in the engine
    kToken,     // a generated token; finish_reason is set when it ends its request
    kFinished,  // a request ended without a token (an abort)
    kError,     // the group was rejected at admission, or the engine failed; ends the stream
  };
  Kind kind = Kind::kToken;
  int32_t index = 0;
  SampledToken sampled;                              // kToken
  std::vector<SampledToken> prompt_logprobs;         // kToken, the first one (Request::prompt_logprobs)
  FinishReason finish_reason = FinishReason::kNone;  // kToken (when it ends the request), kFinished
  StreamErrorKind error_kind = StreamErrorKind::kInternal;  // kError
  std::string error_message;                                // kError
  SteadyClock::time_point time;                             // when the engine thread produced it
};

class RequestStream {
 public:
  RequestStream(int64_t id, size_t num_requests);

  int64_t id() const { return id_; }
  size_t num_requests() const { return num_requests_; }
  SteadyClock::time_point submitted() const { return submitted_; }

  // Waits up to `timeout` for events and returns every queued one, oldest first (empty on timeout
  // or when the stream has ended and is drained).
  std::vector<StreamEvent> wait(std::chrono::milliseconds timeout);
  // Returns every queued event without waiting (empty when none is queued).
  std::vector<StreamEvent> take();
  // True once the engine will add nothing more and every event has been taken.
  bool ended() const;

  // Engine side.
  void push(StreamEvent event);
  void close();

 private:
  const int64_t id_;
  const size_t num_requests_;
  const SteadyClock::time_point submitted_;
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<StreamEvent> events_;
  bool closed_ = false;
};

struct AsyncEngineConfig {
  // Requests that may wait for a running slot (beyond the free slots of --max-num-seqs) before a
  // submission is refused with kQueueFull.
  int64_t max_queued_requests = 1024;
};

struct AsyncEngineStats {
  EngineStats engine;        // as of the end of the last step
  int64_t num_running = 0;   // requests the engine is running
  int64_t num_waiting = 0;   // requests submitted and not yet running (engine queue + hand-over queue)
  // Requests by how they ended.
  int64_t finished_stop = 0;
  int64_t finished_length = 0;
  int64_t finished_abort = 0;
  int64_t failed = 0;          // ended by an engine failure or shutdown
  int64_t rejected = 0;        // failed validation at admission
  int64_t refused_queue_full = 0;
};

enum class SubmitStatus { kAccepted, kQueueFull, kShuttingDown };

struct SubmitResult {
  SubmitStatus status = SubmitStatus::kAccepted;
  std::shared_ptr<RequestStream> stream;  // set when accepted
};

class AsyncEngine {
 public:
  // Starts the engine thread. The engine must be idle (no requests).
  AsyncEngine(std::unique_ptr<Engine> engine, const AsyncEngineConfig& config);
  // Aborts whatever is running and joins the engine thread.
  ~AsyncEngine();
  AsyncEngine(const AsyncEngine&) = delete;
  AsyncEngine& operator=(const AsyncEngine&) = delete;

  // Fixed at construction; safe from any thread.
  const EnginePlan& plan() const { return plan_; }
  const ModelConfig& model_config() const { return model_config_; }
  int32_t max_num_seqs() const { return max_num_seqs_; }
  int64_t max_queued_requests() const { return config_.max_queued_requests; }

  // Queues a group of requests (at least one). The stream's first event is kAdmitted, or kError
  // when any request of the group fails validation (then none of them runs).
  SubmitResult submit(std::vector<Request> requests);
  // Aborts every unfinished request of a stream (or only request `index` of it); each ends with a
  // kFinished(kAbort) event and its cache blocks are freed. Unknown or finished ones are ignored.
  void cancel(int64_t stream_id, int32_t index = -1);

  AsyncEngineStats stats() const;
  // Whether the engine serves, and why not (as of the end of the last step); safe from any thread.
  EngineHealth health() const;

  // Stops the engine thread and joins it. drain: run every accepted request to its end first;
  // otherwise abort them (their streams end with kFinished(kAbort) or kError(kShuttingDown)).
  // New submissions are refused from the moment this is called. Idempotent.
  void shutdown(bool drain);

 private:
  struct Submission {
    std::shared_ptr<RequestStream> stream;
    std::vector<Request> requests;
  };
  struct Group {
    std::shared_ptr<RequestStream> stream;
    std::vector<int64_t> engine_ids;  // by index; finished ones stay listed
    size_t unfinished = 0;
  };
  struct Cancel {
    int64_t stream_id = 0;
    int32_t index = -1;  // -1: the whole group
  };
  struct Owner {
    int64_t stream_id = 0;
    int32_t index = 0;
  };

  void run();                                   // the engine thread
  void admit(std::vector<Submission>& submissions);
  void cancel_requests(const Cancel& cancel);
  void route(const std::vector<TokenEvent>& events);
  // Ends a group's stream with an error and releases its requests (`failed`: those the engine failed).
  void fail_group(int64_t stream_id, StreamErrorKind kind, const std::string& message);
  void fail_all(StreamErrorKind kind, const std::string& message);
  void publish_stats();

  std::unique_ptr<Engine> engine_;
  const AsyncEngineConfig config_;
  const EnginePlan plan_;
  const ModelConfig model_config_;
  const int32_t max_num_seqs_;

  // Shared between submitters and the engine thread.
  mutable std::mutex mutex_;
  std::condition_variable work_ready_;
  std::vector<Submission> inbox_;
  std::vector<Cancel> cancels_;
  int64_t inbox_requests_ = 0;
  int64_t next_stream_id_ = 1;
  bool stop_ = false;
  bool drain_ = false;
  AsyncEngineStats stats_;
  EngineHealth health_;

  // Engine thread only.
  std::unordered_map<int64_t, Group> groups_;  // by stream id
  std::unordered_map<int64_t, Owner> owners_;  // by engine request id
  AsyncEngineStats counters_;                  // finish counters kept by the engine thread

  std::thread thread_;
};

}  // namespace metrale
