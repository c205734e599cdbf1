#include "runtime/copy_lane.h"

#include <cstring>
#include <utility>

#include "core/error.h"
#include "runtime/buffer.h"

namespace metrale {
namespace {

DeviceHooks& hooks_for(Device device) {
  DeviceHooks* hooks = cuda_hooks();
  METRALE_CHECK(hooks != nullptr, "a copy lane on {} in a build without CUDA", device.to_string());
  return *hooks;
}

}  // namespace

CopyLane::CopyLane(Device device) : device_(device) {
  if (device.is_cpu()) return;
  hooks_ = &hooks_for(device);
  stream_ = hooks_->create_stream(device.index);
  current_mark_ = hooks_->create_event(device.index);
  events_.reserve(kEvents);
  for (size_t i = 0; i < kEvents; ++i) events_.push_back(hooks_->create_event(device.index));
}

CopyLane::~CopyLane() {
  release();
}

CopyLane::CopyLane(CopyLane&& other) noexcept
    : device_(other.device_),
      hooks_(std::exchange(other.hooks_, nullptr)),
      stream_(std::exchange(other.stream_, nullptr)),
      current_mark_(std::exchange(other.current_mark_, nullptr)),
      events_(std::move(other.events_)),
      next_(std::exchange(other.next_, 1)),
      done_(std::exchange(other.done_, 0)) {
  other.events_.clear();
}

CopyLane& CopyLane::operator=(CopyLane&& other) noexcept {
  if (this != &other) {
    release();
    device_ = other.device_;
    hooks_ = std::exchange(other.hooks_, nullptr);
    stream_ = std::exchange(other.stream_, nullptr);
    current_mark_ = std::exchange(other.current_mark_, nullptr);
    events_ = std::move(other.events_);
    other.events_.clear();
    next_ = std::exchange(other.next_, 1);
    done_ = std::exchange(other.done_, 0);
  }
  return *this;
}

void CopyLane::release() noexcept {
  if (stream_ == nullptr || hooks_ == nullptr) return;
  DeviceHooks* hooks = hooks_;
  try {
    hooks->synchronize_stream(stream_);  // pinned memory the copies touch may be freed next
  } catch (...) {                        // a poisoned context: nothing left to wait for
  }
  for (void* event : events_) hooks->destroy_event(event);
  events_.clear();
  hooks->destroy_event(current_mark_);
  hooks->destroy_stream(stream_);
  stream_ = current_mark_ = nullptr;
}

CopyLane::Ticket CopyLane::copy_after_current(std::span<const CopySegment> segments) {
  const Ticket ticket = next_++;
  if (stream_ == nullptr) {
    copy_segments_async(device_, segments);  // the CPU device: at once
    done_ = ticket;
    return ticket;
  }
  DeviceHooks& hooks = *hooks_;
  // The ring's event for this ticket last served ticket - kEvents: re-recorded only once that ran.
  if (ticket > kEvents && done_ < ticket - kEvents) wait(ticket - kEvents);
  hooks.record_event(device_.index, current_mark_, nullptr);
  hooks.wait_event(device_.index, stream_, current_mark_);
  hooks.copy_batch_async(device_.index, segments, stream_);
  hooks.record_event(device_.index, event_of(ticket), stream_);
  return ticket;
}

bool CopyLane::done(Ticket ticket) {
  if (ticket <= done_) return true;
  METRALE_CHECK(ticket < next_, "copy lane ticket {} was never given (next {})", ticket, next_);
  if (!hooks_->event_done(event_of(ticket))) return false;
  done_ = ticket;
  return true;
}

void CopyLane::hold_current_until(Ticket ticket) {
  if (done(ticket)) return;
  hooks_->wait_event(device_.index, nullptr, event_of(ticket));
}

void CopyLane::wait(Ticket ticket) {
  if (ticket <= done_) return;
  METRALE_CHECK(ticket < next_, "copy lane ticket {} was never given (next {})", ticket, next_);
  hooks_->synchronize_event(event_of(ticket));
  done_ = ticket;
}

void CopyLane::wait_all() {
  if (next_ > 1) wait(next_ - 1);
}

}  // namespace metrale
