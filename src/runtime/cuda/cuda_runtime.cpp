// The CUDA backend of the runtime floor: device hooks (allocation, copies), the per-device current
// stream, and the error policy of cuda_check.h.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "core/strings.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/device_hooks.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

bool is_sticky(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

// The current stream of the GPU that holds `device_pointer` (device 0 for memory CUDA does not
// know), made the calling thread's device: a copy or memset queues behind the kernels of the device
// whose memory it touches, whichever device the thread worked on before (tensor-parallel ranks).
cudaStream_t stream_of_pointer(const void* device_pointer) {
  cudaPointerAttributes attributes{};
  int device = 0;
  if (cudaPointerGetAttributes(&attributes, device_pointer) == cudaSuccess) {
    if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) device = attributes.device;
  } else {
    cudaGetLastError();
  }
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != device) METRALE_CUDA_CHECK(cudaSetDevice(device));
  return static_cast<cudaStream_t>(current_stream(Device::cuda(device)));
}

class CudaHooks final : public DeviceHooks {
 public:
  int device_count() const override {
    std::call_once(count_once_, [this] {
      int count = 0;
      if (cudaGetDeviceCount(&count) != cudaSuccess) {
        count = 0;
        cudaGetLastError();  // no driver or no device: clear the error, report none
      }
      count_ = count;
    });
    return count_;
  }

  void* allocate(int device_index, size_t bytes) override {
    METRALE_CUDA_CHECK(cudaSetDevice(device_index));
    void* pointer = nullptr;
    const cudaError_t error = cudaMalloc(&pointer, bytes);
    if (error != cudaSuccess) {
      cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      raise(ErrorCode::kOutOfMemory, "cannot allocate {} on cuda:{} ({} free of {})", format_bytes(bytes), device_index,
            format_bytes(free_bytes), format_bytes(total_bytes));
    }
    return pointer;
  }

  void release(int /*device_index*/, void* pointer) noexcept override { cudaFree(pointer); }

