// Collectives over a group of ranks: the seam tensor and expert parallelism reduce through. A rank
// calls every collective of the group in the same order as the other ranks, with tensors of the same
// dtype and shape (as NCCL requires); the call returns once this rank's result is in place.
//
// Two implementations here: SingleRank (a group of one: TP = 1 costs nothing) and InProcessGroup
// (ranks as threads of one process over host tensors: the CPU stand-in for NCCL that the sharding
// tests run on). Sums are taken in rank order in fp32 and rounded once to the tensor's dtype, so that
// every rank holds the same bits and the result does not depend on which rank arrived first.
//
// A rank that cannot go on (an exception in its forward, a bad shape) calls abort(reason): every rank
// waiting in, or later entering, a collective of the group raises instead of waiting for it forever.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/tensor.h"

namespace metrale {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // In place: `tensor` (contiguous, float dtype) becomes the element-wise sum over the ranks.
  virtual void all_reduce_sum(const Tensor& tensor) = 0;
  // `out` [size * in.size(0), ...] (contiguous) = every rank's `in` (contiguous) along dim 0, in rank order.
  virtual void all_gather(const Tensor& in, const Tensor& out) = 0;
  // Returns once every rank has called it.
  virtual void barrier() = 0;
  // Makes every rank's current and next collective raise kUnavailable naming this rank and `reason`.
  virtual void abort(const std::string& reason) = 0;
};

// A group of one rank.
class SingleRank final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(const Tensor& tensor) override;
  void all_gather(const Tensor& in, const Tensor& out) override;
  void barrier() override {}
  void abort(const std::string& /*reason*/) override {}
};

// `size` ranks as threads of this process, over CPU tensors. communicator(r) is rank r's handle; the
// group outlives every handle's use.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int size() const { return size_; }
  Communicator& communicator(int rank);

 private:
  class Rank;
  enum class Op { kAllReduceSum, kAllGather, kBarrier };

  // One collective: every rank posts its tensors, the last to arrive combines them, every rank
  // collects its result and leaves; the next collective starts when all have left.
  void run(int rank, Op op, const Tensor& in, const Tensor& out);
  void fail(int rank, const std::string& reason);
  // Raises the abort reason, if any (the mutex held).
  void check_aborted() const;
  void combine(Op op);

  const int size_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int64_t generation_ = 0;  // collectives completed
  int arrived_ = 0;         // ranks posted in the current collective
  int leaving_ = 0;         // ranks yet to collect the current result
  Op op_ = Op::kBarrier;
  std::vector<Tensor> inputs_, outputs_;  // per rank, the current collective's tensors
  std::vector<float> sum_;                // all_reduce_sum's result, fp32
  std::string abort_reason_;
};

}  // namespace metrale
