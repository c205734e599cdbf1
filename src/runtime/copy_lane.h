// CopyLane: a stream of its own on one GPU for copies that overlap the forward on the device's
// current stream, and tickets that order the two streams.
//
// Each batch queued on the lane gets a ticket (1, 2, ...; 0 means none and is always done) backed
// by an event from a ring of kEvents; batches run in order, so a ticket done means every earlier
// one is. A batch queued with copy_after_current runs after everything queued on the current stream
// before the call (the lane waits for it on the device, not the host); hold_current_until makes
// work queued on the current stream afterwards wait for a ticket, again on the device. On the CPU
// device the copies run at once and every ticket is done.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "runtime/device.h"
#include "runtime/device_hooks.h"

namespace metrale {

class CopyLane {
 public:
  using Ticket = uint64_t;
  static constexpr size_t kEvents = 1024;

  CopyLane() = default;
  explicit CopyLane(Device device);
  ~CopyLane();  // waits for the lane's copies
  CopyLane(CopyLane&& other) noexcept;
  CopyLane& operator=(CopyLane&& other) noexcept;
  CopyLane(const CopyLane&) = delete;
  CopyLane& operator=(const CopyLane&) = delete;

  Device device() const { return device_; }
  // Queues the segments (device memory, pinned host memory) on the lane behind the current stream's
  // work so far; returns their ticket.
  Ticket copy_after_current(std::span<const CopySegment> segments);
  // Whether the ticket's copies have run (queries the device; never waits).
  bool done(Ticket ticket);
  // Work queued on the current stream after this waits on the device for the ticket's copies.
  void hold_current_until(Ticket ticket);
  // Waits on the host for the ticket's copies, or for every copy queued.
  void wait(Ticket ticket);
  void wait_all();

 private:
  void release() noexcept;
  void* event_of(Ticket ticket) const { return events_[ticket % kEvents]; }

  Device device_ = Device::cpu();
  DeviceHooks* hooks_ = nullptr;   // the CUDA hooks (GPU lanes only)
  void* stream_ = nullptr;        // the lane (CUDA only)
  void* current_mark_ = nullptr;  // recorded on the current stream for the lane to wait on
  std::vector<void*> events_;     // the tickets' ring
  Ticket next_ = 1;               // the next ticket to give
  Ticket done_ = 0;               // every ticket <= done_ has run
};

}  // namespace metrale