  void copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, size_t bytes) override {
    const cudaMemcpyKind kind = dst_on_device ? (src_on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                              : (src_on_device ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
    const cudaStream_t stream = stream_of_pointer(dst_on_device ? dst : src);
    METRALE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream));
    // Host memory may be pageable and reused right after: complete the copy before returning.
    if (!dst_on_device || !src_on_device) METRALE_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  void memset(void* pointer, int value, size_t bytes) override {
    METRALE_CUDA_CHECK(cudaMemsetAsync(pointer, value, bytes, stream_of_pointer(pointer)));
  }

  void* allocate_pinned(size_t bytes) override {
    void* pointer = nullptr;
    if (cudaHostAlloc(&pointer, bytes, cudaHostAllocDefault) != cudaSuccess) {
      cudaGetLastError();
      raise(ErrorCode::kOutOfMemory, "cannot allocate {} of pinned host memory", format_bytes(bytes));
    }
    return pointer;
  }

  void release_pinned(void* pointer) noexcept override { cudaFreeHost(pointer); }

  void copy_async(void* dst, bool dst_on_device, const void* src, bool src_on_device, size_t bytes) override {
    const cudaMemcpyKind kind = dst_on_device ? (src_on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                              : (src_on_device ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
    METRALE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream_of_pointer(dst_on_device ? dst : src)));
  }

  void copy_batch_async(int device_index, std::span<const CopySegment> segments, void* on_stream) override {
    use_device(device_index);
    const auto stream = on_stream != nullptr ? static_cast<cudaStream_t>(on_stream)
                                             : static_cast<cudaStream_t>(current_stream(Device::cuda(device_index)));
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
    for (const CopySegment& segment : segments) {
      if (segment.bytes == 0) continue;
      dsts.push_back(segment.dst);
      srcs.push_back(segment.src);
      sizes.push_back(segment.bytes);
    }
    if (dsts.empty()) return;
    // One attribute for every copy: the sources are read in stream order (what wrote them comes
    // first on this stream, or is waited for by it).
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t attribute_index = 0;
    const cudaError_t status = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attributes,
                                                    &attribute_index, 1, stream);
    if (status == cudaSuccess) return;
    cudaGetLastError();  // a driver without batched copies: one copy each
    for (size_t i = 0; i < dsts.size(); ++i)
      METRALE_CUDA_CHECK(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream));
  }

  void* create_stream(int device_index) override {
    use_device(device_index);
    cudaStream_t stream = nullptr;
    METRALE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return stream;
  }

  void destroy_stream(void* stream) noexcept override { cudaStreamDestroy(static_cast<cudaStream_t>(stream)); }

  void* create_event(int device_index) override {
    use_device(device_index);
    cudaEvent_t event = nullptr;
    METRALE_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }

  void destroy_event(void* event) noexcept override { cudaEventDestroy(static_cast<cudaEvent_t>(event)); }

  void record_event(int device_index, void* event, void* stream) override {
    use_device(device_index);
    METRALE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), stream_or_current(device_index, stream)));
  }

  void wait_event(int device_index, void* stream, void* event) override {
    use_device(device_index);
    METRALE_CUDA_CHECK(cudaStreamWaitEvent(stream_or_current(device_index, stream), static_cast<cudaEvent_t>(event), 0));
  }

  bool event_done(void* event) override {
    const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (status == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    METRALE_CUDA_CHECK(status);
    return true;
  }

  void synchronize_event(void* event) override {
    METRALE_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
  }

  void synchronize_stream(void* stream) override {
    METRALE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  }

  void memory_info(int device_index, size_t& free_bytes, size_t& total_bytes) override {
    METRALE_CUDA_CHECK(cudaSetDevice(device_index));
    METRALE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  }

  void synchronize(int device_index) override {
    METRALE_CUDA_CHECK(cudaSetDevice(device_index));
    METRALE_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(current_stream(Device::cuda(device_index)))));
  }

 private:
  static void use_device(int device_index) {
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != device_index) METRALE_CUDA_CHECK(cudaSetDevice(device_index));
  }
  static cudaStream_t stream_or_current(int device_index, void* stream) {
    return stream != nullptr ? static_cast<cudaStream_t>(stream)
                             : static_cast<cudaStream_t>(current_stream(Device::cuda(device_index)));
  }

  mutable std::once_flag count_once_;
  mutable int count_ = 0;
};

}  // namespace

DeviceHooks* cuda_hooks() {
  static CudaHooks hooks;
  return &hooks;
}

void* current_stream(Device device) {
  if (device.is_cpu()) return nullptr;
  // One stream per device, created on first use and kept for the life of the process (streams
  // must outlive every graph that captured them).
  static std::mutex mutex;
  static std::vector<cudaStream_t> streams;
  std::lock_guard lock(mutex);
  if (static_cast<int>(streams.size()) <= device.index) streams.resize(static_cast<size_t>(device.index) + 1, nullptr);
  cudaStream_t& stream = streams[static_cast<size_t>(device.index)];
  if (stream == nullptr) {
    METRALE_CUDA_CHECK(cudaSetDevice(device.index));
    METRALE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  return stream;
}

void synchronize(Device device) {
  if (device.is_cuda()) cuda_hooks()->synchronize(device.index);
}

void set_current_device(Device device) {
  if (device.is_cuda()) METRALE_CUDA_CHECK(cudaSetDevice(device.index));
}

void cuda_fail(cudaError_t error, const char* what, const char* file, int line) {
  const std::string message =
      fmt::format("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(error), cudaGetErrorString(error), what, file, line);
  if (is_sticky(error)) {
    // The context is poisoned: no later CUDA call can succeed, so serving cannot continue.
    std::fprintf(stderr, "metrale: fatal: %s\n", message.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
  throw Error(error == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory : ErrorCode::kInternal, message);
}

void check_launch(const char* kernel, const char* file, int line) {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) cuda_fail(error, kernel, file, line);
}

}  // namespace metrale
