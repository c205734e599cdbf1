#include "runtime/cuda/cuda_graph.h"

#include <utility>

#include "runtime/cuda/cuda_check.h"

namespace metrale {

CudaGraph::~CudaGraph() { reset(); }

CudaGraph::CudaGraph(CudaGraph&& other) noexcept
    : graph_(std::exchange(other.graph_, nullptr)), exec_(std::exchange(other.exec_, nullptr)) {}

CudaGraph& CudaGraph::operator=(CudaGraph&& other) noexcept {
  if (this != &other) {
    reset();
    graph_ = std::exchange(other.graph_, nullptr);
    exec_ = std::exchange(other.exec_, nullptr);
  }
  return *this;
}

void CudaGraph::reset() noexcept {
  if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
  if (graph_ != nullptr) cudaGraphDestroy(graph_);
  exec_ = nullptr;
  graph_ = nullptr;
}

void CudaGraph::begin_capture(cudaStream_t stream) {
  reset();
  // Thread-local mode: other threads may keep using CUDA (e.g. the server copying results).
  METRALE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
}

void CudaGraph::end_capture(cudaStream_t stream) {
  METRALE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
  METRALE_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  // Upload now: otherwise the first launch pays it, and a timed first step (the speculation
  // controller's first sample of a shape) looks far dearer than the ones after.
  METRALE_CUDA_CHECK(cudaGraphUpload(exec_, stream));
}

void CudaGraph::launch(cudaStream_t stream) const { METRALE_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

CudaStream::CudaStream() {
  METRALE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}
CudaStream::~CudaStream() {
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

CudaEvent::CudaEvent(bool timing) {
  METRALE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
}
CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}
void CudaEvent::record(cudaStream_t stream) { METRALE_CUDA_CHECK(cudaEventRecord(event_, stream)); }
void CudaEvent::wait_in(cudaStream_t stream) const {
  METRALE_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
}
void CudaEvent::synchronize() const { METRALE_CUDA_CHECK(cudaEventSynchronize(event_)); }
float CudaEvent::elapsed_ms_since(const CudaEvent& start) const {
  float ms = 0.0f;
  METRALE_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
  return ms;
}

}  // namespace metrale
