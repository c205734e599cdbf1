#include "engine/async_engine.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "core/error.h"
#include "core/log.h"
#include "runtime/stream.h"

namespace metrale {

RequestStream::RequestStream(int64_t id, size_t num_requests)
    : id_(id), num_requests_(num_requests), submitted_(SteadyClock::now()) {}

std::vector<StreamEvent> RequestStream::wait(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  ready_.wait_for(lock, timeout, [&] { return !events_.empty() || closed_; });
  std::vector<StreamEvent> taken(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  return taken;
}

std::vector<StreamEvent> RequestStream::take() {
  std::lock_guard lock(mutex_);
  std::vector<StreamEvent> taken(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  return taken;
}

bool RequestStream::ended() const {
  std::lock_guard lock(mutex_);
  return closed_ && events_.empty();
}

void RequestStream::push(StreamEvent event) {
  {
    std::lock_guard lock(mutex_);
    events_.push_back(std::move(event));
  }
  ready_.notify_all();
}

void RequestStream::close() {
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
  }
  ready_.notify_all();
}

namespace {

StreamEvent make_event(StreamEvent::Kind kind, int32_t index) {
  StreamEvent event;
  event.kind = kind;
  event.index = index;
  event.time = SteadyClock::now();
  return event;
}

StreamEvent make_error(StreamErrorKind kind, std::string message) {
  StreamEvent event = make_event(StreamEvent::Kind::kError, -1);
  event.error_kind = kind;
  event.error_message = std::move(message);
  return event;
}

}  // namespace

AsyncEngine::AsyncEngine(std::unique_ptr<Engine> engine, const AsyncEngineConfig& config)
    : engine_(std::move(engine)),
      config_(config),
      plan_(engine_->plan()),
      model_config_(engine_->model().config()),
      // The planner may run fewer sequences than configured when memory is short.
      max_num_seqs_(plan_.max_num_seqs > 0 ? plan_.max_num_seqs
                                           : static_cast<int32_t>(engine_->runner().limits().max_num_seqs)) {
  if (config_.max_queued_requests < 1)
    raise(ErrorCode::kInvalidArgument, "max queued requests must be at least 1, got {}", config_.max_queued_requests);
  METRALE_CHECK(!engine_->has_unfinished(), "the engine handed to AsyncEngine has {} requests",
                engine_->num_running() + engine_->num_waiting());
  stats_.engine = engine_->stats();
  thread_ = std::thread([this] { run(); });
}

AsyncEngine::~AsyncEngine() { shutdown(/*drain=*/false); }

SubmitResult AsyncEngine::submit(std::vector<Request> requests) {
  if (requests.empty()) raise(ErrorCode::kInvalidArgument, "a submission needs at least one request");
  const auto count = static_cast<int64_t>(requests.size());
  SubmitResult result;
  {
    std::lock_guard lock(mutex_);
    if (stop_) {
      result.status = SubmitStatus::kShuttingDown;
      return result;
    }
    // Requests wait when no running slot is free; at most max_queued_requests of them may.
    const int64_t free_slots = std::max<int64_t>(0, max_num_seqs_ - stats_.num_running - stats_.num_waiting);
    const int64_t waiting_after = std::max<int64_t>(0, stats_.num_waiting + count - free_slots);
    if (waiting_after > config_.max_queued_requests) {
      ++stats_.refused_queue_full;
      result.status = SubmitStatus::kQueueFull;
      return result;
    }
    result.stream = std::make_shared<RequestStream>(next_stream_id_++, requests.size());
    inbox_.push_back(Submission{result.stream, std::move(requests)});
    inbox_requests_ += count;
    // Counted as waiting at once, so that concurrent submitters see each other.
    stats_.num_waiting += count;
  }
  work_ready_.notify_one();
  return result;
}

void AsyncEngine::cancel(int64_t stream_id, int32_t index) {
  {
    std::lock_guard lock(mutex_);
    cancels_.push_back(Cancel{stream_id, index});
  }
  work_ready_.notify_one();
}

AsyncEngineStats AsyncEngine::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

EngineHealth AsyncEngine::health() const {
  std::lock_guard lock(mutex_);
  if (health_.serving && stop_) return EngineHealth{false, "the engine is shutting down"};
  return health_;
}

void AsyncEngine::shutdown(bool drain) {
  {
    std::lock_guard lock(mutex_);
    if (!stop_) {
      stop_ = true;
      drain_ = drain;
    }
  }
  work_ready_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void AsyncEngine::run() {
  // CUDA keeps the current device per thread, and this thread did not build the model: make its
  // device current here (synchronize selects it) before the first step.
  const Device device = engine_->model().device();
  if (device.is_cuda()) synchronize(device);
  for (;;) {
    std::vector<Submission> submissions;
    std::vector<Cancel> cancels;
    bool stopping = false;
    bool drain = false;
    {
      std::unique_lock lock(mutex_);
      const bool busy = engine_->has_unfinished();
      work_ready_.wait(lock, [&] { return busy || stop_ || !inbox_.empty() || !cancels_.empty(); });
      submissions.swap(inbox_);
      cancels.swap(cancels_);
      inbox_requests_ = 0;
      stopping = stop_;
      drain = drain_;
    }
    if (stopping && !drain) {
      for (Submission& submission : submissions) {
        submission.stream->push(make_error(StreamErrorKind::kShuttingDown, "the server is shutting down"));
        submission.stream->close();
        counters_.failed += static_cast<int64_t>(submission.requests.size());
      }
      submissions.clear();
      for (const auto& [stream_id, group] : groups_) cancels.push_back(Cancel{stream_id, -1});
    }
    admit(submissions);
    for (const Cancel& cancel : cancels) cancel_requests(cancel);
    if (engine_->has_unfinished() || !cancels.empty()) {
      try {
        std::vector<TokenEvent> events = engine_->step();
        // Counts first: a reader that sees a token must see the step's running/waiting counts too.
        publish_stats();
        route(events);
      } catch (const std::exception& e) {
        // Engine::step contains the failures of a step; one that escapes it leaves nothing to trust.
        METRALE_LOG_ERROR("engine step failed: {}", e.what());
        {
          std::lock_guard lock(mutex_);
          health_ = EngineHealth{false, std::string("the engine failed outside a step: ") + e.what()};
        }
        fail_all(StreamErrorKind::kInternal, std::string("the engine failed: ") + e.what());
      }
    }
    publish_stats();
    if (stopping && groups_.empty()) {
      std::lock_guard lock(mutex_);
      if (inbox_.empty()) break;
    }
  }
}

void AsyncEngine::admit(std::vector<Submission>& submissions) {
  for (Submission& submission : submissions) {
    Group group;
    group.stream = submission.stream;
    try {
      for (Request& request : submission.requests) group.engine_ids.push_back(engine_->add_request(std::move(request)));
    } catch (const std::exception& e) {
      // All or nothing: the requests of the group already added are withdrawn.
      for (const int64_t id : group.engine_ids) engine_->release(id);
      const Error* error = dynamic_cast<const Error*>(&e);
      const bool invalid = error != nullptr && error->code() == ErrorCode::kInvalidArgument;
      const bool unavailable = error != nullptr && error->code() == ErrorCode::kUnavailable;
      submission.stream->push(make_error(invalid       ? StreamErrorKind::kInvalidRequest
                                         : unavailable ? StreamErrorKind::kUnavailable
                                                       : StreamErrorKind::kInternal,
                                         e.what()));
      submission.stream->close();
      if (invalid) counters_.rejected += static_cast<int64_t>(submission.requests.size());
      else counters_.failed += static_cast<int64_t>(submission.requests.size());
      continue;
    }
    for (size_t i = 0; i < group.engine_ids.size(); ++i)
      owners_[group.engine_ids[i]] = Owner{submission.stream->id(), static_cast<int32_t>(i)};
    group.unfinished = group.engine_ids.size();
    submission.stream->push(make_event(StreamEvent::Kind::kAdmitted, -1));
    groups_.emplace(submission.stream->id(), std::move(group));
  }
}

void AsyncEngine::cancel_requests(const Cancel& cancel) {
  const auto it = groups_.find(cancel.stream_id);
  if (it == groups_.end()) return;
  // The aborts surface as events of the next step() and are routed like any finish.
  const std::vector<int64_t>& ids = it->second.engine_ids;
  for (size_t i = 0; i < ids.size(); ++i) {
    if ((cancel.index < 0 || static_cast<size_t>(cancel.index) == i) && owners_.contains(ids[i]))
      engine_->abort_request(ids[i]);
  }
}

void AsyncEngine::route(const std::vector<TokenEvent>& events) {
  for (const TokenEvent& token_event : events) {
    const auto owner = owners_.find(token_event.request_id);
    if (owner == owners_.end()) continue;
    const auto group_it = groups_.find(owner->second.stream_id);
    METRALE_CHECK(group_it != groups_.end(), "request {} belongs to no stream", token_event.request_id);
    if (token_event.finish_reason == FinishReason::kError) {
      fail_group(owner->second.stream_id, StreamErrorKind::kInternal, token_event.error);
      continue;
    }
    Group& group = group_it->second;
    const bool has_token = token_event.sampled.token >= 0;
    StreamEvent event =
        make_event(has_token ? StreamEvent::Kind::kToken : StreamEvent::Kind::kFinished, owner->second.index);
    event.sampled = token_event.sampled;
    event.prompt_logprobs = token_event.prompt_logprobs;
    event.finish_reason = token_event.finish_reason;
    group.stream->push(std::move(event));
    if (!token_event.finished()) continue;
    switch (token_event.finish_reason) {
      case FinishReason::kStop: ++counters_.finished_stop; break;
      case FinishReason::kLength: ++counters_.finished_length; break;
      case FinishReason::kAbort: ++counters_.finished_abort; break;
      case FinishReason::kError:
      case FinishReason::kNone: break;
    }
    engine_->release(token_event.request_id);
    owners_.erase(owner);
    if (--group.unfinished == 0) {
      group.stream->close();
      groups_.erase(group_it);
    }
  }
}

void AsyncEngine::fail_group(int64_t stream_id, StreamErrorKind kind, const std::string& message) {
  const auto it = groups_.find(stream_id);
  if (it == groups_.end()) return;
  Group& group = it->second;
  // The group's other requests end with it (released: aborted when still running).
  for (const int64_t id : group.engine_ids) {
    if (owners_.erase(id) == 0) continue;
    ++counters_.failed;
    try {
      engine_->release(id);
    } catch (const std::exception& e) {
      METRALE_LOG_ERROR("releasing request {} after a failure: {}", id, e.what());
    }
  }
  group.stream->push(make_error(kind, message));
  group.stream->close();
  groups_.erase(it);
}

void AsyncEngine::fail_all(StreamErrorKind kind, const std::string& message) {
  std::vector<int64_t> streams;
  for (const auto& [stream_id, group] : groups_) streams.push_back(stream_id);
  for (const int64_t stream_id : streams) fail_group(stream_id, kind, message);
}

void AsyncEngine::publish_stats() {
  const EngineStats engine_stats = engine_->stats();
  std::lock_guard lock(mutex_);
  if (health_.serving) health_ = engine_->health();
  stats_.engine = engine_stats;
  stats_.num_running = static_cast<int64_t>(engine_->num_running());
  stats_.num_waiting = static_cast<int64_t>(engine_->num_waiting()) + inbox_requests_;
  stats_.finished_stop = counters_.finished_stop;
  stats_.finished_length = counters_.finished_length;
  stats_.finished_abort = counters_.finished_abort;
  stats_.failed = counters_.failed;
  stats_.rejected = counters_.rejected;
}

}  // namespace metrale
