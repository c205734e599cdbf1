#include "runtime/communicator.h"

#include <cstring>

#include "core/dtype.h"

namespace metrale {
namespace {

void expect_float_contiguous(const Tensor& tensor, const char* op) {
  if (!tensor.is_contiguous() || !is_floating(tensor.dtype()) || tensor.dtype() == DType::kF8E4M3) {
    raise_message(ErrorCode::kInvalidArgument,
                  std::string(op) + ": needs a contiguous f32, bf16 or f16 tensor, got " + tensor.describe());
  }
}

void expect_gather_shapes(const Tensor& in, const Tensor& out, int ranks) {
  const bool ok = in.is_contiguous() && out.is_contiguous() && in.dtype() == out.dtype() && in.ndim() >= 1 &&
                  out.ndim() == in.ndim() && out.size(0) == in.size(0) * ranks && out.numel() == in.numel() * ranks;
  if (!ok) {
    raise_message(ErrorCode::kInvalidArgument, "all_gather over " + std::to_string(ranks) + " ranks: in " +
                                                   in.describe() + " and out " + out.describe() +
                                                   " (contiguous, the same dtype, out.size(0) = ranks * in.size(0))");
  }
}

const char* op_name(int op) {
  static constexpr const char* kNames[] = {"all_reduce_sum", "all_gather", "barrier"};
  return kNames[op];
}

}  // namespace

void SingleRank::all_reduce_sum(const Tensor& tensor) {
  expect_float_contiguous(tensor, "all_reduce_sum");
}

void SingleRank::all_gather(const Tensor& in, const Tensor& out) {
  expect_gather_shapes(in, out, 1);
  copy_tensor(out, in);
}

class InProcessGroup::Rank final : public Communicator {
 public:
  Rank(InProcessGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size_; }
  void all_reduce_sum(const Tensor& tensor) override { group_.run(rank_, Op::kAllReduceSum, tensor, tensor); }
  void all_gather(const Tensor& in, const Tensor& out) override { group_.run(rank_, Op::kAllGather, in, out); }
  void barrier() override { group_.run(rank_, Op::kBarrier, Tensor(), Tensor()); }
  void abort(const std::string& reason) override { group_.fail(rank_, reason); }

 private:
  InProcessGroup& group_;
  int rank_;
};

InProcessGroup::InProcessGroup(int size) : size_(size) {
  if (size < 1) raise_message(ErrorCode::kInvalidArgument, "an in-process group needs at least one rank");
  for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<Rank>(*this, r));
  inputs_.resize(static_cast<size_t>(size));
  outputs_.resize(static_cast<size_t>(size));
}

InProcessGroup::~InProcessGroup() = default;

Communicator& InProcessGroup::communicator(int rank) {
  if (rank < 0 || rank >= size_) {
    raise_message(ErrorCode::kInvalidArgument,
                  "rank " + std::to_string(rank) + " of a group of " + std::to_string(size_));
  }
  return *ranks_[static_cast<size_t>(rank)];
}

void InProcessGroup::check_aborted() const {
  if (!abort_reason_.empty()) raise_message(ErrorCode::kUnavailable, abort_reason_);
}

void InProcessGroup::fail(int rank, const std::string& reason) {
  const std::lock_guard lock(mutex_);
  if (abort_reason_.empty()) abort_reason_ = "rank " + std::to_string(rank) + " of the group aborted: " + reason;
  changed_.notify_all();
}

// Runs with every rank posted and waiting: it may read every rank's tensors.
void InProcessGroup::combine(Op op) {
  const Tensor& first = inputs_[0];
  if (op == Op::kAllReduceSum) {
    for (const Tensor& tensor : inputs_) {
      expect_float_contiguous(tensor, "all_reduce_sum");
      if (tensor.dtype() != first.dtype() || !(tensor.shape() == first.shape())) {
        raise_message(ErrorCode::kInvalidArgument,
                      "all_reduce_sum: rank 0 gives " + first.describe() + ", another rank " + tensor.describe());
      }
    }
    const auto n = static_cast<size_t>(first.numel());
    sum_.assign(n, 0.0f);
    for (const Tensor& tensor : inputs_) {  // rank order: the same bits on every rank
      for (size_t i = 0; i < n; ++i) sum_[i] += load_as_f32(tensor.dtype(), tensor.data(), i);
    }
  } else if (op == Op::kAllGather) {
    for (int r = 0; r < size_; ++r) {
      expect_gather_shapes(inputs_[static_cast<size_t>(r)], outputs_[static_cast<size_t>(r)], size_);
      if (!(inputs_[static_cast<size_t>(r)].shape() == first.shape())) {
        raise_message(ErrorCode::kInvalidArgument, "all_gather: rank 0 gives " + first.describe() + ", rank " +
                                                       std::to_string(r) + " " +
                                                       inputs_[static_cast<size_t>(r)].describe());
      }
    }
    const size_t bytes = first.nbytes();
    for (const Tensor& out : outputs_) {
      if (bytes == 0) break;
      for (int r = 0; r < size_; ++r) {
        std::memcpy(static_cast<char*>(out.data()) + static_cast<size_t>(r) * bytes,
                    inputs_[static_cast<size_t>(r)].data(), bytes);
      }
    }
  }
}

void InProcessGroup::run(int rank, Op op, const Tensor& in, const Tensor& out) {
  if ((in.numel() > 0 && !in.device().is_cpu()) || (out.numel() > 0 && !out.device().is_cpu())) {
    raise_message(ErrorCode::kUnsupported, "an in-process group reduces CPU tensors, got " + in.describe());
  }
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return leaving_ == 0 || !abort_reason_.empty(); });  // the last collective is over
  check_aborted();
  if (arrived_ == 0) {
    op_ = op;
  } else if (op != op_) {
    abort_reason_ = "rank " + std::to_string(rank) + " called " + op_name(static_cast<int>(op)) + " while rank(s) " +
                    "wait in " + op_name(static_cast<int>(op_));
    changed_.notify_all();
    check_aborted();
  }
  inputs_[static_cast<size_t>(rank)] = in;
  outputs_[static_cast<size_t>(rank)] = out;
  const int64_t generation = generation_;
  if (++arrived_ == size_) {
    try {
      combine(op);
    } catch (const Error& error) {
      abort_reason_ = std::string(op_name(static_cast<int>(op))) + " failed: " + error.what();
      changed_.notify_all();
      throw;
    }
    arrived_ = 0;
    leaving_ = size_;
    ++generation_;
    changed_.notify_all();
  } else {
    changed_.wait(lock, [&] { return generation_ != generation || !abort_reason_.empty(); });
    if (generation_ == generation) check_aborted();
  }
  if (op == Op::kAllReduceSum) {
    // This rank's own tensor from the shared fp32 sum; the next collective waits for every rank here.
    lock.unlock();
    if (!sum_.empty()) convert_from_f32(in.dtype(), sum_.data(), in.data(), sum_.size());  // an empty tensor may have no data
    lock.lock();
  }
  if (--leaving_ == 0) changed_.notify_all();
}

}  // namespace metrale
