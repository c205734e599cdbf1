#include "runtime/cuda/nccl_group.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <nccl.h>

#include <type_traits>

#include "core/error.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/stream.h"

namespace metrale {
namespace {

// NCCL's entry points, resolved from libnccl.so.2 when the first group is made: a binary that never
// makes a group runs where NCCL is not installed.
struct NcclLibrary {
  decltype(&ncclCommInitAll) comm_init_all = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetLastError) last_error = nullptr;
};

const NcclLibrary& nccl() {
  static const NcclLibrary library = [] {
    void* handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    if (handle == nullptr) {
      raise(ErrorCode::kUnavailable, "tensor parallelism over GPUs needs NCCL: cannot load libnccl.so.2 ({})",
            dlerror());
    }
    NcclLibrary loaded;
    const auto resolve = [&](auto& function, const char* name) {
      function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(dlsym(handle, name));
      if (function == nullptr) raise(ErrorCode::kUnavailable, "libnccl.so.2 has no {}", name);
    };
    resolve(loaded.comm_init_all, "ncclCommInitAll");
    resolve(loaded.comm_destroy, "ncclCommDestroy");
    resolve(loaded.comm_abort, "ncclCommAbort");
    resolve(loaded.all_reduce, "ncclAllReduce");
    resolve(loaded.all_gather, "ncclAllGather");
    resolve(loaded.error_string, "ncclGetErrorString");
    resolve(loaded.last_error, "ncclGetLastError");
    return loaded;
  }();
  return library;
}

ncclDataType_t nccl_type(DType dtype, const char* op) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    default:
      raise(ErrorCode::kInvalidArgument, "{}: NCCL reduces f32, bf16 or f16 tensors, not {}", op, dtype_name(dtype));
  }
}

void nccl_check(ncclResult_t result, const char* what) {
  if (result != ncclSuccess && result != ncclInProgress) {
    raise(ErrorCode::kUnavailable, "NCCL {} failed: {} ({})", what, nccl().error_string(result),
          nccl().last_error(nullptr));
  }
}

}  // namespace

class NcclGroup::Rank final : public Communicator {
 public:
  Rank(NcclGroup& group, int rank, ncclComm_t comm) : group_(group), rank_(rank), comm_(comm) {}
  ~Rank() override {
    if (comm_ != nullptr) nccl().comm_destroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }

  void all_reduce_sum(const Tensor& tensor) override {
    expect_on_device(tensor, "all_reduce_sum");
    if (!tensor.is_contiguous()) raise(ErrorCode::kInvalidArgument, "all_reduce_sum of {}", tensor.describe());
    const ncclDataType_t type = nccl_type(tensor.dtype(), "all_reduce_sum");
    group_.check_aborted();
    nccl_check(nccl().all_reduce(tensor.data(), tensor.data(), static_cast<size_t>(tensor.numel()), type, ncclSum,
                                 comm_, stream()),
               "all_reduce_sum");
  }

  void all_gather(const Tensor& in, const Tensor& out) override {
    expect_on_device(in, "all_gather");
    expect_on_device(out, "all_gather");
    if (!in.is_contiguous() || !out.is_contiguous() || in.dtype() != out.dtype() || in.ndim() < 1 ||
        out.ndim() != in.ndim() || out.size(0) != in.size(0) * size() || out.numel() != in.numel() * size()) {
      raise(ErrorCode::kInvalidArgument, "all_gather over {} ranks: in {} out {}", size(), in.describe(),
            out.describe());
    }
    group_.check_aborted();
    nccl_check(nccl().all_gather(in.data(), out.data(), static_cast<size_t>(in.numel()),
                                 nccl_type(in.dtype(), "all_gather"), comm_, stream()),
               "all_gather");
  }

  void barrier() override {
    group_.check_aborted();
    if (flag_ == nullptr) {
      METRALE_CUDA_CHECK(cudaSetDevice(group_.device(rank_)));
      METRALE_CUDA_CHECK(cudaMalloc(&flag_, sizeof(float)));
    }
    nccl_check(nccl().all_reduce(flag_, flag_, 1, ncclFloat32, ncclSum, comm_, stream()), "barrier");
    METRALE_CUDA_CHECK(cudaStreamSynchronize(stream()));
    group_.check_aborted();
  }

  void abort(const std::string& reason) override { group_.fail(rank_, reason); }

  // Aborts this rank's communicator (the group's abort, once per rank).
  void abort_communicator() {
    if (comm_ != nullptr) nccl().comm_abort(comm_);
    comm_ = nullptr;
  }

 private:
  cudaStream_t stream() const { return static_cast<cudaStream_t>(current_stream(Device::cuda(group_.device(rank_)))); }
  void expect_on_device(const Tensor& tensor, const char* op) const {
    if (tensor.numel() > 0 && tensor.device() != Device::cuda(group_.device(rank_))) {
      raise(ErrorCode::kInvalidArgument, "{}: rank {} runs on cuda:{}, got {}", op, rank_, group_.device(rank_),
            tensor.describe());
    }
  }

  NcclGroup& group_;
  int rank_;
  ncclComm_t comm_;
  float* flag_ = nullptr;  // barrier's one-element buffer (left to the process's end: freeing needs the device)
};

NcclGroup::NcclGroup(std::vector<int> devices) : devices_(std::move(devices)) {
  if (devices_.empty()) raise(ErrorCode::kInvalidArgument, "an NCCL group needs at least one device");
  std::vector<ncclComm_t> comms(devices_.size(), nullptr);
  nccl_check(nccl().comm_init_all(comms.data(), static_cast<int>(devices_.size()), devices_.data()),
             fmt::format("init over {} devices", devices_.size()).c_str());
  for (size_t r = 0; r < comms.size(); ++r)
    ranks_.push_back(std::make_unique<Rank>(*this, static_cast<int>(r), comms[r]));
}

NcclGroup::~NcclGroup() = default;

Communicator& NcclGroup::communicator(int rank) {
  if (rank < 0 || rank >= size()) raise(ErrorCode::kInvalidArgument, "rank {} of an NCCL group of {}", rank, size());
  return *ranks_[static_cast<size_t>(rank)];
}

void NcclGroup::check_aborted() {
  const std::lock_guard lock(mutex_);
  if (!abort_reason_.empty()) raise_message(ErrorCode::kUnavailable, abort_reason_);
}

void NcclGroup::fail(int rank, const std::string& reason) {
  const std::lock_guard lock(mutex_);
  if (!abort_reason_.empty()) return;
  abort_reason_ = fmt::format("rank {} of the NCCL group aborted: {}", rank, reason);
  for (auto& each : ranks_) each->abort_communicator();
}

}  // namespace metrale
