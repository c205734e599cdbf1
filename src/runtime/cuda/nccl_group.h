// NcclGroup: the tensor-parallel ranks of one process as NCCL communicators, one per local GPU
// (ncclCommInitAll). Rank r runs on devices[r]; its Communicator queues every collective on that
// device's current stream (runtime/stream.h), so collectives order with the kernels around them and
// are captured by CUDA graphs like any kernel. all_reduce_sum and all_gather take device tensors of
// the rank's device; barrier waits on the host until every rank's stream has passed it.
//
// abort(reason) aborts every communicator of the group (ncclCommAbort): a rank that failed does not
// leave the others waiting in a collective that will never complete; later collectives of any rank
// raise kUnavailable naming the failed rank and the reason.
//
// Built in CUDA builds that find NCCL (METRALE_WITH_NCCL=1).
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/communicator.h"

namespace metrale {

class NcclGroup {
 public:
  // One rank per entry of `devices` (distinct CUDA device indices). Throws kUnavailable when NCCL
  // cannot initialise them.
  explicit NcclGroup(std::vector<int> devices);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int size() const { return static_cast<int>(devices_.size()); }
  int device(int rank) const { return devices_.at(static_cast<size_t>(rank)); }
  Communicator& communicator(int rank);

 private:
  class Rank;
  void fail(int rank, const std::string& reason);
  // Raises the abort reason, if any.
  void check_aborted();

  std::vector<int> devices_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::mutex mutex_;
  std::string abort_reason_;
};

}  // namespace metrale
