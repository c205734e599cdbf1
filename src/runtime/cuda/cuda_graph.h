// RAII wrappers for CUDA graphs and events (CUDA builds only).
#pragma once

#include <cuda_runtime_api.h>

namespace metrale {

// A captured and instantiated graph. Capture records every launch made on `stream` between
// begin_capture and end_capture; launch replays them with the same pointers and parameters.
class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph();
  CudaGraph(CudaGraph&& other) noexcept;
  CudaGraph& operator=(CudaGraph&& other) noexcept;
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  void begin_capture(cudaStream_t stream);
  void end_capture(cudaStream_t stream);  // instantiates the graph
  void launch(cudaStream_t stream) const;
  bool ready() const { return exec_ != nullptr; }

 private:
  void reset() noexcept;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// A stream of its own (non-blocking: no implicit ordering with the legacy default stream).
class CudaStream {
 public:
  CudaStream();
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class CudaEvent {
 public:
  // `timing` false: an ordering-only event (cheaper to record and wait for).
  explicit CudaEvent(bool timing = true);
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(cudaStream_t stream);
  // Work queued on `stream` after this call waits until the last record() has completed.
  void wait_in(cudaStream_t stream) const;
  void synchronize() const;
  // Milliseconds from `start` to this event; both must have completed.
  float elapsed_ms_since(const CudaEvent& start) const;

 private:
  cudaEvent_t event_ = nullptr;
};

}  // namespace metrale
